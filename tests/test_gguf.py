"""GGUF: every supported tensor type, the q/k permutation, and clear errors for the rest."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import VOCAB, make_hf_dir, ref_logprobs, write_tiny_gguf

from logprobe import LogprobeError, Scorer
from logprobe.kernels.gguf_quants import dequantize

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf_py(name):
    qt = gguf.GGMLQuantizationType[name]
    a = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    data = gguf.quants.quantize(a, qt) if name != "F32" else a
    ref = gguf.quants.dequantize(data, qt).reshape(a.shape) if name != "F32" else a
    got = dequantize(data, int(qt), a.shape)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref)).float())


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_kquant_dequantize_matches_gguf_py(name):
    """gguf-py cannot write k-quants, but it decodes them: random valid super-blocks, bitwise."""
    from helpers import random_kquant_blocks

    qt = gguf.GGMLQuantizationType[name]
    raw = random_kquant_blocks((6, 512), name, np.random.default_rng(1))
    ref = gguf.quants.dequantize(raw, qt).reshape(6, 512)
    got = dequantize(raw, int(qt), (6, 512))
    assert got.abs().max() > 0 and torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref)).float())


def test_kquant_rows_must_hold_whole_super_blocks():
    with pytest.raises(LogprobeError, match="multiple of its block of 256"):
        dequantize(np.zeros((2, 144), np.uint8), int(gguf.GGMLQuantizationType.Q4_K), (1, 288))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_kquant_model_matches_reference_packed_and_dense(name, tmp_path):
    """A tiny Llama (width 256) whose matrices are k-quant super-blocks: logprobe, packed or
    dense, against the same architecture holding gguf-py's decoded weights in float64."""
    from helpers import make_hf_dir

    from logprobe.layers.quant_linear import GGUFLinear
    from logprobe.loading.loader import load_model

    (tmp_path / "src").mkdir()
    src = make_hf_dir(tmp_path / "src", "llama256", seed=5)
    path = tmp_path / f"tiny-{name}.gguf"
    decoded = write_tiny_gguf(path, src, name)
    ref = type(src)(src.config).double().eval()
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).double() for k, v in decoded.items()})
    ids = list(range(2, 120, 3))
    lp = ref_logprobs(ref, ids)
    tgt = lp[3:-1].gather(1, torch.tensor(ids[4:])[:, None])[:, 0]
    outs = []
    for weights in ("packed", "dense"):
        loaded = load_model(str(path), "cpu", "float32", weights=weights)
        if weights == "packed":
            assert isinstance(loaded.model.layers[0].mlp.down_proj, GGUFLinear)
            assert loaded.model.layers[0].mlp.down_proj.in_features == 512
        s = Scorer(loaded, progress=False)
        outs.append(s.logprobs([{"prompt_token_ids": ids[:4], "completion_token_ids": ids[4:]}])[0].logprobs)
    assert (outs[0].double() - tgt).abs().max() < 1e-4
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-src")
    return make_hf_dir(d, "llama", seed=11)


@pytest.mark.parametrize("name, tie", [(t, False) for t in TYPES] + [("Q4_1", True)])
def test_gguf_model_matches_reference(name, tie, tiny_llama, tmp_path):
    path = tmp_path / f"tiny-{name}.gguf"
    decoded = write_tiny_gguf(path, tiny_llama, name, tie=tie)
    # the reference: the same HF architecture holding gguf-py's dequantized weights, in float64
    ref = type(tiny_llama)(tiny_llama.config).double().eval()
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).double() for k, v in decoded.items()})
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and scorer.info.vocab_size == VOCAB
    ids = list(range(2, 60, 3))
    out = scorer.logprobs([{"prompt_token_ids": ids[:4], "completion_token_ids": ids[4:]}])[0]
    lp = ref_logprobs(ref, ids)
    tgt = lp[3:-1].gather(1, torch.tensor(ids[4:])[:, None])[:, 0]
    assert (out.logprobs.double() - tgt).abs().max() < 1e-4


def test_unsupported_type_is_named(tiny_llama, tmp_path):
    path = tmp_path / "tiny-q5.gguf"
    write_tiny_gguf(path, tiny_llama, "Q5_0")
    with pytest.raises(LogprobeError, match="Q5_0"):
        Scorer(str(path), device="cpu", progress=False)


def test_non_llama_gguf_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LogprobeError, match="gpt2"):
        Scorer(str(path), device="cpu", progress=False)

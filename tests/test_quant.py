"""Packed quantized weights (GGUF blocks, compressed-tensors int4/int8) against dense and float64 references.

* compressed-tensors checkpoints are written by the real package (``quant_helpers``): logprobe's
  packed layers must expand to exactly the weights the package decompresses, and log-probs must
  match a float64 transformers model holding those weights.
* packed and dense loads of one file give bitwise-identical log-probs (both expand with one
  function), in the default and the deterministic (row-tiled) mode.
* memory: bytes of quantized linear-layer storage (codes + scales + zero points) against the
  same layers in float16 (2 bytes per weight).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ref_logprobs, write_tiny_gguf
from quant_helpers import decompressed_state, quantize_and_save, tiny_wide_llama

from logprobe import LogprobeError, Scorer
from logprobe.config import Deterministic, EngineConfig
from logprobe.layers.quant_linear import CTLinear, GGUFLinear, PackedEmbedding, PackedWeight, weight_bytes
from logprobe.loading import load_model

SCHEMES = ["W4A16", "W4A16_ASYM", "W8A16", "W8A16_CHANNEL"]


def _seq(vocab: int, n: int = 40, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n,), generator=g).tolist()
    return {"prompt_token_ids": ids[:5], "completion_token_ids": ids[5:]}


def _ref_targets(model, seq: dict) -> torch.Tensor:
    ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
    lp = ref_logprobs(model, ids)  # [L, V] float64
    n = len(seq["prompt_token_ids"])
    return lp[n - 1:-1].gather(1, torch.tensor(ids[n:])[:, None])[:, 0]


def _linear_bytes_fp16(model) -> int:
    """Bytes the quantized linear layers would take as float16 (2 bytes per weight)."""
    return sum(2 * m.out_features * m.in_features for m in model.modules() if isinstance(m, PackedWeight))


@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory):
    """scheme -> compressed-tensors checkpoint of one tiny random Llama (group 128 fits its widths)."""
    from transformers import AutoModelForCausalLM

    src = tiny_wide_llama(tmp_path_factory.mktemp("ct-src"), seed=5)
    out = {}
    for scheme in SCHEMES:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        d = tmp_path_factory.mktemp(f"ct-{scheme}")
        from helpers import byte_tokenizer

        quantize_and_save(model, d, scheme, byte_tokenizer()[0])
        out[scheme] = d
    return out


def _reference_model(d: Path, state: dict[str, torch.Tensor]):
    """A float64 transformers Llama (no quantization config) holding the given weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(d))
    cfg.quantization_config = None
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_layers_expand_like_the_package(scheme, ct_dirs):
    d = ct_dirs[scheme]
    qcfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    ref = decompressed_state(d)  # the package's own dequantization
    loaded = load_model(str(d), "cpu", "float32", weights="packed")
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, CTLinear)}
    assert len(layers) == 2 * 7  # every Linear of both layers; lm_head is ignored (dense)
    w = qcfg["config_groups"]["group_0"]["weights"]
    for name, m in layers.items():
        assert m.num_bits == w["num_bits"] and (m.zero_point is None) == w["symmetric"]
        assert m.group_size == (m.in_features if w["strategy"] == "channel" else w["group_size"])
        want = ref[f"model.{name}.weight"]
        if ".q_proj" in name or ".k_proj" in name:  # the native model keeps q/k rows interleaved
            from logprobe.layers.rotary import to_interleaved

            heads = 4 if ".q_proj" in name else 2
            want = to_interleaved(want, heads)
        assert torch.equal(m.dense(), want), name
    assert isinstance(loaded.model.lm_head, torch.nn.Module) and not isinstance(loaded.model.lm_head, PackedWeight)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_logprobs_match_float64(scheme, ct_dirs):
    d = ct_dirs[scheme]
    ref = _reference_model(d, decompressed_state(d))
    seq = _seq(300)
    want = _ref_targets(ref, seq)
    outs = {}
    for weights in ("packed", "dense"):
        for det in (False, True):
            s = Scorer(load_model(str(d), "cpu", "float32", weights=weights),
                       config=EngineConfig(deterministic=det and Deterministic(tile=16)))
            outs[weights, det] = s.logprobs([seq])[0].logprobs
    assert (outs["packed", False].double() - want).abs().max() < 1e-4
    for det in (False, True):  # one expansion function: bitwise equal, tiled or not
        assert torch.equal(outs["packed", det], outs["dense", det])


@pytest.mark.parametrize("name, tie", [("Q4_0", False), ("Q4_1", False), ("Q8_0", False), ("Q4_1", True)])
def test_gguf_packed_equals_dense(name, tie, tmp_path):
    from helpers import make_hf_dir

    (tmp_path / "src").mkdir()
    src = make_hf_dir(tmp_path / "src", "llama", seed=7)
    path = tmp_path / f"tiny-{name}.gguf"
    write_tiny_gguf(path, src, name, tie=tie)
    packed = load_model(str(path), "cpu", "float32", weights="packed")
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)  # the embedding stays packed too
    assert isinstance(packed.model.layers[0].mlp.up_proj, GGUFLinear)
    assert (packed.model.lm_head is None) == tie
    dense = load_model(str(path), "cpu", "float32", weights="dense")
    seq = _seq(300, seed=1)
    for det in (False, True):
        cfg = EngineConfig(deterministic=det and Deterministic(tile=16))
        a = Scorer(packed, config=cfg).logprobs([seq], top_k=3)[0]
        b = Scorer(dense, config=cfg).logprobs([seq], top_k=3)[0]
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.topk_ids, b.topk_ids)
        assert torch.equal(a.topk_logprobs, b.topk_logprobs)


def test_weights_option_is_checked():
    with pytest.raises(LogprobeError, match="weights"):
        load_model(None, "cpu", "float32", weights="int4")


def test_unsupported_compressed_tensors_scheme_is_refused(ct_dirs, tmp_path):
    import shutil

    d = tmp_path / "w8a8"
    shutil.copytree(ct_dirs["W8A16"], d)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LogprobeError, match="activations"):
        load_model(str(d), "cpu", "float32")
    raw["quantization_config"]["quant_method"] = "gptq"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LogprobeError, match="gptq"):
        load_model(str(d), "cpu", "float32")


# -- the default model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_packed_equals_dense_and_memory(default_scorer):
    packed = default_scorer.loaded  # the default load is packed
    assert isinstance(packed.model.layers[0].self_attn.q_proj, GGUFLinear)
    dense = load_model(None, "cpu", "float32", weights="dense")
    text = "The tower is 324 metres tall, about the same height as an 81-storey building. " * 4
    a = default_scorer.perplexity(text, return_token_nlls=True)
    b = Scorer(dense, progress=False).perplexity(text, return_token_nlls=True)
    assert a.token_nlls == b.token_nlls  # bitwise: the same float32 weights, expanded per forward
    mem = weight_bytes(packed.model)
    emb = packed.model.embed_tokens.packed  # the tied Q8_0 embedding / LM head, counted apart
    linear = sum(m.packed_bytes() for m in packed.model.modules() if isinstance(m, GGUFLinear) and m is not emb)
    fp16 = _linear_bytes_fp16(packed.model) - 2 * emb.out_features * emb.in_features
    assert linear / fp16 <= 0.35  # Q4_1: 20 bytes per 32 weights = 0.3125 of float16
    assert mem["total"] < 0.2 * weight_bytes(dense.model)["total"]  # vs the float32 dense model


@pytest.fixture(scope="session")
def smollm_w4a16(default_reference, default_scorer, tmp_path_factory):
    """SmolLM2-135M dequantized from the default GGUF by transformers, quantized W4A16 by the
    compressed-tensors package (group 64: compressed-tensors needs a group that divides the
    576-wide inputs, which 128 does not), saved as a Hugging Face directory."""
    d = tmp_path_factory.mktemp("smollm2-w4a16")
    model = type(default_reference)(default_reference.config).float().eval()
    model.load_state_dict({k: v.float() for k, v in default_reference.state_dict().items()})
    quantize_and_save(model, d, "W4A16", default_scorer.tokenizer.hf, group_size=64)
    return d


@pytest.mark.slow
def test_smollm2_w4a16_matches_float64_and_memory(smollm_w4a16, default_reference):
    d = smollm_w4a16
    state = decompressed_state(d)
    ref = type(default_reference)(default_reference.config).double().eval()
    ref.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    ref.tie_weights()
    scorer = Scorer(str(d), device="cpu", dtype="float32", progress=False)
    model = scorer.loaded.model
    n_ct = sum(isinstance(m, CTLinear) for m in model.modules())
    assert n_ct == 30 * 7
    seq = _seq(scorer.info.vocab_size, n=64, seed=3)
    got = scorer.logprobs([seq])[0].logprobs.double()
    want = _ref_targets(ref, seq)
    assert (got - want).abs().max() < 1e-4
    packed = sum(m.packed_bytes() for m in model.modules() if isinstance(m, CTLinear))
    assert packed / _linear_bytes_fp16(model) <= 0.35  # int4 + a float32 scale per 64 weights = 0.281


def test_w4a16_memory_numbers_are_counted(ct_dirs):
    """The byte count is what the buffers hold: int4 codes in int32 words plus float32 group scales."""
    loaded = load_model(str(ct_dirs["W4A16"]), "cpu", "float32")
    m = loaded.model.layers[0].mlp.down_proj  # in 256, out 128, group 128
    assert m.packed_bytes() == 128 * 256 // 2 + 128 * 2 * 4
    assert np.isclose(m.packed_bytes() / (2 * 128 * 256), 0.25 + 1 / 64)

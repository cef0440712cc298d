"""Compressed-tensors W4A16 experts of an MoE checkpoint (issue 17): kept packed (``ExpertStack``
of ``CTLinear``), exact against a float64 transformers forward on the weights compressed-tensors
itself decompresses, bitwise equal to the same checkpoint loaded dense, and refused with a named
error when the experts carry activation quantization.

The checkpoint is what llm-compressor writes for an MoE: every ``experts.{e}.{gate,up,down}_proj``
and attention projection quantized (int4, group 32, symmetric), the router and ``lm_head`` not. It
is made here by compressed-tensors' own ``apply_quantization_config`` + ``ModelCompressor`` on a
module tree with the checkpoint's names (transformers 5 keeps experts fused in memory, so the
library cannot quantize its model directly)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import random_sequences, ref_logprobs
from quant_helpers import quantize_in_place
from test_moe import TOL, check_routing_is_decided, make_moe_dir

from logprobe import Scorer
from logprobe.errors import LogprobeError
from logprobe.layers.moe import ExpertStack
from logprobe.layers.quant_linear import CTLinear

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")

LINEAR_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _tree(sd: dict) -> torch.nn.Module:
    """A module tree with an ``nn.Linear`` at every quantizable checkpoint weight (names kept)."""
    root = torch.nn.Module()
    for key, w in sd.items():
        parts = key.split(".")
        if not (key.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEAR_LEAVES):
            continue
        node = root
        for p in parts[:-2]:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.clone()
        node.add_module(parts[-2], lin)
    return root


def quantize_moe(src, dst, ref_dst, scheme: str = "W4A16", group: int = 32) -> None:
    """``src`` (a saved MoE) -> ``dst`` compressed, ``ref_dst`` with the weights compressed-tensors
    decompresses (a plain checkpoint of the same model)."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    root = _tree(sd)
    quantize_in_place(root, scheme, group)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    quantized = {k.removesuffix(".weight") for k in sd if k.removesuffix(".weight") in dict(root.named_modules())}
    plain = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in quantized}
    for d in (dst, ref_dst):
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
    save_file({**plain, **{k: v.contiguous() for k, v in root.state_dict().items()}}, str(dst / "model.safetensors"))
    compressor.update_config(str(dst))
    # the tree had no lm_head and no router: name them as llm-compressor's MoE recipes do
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    compressor.decompress_model(root)
    deq = {f"{name}.weight": m.weight.detach().clone() for name, m in root.named_modules() if name in quantized}
    save_file({**plain, **deq}, str(ref_dst / "model.safetensors"))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-ct")
    make_moe_dir(root / "src", "qwen3_moe")
    quantize_moe(root / "src", root / "w4a16", root / "ref")
    ref = AutoModelForCausalLM.from_pretrained(str(root / "ref"), attn_implementation="eager",
                                               experts_implementation="eager", dtype=torch.float64).eval()
    return root, ref


def test_config_is_compressed_tensors(quantized):
    root, _ = quantized
    q = json.loads((root / "w4a16" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"]["group_0"]["weights"]["num_bits"] == 4


def test_experts_stay_packed_and_match_float64(quantized):
    root, ref = quantized
    scorer = Scorer(str(root / "w4a16"), device="cpu", dtype="float32", progress=False)
    block = scorer.loaded.model.layers[0].mlp
    assert isinstance(block.experts.gate_proj, ExpertStack) and isinstance(block.experts.down_proj.layers[3], CTLinear)
    assert block.experts.packed
    seqs = random_sequences(4, seed=9)
    check_routing_is_decided(scorer, ref, [s["prompt_token_ids"] + s["completion_token_ids"] for s in seqs])
    for seq, res in zip(seqs, scorer.logprobs(seqs, temperature=0.9)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        rows = ref_logprobs(ref, ids, 0.9)[len(seq["prompt_token_ids"]) - 1: len(ids) - 1]
        tgt = rows.gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        assert (res.logprobs.double() - tgt).abs().max() < TOL


def test_packed_equals_dense_bitwise(quantized):
    """The packed experts expand with the dense loader's function: the same bits as a model whose
    experts were dequantized at load (deterministic mode, so batching cannot differ either)."""
    from logprobe.loading.hf import hf_tensors, native_config, read_config
    from logprobe.loading.loader import load_model

    root, _ = quantized
    packed = Scorer(str(root / "w4a16"), device="cpu", dtype="float32", deterministic=True, progress=False)
    raw = read_config(root / "w4a16")
    cfg, _ = native_config(raw)
    dense_w = dict(hf_tensors(root / "w4a16", cfg, raw, packed=False))
    assert dense_w["layers.0.mlp.experts.gate_proj"].shape == (8, 32, 64)  # stacked float experts
    loaded = load_model(str(root / "w4a16"), "cpu", "float32")
    for name, m in loaded.model.named_modules():
        if name.endswith("experts"):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stack = getattr(m, proj)
                want = dense_w[f"{name}.{proj}"]
                assert torch.equal(torch.stack([stack.expert(e) for e in range(stack.num_experts)]), want)
    seqs = random_sequences(3, seed=2)
    a = packed.logprobs(seqs)
    b = Scorer(loaded, deterministic=True).logprobs(seqs)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_activation_quantized_experts_are_refused(quantized, tmp_path):
    root, _ = quantized
    quantize_moe(root / "src", tmp_path / "w8a8", tmp_path / "ref", scheme="W8A8")
    with pytest.raises(LogprobeError, match="experts stored as ActQuantLinear"):
        Scorer(str(tmp_path / "w8a8"), device="cpu", dtype="float32")


def test_w8a16_experts(quantized, tmp_path):
    """int8 weight-only experts (per-channel scales) take the same path."""
    from transformers import AutoModelForCausalLM

    root, _ = quantized
    quantize_moe(root / "src", tmp_path / "w8a16", tmp_path / "ref", scheme="W8A16")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), attn_implementation="eager",
                                               experts_implementation="eager", dtype=torch.float64).eval()
    scorer = Scorer(str(tmp_path / "w8a16"), device="cpu", dtype="float32", progress=False)
    stack = scorer.loaded.model.layers[1].mlp.experts.up_proj
    assert isinstance(stack, ExpertStack) and stack.layers[0].num_bits == 8
    seq = random_sequences(2, seed=4)
    check_routing_is_decided(scorer, ref, [s["prompt_token_ids"] + s["completion_token_ids"] for s in seq])
    for s, res in zip(seq, scorer.logprobs(seq)):
        ids = s["prompt_token_ids"] + s["completion_token_ids"]
        rows = ref_logprobs(ref, ids)[len(s["prompt_token_ids"]) - 1: len(ids) - 1]
        assert (res.logprobs.double() - rows.gather(1, torch.tensor(s["completion_token_ids"])[:, None])[:, 0]).abs().max() < TOL

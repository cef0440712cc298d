"""Every loader refuses what it does not run exactly: never a silent dequantize or misread (issue 22).

Checkpoints are built here, on CPU, from tiny random models: a real FP8_DYNAMIC compressed-tensors
checkpoint (float-quantized: e4m3 weights with per-channel scales, dynamic per-token FP8 input
activations) written by the compressed-tensors package (it now loads: tests/test_act_quant.py has the
activation-quantized schemes and their refusals), and W4A16 checkpoints edited into schemes,
formats, statuses and tensors logprobe does not run; hand-packed GPTQ / AWQ checkpoints
(``gptq_helpers``) edited into variants logprobe does not run; Hugging Face directories with other
quantization methods or float8/int tensors; GGUF files with YaRN RoPE, experts, sliding windows or extra tensors. Each
test asserts that the error names the module/tensor/key and the scheme, so it fails if the loader
refuses for another reason or not at all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_hf_dir, write_tiny_gguf
from quant_helpers import copy_gguf, decompressed_state, quantize_and_save, tiny_wide_llama

from logprobe import LogprobeError, Scorer
from logprobe.loading import load_model

MOD = "model.layers.0.mlp.down_proj"  # a quantized Linear of every checkpoint below


@pytest.fixture(scope="module")
def ct_src(tmp_path_factory):
    return tiny_wide_llama(tmp_path_factory.mktemp("refuse-src"), seed=3)


def _quantized(src: Path, out: Path, scheme: str) -> Path:
    from helpers import byte_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    return quantize_and_save(model, out, scheme, byte_tokenizer()[0])


@pytest.fixture(scope="module")
def fp8_dir(ct_src, tmp_path_factory):
    return _quantized(ct_src, tmp_path_factory.mktemp("fp8-dynamic"), "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def w4_dir(ct_src, tmp_path_factory):
    return _quantized(ct_src, tmp_path_factory.mktemp("w4a16"), "W4A16")


def _copy(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of a checkpoint directory with config.json and/or the safetensors state edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if edit_tensors is not None:
        f = dst / "model.safetensors"
        state = load_file(str(f))
        edit_tensors(state)
        save_file(state, str(f), metadata={"format": "pt"})
    return dst


def _refused(path, *needles: str) -> str:
    """load_model(path) must raise LogprobeError whose message holds every needle; returns the message."""
    with pytest.raises(LogprobeError) as err:
        load_model(str(path), "cpu", "float32")
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# -- compressed-tensors ---------------------------------------------------------------------------------


def test_fp8_dynamic_checkpoint_loads_with_its_activation_quantization(fp8_dir):
    """The issue's silent failure: e4m3 weights are floating point and used to load without their
    scale. They now load as layers that apply the scale and quantize the activations (both weight modes);
    tests/test_act_quant.py checks the numbers."""
    from safetensors import safe_open

    from logprobe.layers.act_quant_linear import ActQuantLinear

    qcfg = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    assert qcfg["format"] == "float-quantized" and group["weights"]["type"] == "float"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as st:
        assert st.get_tensor(f"{MOD}.weight").dtype == torch.float8_e4m3fn  # really an FP8 checkpoint
    for weights in ("packed", "dense"):
        model = load_model(str(fp8_dir), "cpu", "float32", weights=weights).model
        layer = model.get_submodule(MOD.removeprefix("model."))
        assert isinstance(layer, ActQuantLinear) and layer.act_kind == "float" and layer.act_group is None


def test_fp8_weights_without_activation_quantization_are_refused(fp8_dir, tmp_path):
    """FP8 weight-only (no input_activations): still not integer codes, so refused by weight type."""
    def edit(raw):
        raw["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None

    d = _copy(fp8_dir, tmp_path / "fp8-weight-only", edit)
    _refused(d, "model.layers.", "float-quantized", "float weights are not supported")


def _group(raw):
    return raw["quantization_config"]["config_groups"]["group_0"]


CONFIG_EDITS = {
    # name: (edit of config.json, substrings the error must hold)
    "unknown group format": (lambda r: _group(r).update(format="fp3-magic"), ["group_0", "'fp3-magic'"]),
    "unknown top format": (lambda r: r["quantization_config"].update(format="fp3-magic"), ["'fp3-magic'"]),
    "known unsupported format": (lambda r: _group(r).update(format="nvfp4-pack-quantized"),
                                 ["model.layers.", "'nvfp4-pack-quantized'", "not a layout logprobe reads"]),
    "mixed-precision without group format": (
        lambda r: (r["quantization_config"].update(format="mixed-precision"), _group(r).update(format=None)),
        ["model.layers.", "'mixed-precision'"]),
    "float weight type": (lambda r: _group(r)["weights"].update(type="float"),
                          ["model.layers.", "weights float4", "'nvfp4-pack-quantized', not 'pack-quantized'"]),
    "unknown strategy": (lambda r: _group(r)["weights"].update(strategy="tensor_group"),
                         ["model.layers.", "strategy 'tensor_group'"]),
    "block strategy": (lambda r: _group(r)["weights"].update(strategy="block", block_structure=[128, 128]),
                       ["model.layers.", "strategy 'block'"]),
    "group activation order": (lambda r: _group(r)["weights"].update(actorder="dynamic"),
                               ["model.layers.", "actorder 'dynamic'"]),
    "dynamic weights": (lambda r: _group(r)["weights"].update(dynamic=True), ["model.layers.", "dynamic"]),
    "2-bit weights": (lambda r: _group(r)["weights"].update(num_bits=2), ["model.layers.", "2-bit"]),
    "int8 input activations": (lambda r: _group(r).update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
        ["model.layers.", "input activations int8 dynamic per-token", "quantizes its input activations"]),
    "output activations": (lambda r: _group(r).update(output_activations={"num_bits": 8, "type": "float"}),
                           ["model.layers.", "output activations"]),
    "unknown weight option": (lambda r: _group(r)["weights"].update(rotation="hadamard"), ["'rotation'"]),
    "unknown top key": (lambda r: r["quantization_config"].update(online_rotation=True), ["'online_rotation'"]),
    "status frozen": (lambda r: r["quantization_config"].update(quantization_status="frozen"),
                      ["quantization_status 'frozen'", "not compressed"]),
    "status missing": (lambda r: r["quantization_config"].pop("quantization_status"), ["quantization_status None"]),
    "kv cache scheme": (lambda r: r["quantization_config"].update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "tensor"}), ["kv_cache_scheme", "KV cache"]),
    "attention target": (lambda r: _group(r).update(targets=["Linear", "LlamaAttention"]),
                         ["'LlamaAttention'", "attention"]),
    "transform config": (lambda r: r["quantization_config"].update(transform_config={"config_groups": {"u": {}}}),
                         ["transform_config"]),
    "sparse format": (lambda r: r["quantization_config"].update(sparsity_config={"format": "sparse-24-bitmask"}),
                      ["'sparse-24-bitmask'"]),
    "gptq quant_method": (lambda r: r["quantization_config"].update(quant_method="gptq"), ["'gptq'"]),
    "lm_head not ignored": (lambda r: r["quantization_config"].update(ignore=[]),
                            ["lm_head", "lm_head.weight", "pack-quantized"]),
    "quantized module ignored": (lambda r: r["quantization_config"]["ignore"].append("re:.*down_proj$"),
                                 [f"{MOD}.weight_packed", "ignore list"]),
    "no group targets the module": (lambda r: _group(r).update(targets=["re:.*self_attn.*"]),
                                    ["mlp.", "weight_packed", "no config group targets it"]),
}


@pytest.mark.parametrize("case", list(CONFIG_EDITS))
def test_compressed_tensors_config_not_run_exactly_is_refused(case, w4_dir, tmp_path):
    edit, needles = CONFIG_EDITS[case]
    d = _copy(w4_dir, tmp_path / "ct", edit)
    msg = _refused(d, *needles)
    assert msg.split(":")[0] in ("quantization_config", "model"), msg


@pytest.mark.parametrize("suffix", ["input_scale", "weight_global_scale", "weight_scale_inv", "input_global_scale",
                                    "input_zero_point", "output_scale"])
def test_unknown_tensor_suffix_on_a_quantized_module_is_refused(suffix, w4_dir, tmp_path):
    d = _copy(w4_dir, tmp_path / "extra", edit_tensors=lambda s: s.update({f"{MOD}.{suffix}": torch.ones(1)}))
    _refused(d, f"{MOD}.{suffix}", "format 'pack-quantized'", "weights int4 per-group 128")


def test_kv_cache_scales_are_refused(w4_dir, tmp_path):
    key = "model.layers.1.self_attn.k_scale"
    d = _copy(w4_dir, tmp_path / "kv", edit_tensors=lambda s: s.update({key: torch.ones(1)}))
    _refused(d, key, "not a Linear or Embedding module")


def test_float8_scale_is_refused(w4_dir, tmp_path):
    def edit(state):
        state[f"{MOD}.weight_scale"] = state[f"{MOD}.weight_scale"].to(torch.float8_e4m3fn)

    d = _copy(w4_dir, tmp_path / "f8scale", edit_tensors=edit)
    _refused(d, f"{MOD}.weight_scale", "float8_e4m3fn")


def test_nonzero_symmetric_zero_point_and_reordered_groups_are_refused(w4_dir, tmp_path):
    def zp(state):  # codes 1 (the packed offset is 8): a symmetric scheme has no zero point to apply
        state[f"{MOD}.weight_zero_point"] = torch.full((16, 2), 0x99999999 - 2**32, dtype=torch.int32)

    _refused(_copy(w4_dir, tmp_path / "zp", edit_tensors=zp), f"{MOD}.weight_zero_point", "symmetric")

    def g_idx(state):
        state[f"{MOD}.weight_g_idx"] = torch.arange(256, dtype=torch.int32).flip(0) // 128

    _refused(_copy(w4_dir, tmp_path / "gidx", edit_tensors=g_idx), f"{MOD}.weight_g_idx", "activation ordering")


def test_decompressed_float_weights_load_and_frozen_ones_are_refused(w4_dir, tmp_path):
    """A float weight beside its scales is used as it is only where the config says the weights are
    already dequantized (quantization_status 'decompressed'); 'frozen' means they are not."""
    ref = decompressed_state(w4_dir)  # the package's own dequantization, HF names

    def tensors(state):
        for key in [k for k in state if k.endswith(".weight_packed")]:
            module = key.removesuffix(".weight_packed")
            del state[key], state[f"{module}.weight_shape"]
            state[f"{module}.weight"] = ref[f"{module}.weight"].contiguous()

    def status(value):
        return lambda raw: raw["quantization_config"].update(quantization_status=value)

    dec = _copy(w4_dir, tmp_path / "dec", status("decompressed"), tensors)
    seq = [{"prompt_token_ids": [5, 9, 200], "completion_token_ids": [17, 40, 3, 250]}]
    a = Scorer(load_model(str(dec), "cpu", "float32"), progress=False).logprobs(seq)[0].logprobs
    b = Scorer(load_model(str(w4_dir), "cpu", "float32", weights="dense"), progress=False).logprobs(seq)[0].logprobs
    assert torch.equal(a, b)  # the same weights: compressed-tensors' dequantization is ours, bitwise
    frozen = _copy(w4_dir, tmp_path / "frozen", status("frozen"), tensors)
    _refused(frozen, "quantization_status 'frozen'")


# -- Hugging Face directories ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain-llama")
    make_hf_dir(d, "llama", seed=2)
    return d


@pytest.mark.parametrize("method", ["bitsandbytes", "marlin", "bitblas", "gptq", "awq", None])
def test_other_quant_methods_are_refused(method, llama_dir, tmp_path):
    """GPTQ / AWQ configs over plain float tensors are refused too: no module holds their layout."""
    q = {"quant_method": method, "bits": 4, "group_size": 128} if method else {"bits": 4}
    d = _copy(llama_dir, tmp_path / "q", lambda raw: raw.update(quantization_config=q))
    needle = "holds no <module>.qweight" if method in ("gptq", "awq") else "compressed-tensors"
    _refused(d, "quantization_config", f"quant_method {method!r}", needle)
    with pytest.raises(LogprobeError, match=f"quant_method {method!r}"):
        Scorer(str(d), device="cpu", progress=False)


# -- GPTQ and AWQ -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gptq_awq_dirs(ct_src, tmp_path_factory):
    """A GPTQ v1 act-order 4-bit group-32 checkpoint and an AWQ GEMM group-64 one (``gptq_helpers``)."""
    from gptq_helpers import awq_pack, gptq_pack, write_quantized

    gptq = tmp_path_factory.mktemp("gptq")
    write_quantized(ct_src, gptq, "gptq", dict(bits=4, group_size=32, sym=False, desc_act=True,
                                               checkpoint_format="gptq"),
                    lambda m, w: gptq_pack(w, 4, 32, False, True, True, seed=len(m)))
    awq = tmp_path_factory.mktemp("awq")
    write_quantized(ct_src, awq, "awq", dict(bits=4, group_size=64, zero_point=True, version="gemm"),
                    lambda m, w: awq_pack(w, 64))
    return {"gptq": gptq, "awq": awq}


def _cfg(**kw):
    return lambda raw: raw["quantization_config"].update(kw)


def _v1_zero_of_zero(state):
    """A v1 zero point 0 stored as -1: AutoGPTQ's packing leaves all-ones nibbles (0xF) in the word."""
    z = state[f"{MOD}.qzeros"]
    z[0, 0] = z[0, 0] | 0xF
    state[f"{MOD}.qzeros"] = z


GPTQ_AWQ_EDITS = {
    # name: (checkpoint, config edit, tensor edit, substrings of the error)
    "gptq 3 bits": ("gptq", _cfg(bits=3), None, ["GPTQ bits 3"]),
    "gptq 2 bits": ("gptq", _cfg(bits=2), None, ["GPTQ bits 2"]),
    "gptq marlin format": ("gptq", _cfg(checkpoint_format="marlin"), None, ["checkpoint_format 'marlin'"]),
    "gptq bitblas format": ("gptq", lambda raw: (raw["quantization_config"].pop("checkpoint_format"),
                                                 _cfg(format="bitblas")(raw)), None, ["checkpoint_format 'bitblas'"]),
    "gptq unknown key": ("gptq", _cfg(rotation="hadamard"), None, ["'rotation'"]),
    "gptq per-module overrides": ("gptq", _cfg(dynamic={"-:.*down_proj": {}}), None, ["GPTQ dynamic"]),
    "gptq zero group size": ("gptq", _cfg(group_size=0), None, ["GPTQ group_size 0"]),
    "gptq desc_act without g_idx": ("gptq", None, lambda s: s.pop(f"{MOD}.g_idx"), [f"{MOD}.g_idx", "desc_act"]),
    "gptq extra tensor": ("gptq", None, lambda s: s.update({f"{MOD}.bias_scale": torch.ones(1)}),
                          [f"{MOD}.bias_scale", "would be ignored"]),
    "gptq missing scales": ("gptq", None, lambda s: s.pop(f"{MOD}.scales"), [f"{MOD}.scales", "lacks"]),
    "gptq int64 qweight": ("gptq", None, lambda s: s.update({f"{MOD}.qweight": s[f"{MOD}.qweight"].long()}),
                           [f"{MOD}.qweight", "int64"]),
    "gptq uneven act-order groups": ("gptq", None, lambda s: s[f"{MOD}.g_idx"].__setitem__(0, 1 - int(s[f"{MOD}.g_idx"][0] > 0)),
                                     [f"{MOD}.g_idx", "group_size 32"]),
    "gptq v1 zero point of zero": ("gptq", None, _v1_zero_of_zero, [f"{MOD}.qzeros", "v1", "gptq_v2"]),
    "gptq wrong scales shape": ("gptq", _cfg(group_size=64), None, [".scales", "[groups, out]"]),
    "awq gemv": ("awq", _cfg(version="gemv"), None, ["AWQ version 'gemv'"]),
    "awq gemv_fast format": ("awq", lambda raw: (raw["quantization_config"].pop("version"),
                                                 _cfg(format="gemv_fast")(raw)), None, ["AWQ version 'gemv_fast'"]),
    "awq exllama": ("awq", _cfg(version="exllama"), None, ["AWQ version 'exllama'"]),
    "awq 8 bits": ("awq", _cfg(bits=8), None, ["AWQ bits 8"]),
    "awq no zero point": ("awq", _cfg(zero_point=False), None, ["AWQ zero_point False"]),
    "awq unknown key": ("awq", _cfg(rotation="hadamard"), None, ["'rotation'"]),
    "awq extra g_idx": ("awq", None, lambda s: s.update({f"{MOD}.g_idx": torch.zeros(256, dtype=torch.int32)}),
                        [f"{MOD}.g_idx", "would be ignored"]),
}


@pytest.mark.parametrize("case", list(GPTQ_AWQ_EDITS))
def test_gptq_and_awq_variants_not_run_are_refused(case, gptq_awq_dirs, tmp_path):
    which, edit_config, edit_tensors, needles = GPTQ_AWQ_EDITS[case]
    d = _copy(gptq_awq_dirs[which], tmp_path / which, edit_config, edit_tensors)
    msg = _refused(d, *needles)
    assert msg.startswith("quantization_config:"), msg


def test_gptq_and_awq_copies_without_edits_load(gptq_awq_dirs, tmp_path):
    for which, d in gptq_awq_dirs.items():
        assert load_model(str(_copy(d, tmp_path / which)), "cpu", "float32").info.backend == "native"


def test_gptq_side_file_is_refused(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "gptq")
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": True}))
    _refused(d, "quantize_config.json", "GPTQ")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.bool])
def test_unquantized_checkpoint_with_non_float_tensors_is_refused(dtype, llama_dir, tmp_path):
    key = "model.layers.1.self_attn.o_proj.weight"

    def edit(state):
        state[key] = state[key].to(dtype)

    d = _copy(llama_dir, tmp_path / "odd", edit_tensors=edit)
    _refused(d, repr(key), str(dtype).removeprefix("torch."))


def test_transformers_backend_refuses_quantization_and_float8(tmp_path):
    """A model transformers would run (GPT-2 here) must not reach it with quantized tensors either:
    transformers would dequantize them or cast float8 codes without their scales."""
    src = tmp_path / "gpt2"
    src.mkdir()
    make_hf_dir(src, "gpt2", seed=1)
    q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}
    d = _copy(src, tmp_path / "gpt2-q", lambda raw: raw.update(quantization_config=q))
    _refused(d, "quant_method 'compressed-tensors'", "model_type 'gpt2'", "transformers backend")

    key = "transformer.h.0.mlp.c_fc.weight"

    def edit(state):
        state[key] = state[key].to(torch.float8_e4m3fn)

    d = _copy(src, tmp_path / "gpt2-f8", edit_tensors=edit)
    _refused(d, repr(key), "F8_E4M3")
    assert load_model(str(src), "cpu", "float32").info.backend == "transformers"  # the plain one still loads


# -- GGUF --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-refuse")
    (d / "src").mkdir()
    model = make_hf_dir(d / "src", "llama", seed=4)
    path = d / "tiny-q8.gguf"
    write_tiny_gguf(path, model, "Q8_0")
    return path


GGUF_EDITS = {
    "yarn": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 128}, ["llama.rope.scaling.type", "'yarn'"]),
    "longrope": ({"llama.rope.scaling.type": "longrope"}, ["llama.rope.scaling.type", "'longrope'"]),
    "experts": ({"llama.expert_count": 8, "llama.expert_used_count": 2}, ["llama.expert_count", "8", "experts"]),
    "sliding window": ({"llama.attention.sliding_window": 16}, ["llama.attention.sliding_window", "16"]),
    "final softcap": ({"llama.final_logit_softcapping": 30.0}, ["llama.final_logit_softcapping", "soft-capping"]),
    "attn softcap": ({"llama.attn_logit_softcapping": 50.0}, ["llama.attn_logit_softcapping"]),
    "partial rope": ({"llama.rope.dimension_count": 8}, ["llama.rope.dimension_count", "8", "16 wide"]),
    "non-causal": ({"llama.attention.causal": False}, ["llama.attention.causal"]),
    "logit scale": ({"llama.logit_scale": 0.5}, ["llama.logit_scale"]),
    "rope attn factor": ({"llama.rope.scaling.attn_factor": 1.2}, ["llama.rope.scaling.attn_factor"]),
}


@pytest.mark.parametrize("case", list(GGUF_EDITS))
def test_gguf_metadata_not_run_is_refused(case, tiny_gguf, tmp_path):
    kv, needles = GGUF_EDITS[case]
    path = copy_gguf(tiny_gguf, tmp_path / "edited.gguf", set_kv=kv)
    _refused(path, tiny_gguf.name.replace("tiny-q8", "edited"), *needles)


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_inp.weight", "blk.1.attn_sinks.weight", "mystery.weight"])
def test_gguf_extra_tensor_is_refused(name, tiny_gguf, tmp_path):
    path = copy_gguf(tiny_gguf, tmp_path / "extra.gguf", add_tensors={name: np.ones((4, 64), np.float32)})
    _refused(path, repr(name), "llama GGUF")


def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(tiny_gguf, tmp_path):
    """No type key: llama.cpp's default is linear, so a factor applies; type 'none' ignores it."""
    from logprobe.loading.gguf import gguf_config, gguf_reader

    def scaling(kv):
        path = copy_gguf(tiny_gguf, tmp_path / "s.gguf", set_kv=kv)
        return gguf_config(gguf_reader(path), path)[1].rope_scaling

    assert scaling({}) is None
    assert scaling({"llama.rope.scaling.factor": 4.0}) == {"rope_type": "linear", "factor": 4.0}
    assert scaling({"llama.rope.scale_linear": 2.0}) == {"rope_type": "linear", "factor": 2.0}
    assert scaling({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})["factor"] == 4.0
    assert scaling({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}) is None


def test_gguf_copy_without_edits_still_loads(tiny_gguf, tmp_path):
    """The edited files above differ from a loadable one only by the edit."""
    path = copy_gguf(tiny_gguf, tmp_path / "same.gguf", set_kv={"llama.expert_count": 0})
    assert load_model(str(path), "cpu", "float32").info.backend == "native"

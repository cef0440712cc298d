"""GGUF files of the hybrid Qwen families (``loading.gguf_archs``) against float64 transformers.

Each tiny random transformers model (``test_qwen3_next``'s configs: norms, A_log, dt_bias all
random, so a missing ``- 1`` or a wrong sign shows) is written to GGUF here the way llama.cpp's
``convert_hf_to_gguf.py`` lays these architectures out: tensor names from gguf-py's own
``TensorNameMap``; ``-exp(A_log)``; ``1 + w`` baked into the offset norms (not the gated norm);
``dt_bias`` as ``ssm_dt.bias``; the conv squeezed; Qwen3-Next's ``in_proj_qkvz`` cut into
``attn_qkv`` / ``attn_gate``, ``in_proj_ba`` kept as ``ssm_ba``; Qwen3.5's value heads reordered
from key-head-grouped to tiled; experts' ``gate_up_proj`` split. The transforms are written here
from the converter's description, independently of the loader's inverses.

Matrices whose conversion only moves whole rows are stored Q8_0 (rows quantize independently, so
the reference holds the same values: each such HF weight is replaced by its own Q8_0 round trip,
and the file's dequantized tensors are checked equal to the converted round-tripped weights); the
others (ssm_out: its columns move; the router; 1-D tensors) stay F32. The float64 reference runs
on those weights; logprobe reads the file through ``Scorer``; per-token log-probs must agree to 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import VOCAB, byte_tokenizer
from test_deepseek import BASE, VARIANTS, _norm64, _routing_stats
from test_deepseek import MIN_MARGIN as DS_MIN_MARGIN
from test_deepseek import _randomise as _ds_randomise
from test_deepseek import _reference as _ds_reference
from test_deepseek import _sequences as _ds_sequences
from test_gemma3 import TEXT as G3_TEXT
from test_gemma3 import _norm64 as _g3_norm64
from test_gemma3 import _sequences as _g3_sequences
from test_gemma3 import _worst as _g3_worst
from test_moe_sigmoid_families import GROUPS
from test_moe_sigmoid_families import MIN_MARGIN as SG_MIN_MARGIN
from test_moe_sigmoid_families import SEEDS as SG_SEEDS
from test_moe_sigmoid_families import _norm64 as _sg_norm64
from test_moe_sigmoid_families import _randomise as _sg_randomise
from test_moe_sigmoid_families import _reference as _sg_reference
from test_moe_sigmoid_families import _routing_stats as _sg_routing_stats
from test_moe_sigmoid_families import _sequences as _sg_sequences
from test_moe_sigmoid_families import make_model as _sg_make_model
from test_qwen3_next import (
    MIN_MARGIN,
    TOL,
    _randomise,
    _reference,
    _sequences,
    float64_reference,  # noqa: F401  (fixture)
    make_model,
)

from logprobe import LogprobeError, Scorer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hfds  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3 as hfg3  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as hfglm  # noqa: E402
from transformers.models.minimax_m2 import modeling_minimax_m2 as hfmm  # noqa: E402

ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next",
        "qwen3_next_legacy": "qwen3next"}
SEEDS = {"qwen3_5_text": 100, "qwen3_5_moe": 111, "qwen3_next": 103, "qwen3_next_legacy": 103}  # MoE: chosen for MIN_MARGIN
_MODEL_ARCH = {"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
               "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}


def _quantized(name: str, w: torch.Tensor) -> bool:
    """Matrices written Q8_0: the ones whose conversion moves whole rows only."""
    return (w.dim() >= 2 and w.shape[-1] % 32 == 0 and not name.endswith(("out_proj.weight", "mlp.gate.weight",
                                                                          "shared_expert_gate.weight", "conv1d.weight")))


def _q8_roundtrip(w: torch.Tensor) -> torch.Tensor:
    data = quants.quantize(w.numpy().astype(np.float32), Q.Q8_0)
    return torch.from_numpy(quants.dequantize(data, Q.Q8_0).reshape(w.shape).astype(np.float32))


def _tile(w: torch.Tensor, hk: int, hv: int, width: int, dim: int = 0) -> torch.Tensor:
    """The converter's value-head reorder: [Hk, r] (grouped by key head) -> [r, Hk] (tiled)."""
    r = hv // hk
    w = w.movedim(dim, 0)
    rest = w.shape[1:]
    return w.reshape(hk, r, width, *rest).transpose(0, 1).reshape(hv * width, *rest).movedim(0, dim)


def convert(sd: dict[str, torch.Tensor], cfg, arch: str, legacy: bool = False) -> dict[str, torch.Tensor]:
    """HF state dict -> {GGUF name: tensor (outermost dim first)} as llama.cpp's converter writes it
    (``legacy``: Qwen3-Next's fused ``in_proj_qkvz`` kept whole as ``ssm_in``, as older converts did)."""
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], cfg.num_hidden_layers)
    # qwen3next's list has no dense MLP tensors (the released models have none); llama.cpp's graph
    # reads a block without a router as ffn_gate / ffn_up / ffn_down, the qwen35 names
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg.num_hidden_layers)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out = {}

    def put(hf: str, w: torch.Tensor) -> None:
        base = hf.removesuffix(".weight").removesuffix(".bias")
        name = names.get_name(base) or (dense.get_name(base) if ".mlp." in base else None)
        assert name is not None, hf
        suffix = ".weight" if hf.endswith(".weight") else ".bias" if hf.endswith(".bias") else ""
        out[name + suffix] = w.contiguous()

    for key, w in sd.items():
        key = key.replace("model.language_model.", "model.")
        if key.startswith(("model.visual.", "mtp.")):
            continue
        if key.endswith(".A_log"):
            w = -torch.exp(w)
        elif key.endswith(".dt_bias"):
            key = key.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in key:
            w = w.squeeze()
        elif key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
            w = w + 1
        if key.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp reads it as a vector {n_embd}
        if arch != "qwen3next" and hk != hv and ".linear_attn." in key:
            if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                w = torch.cat([w[:2 * hk * dk], _tile(w[2 * hk * dk:], hk, hv, dv)])
            elif key.endswith("in_proj_z.weight"):
                w = _tile(w, hk, hv, dv)
            elif key.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", "dt_proj.bias")):
                w = _tile(w, hk, hv, 1)
            elif key.endswith("out_proj.weight"):
                w = _tile(w, hk, hv, dv, dim=1)
        if key.endswith("in_proj_qkvz.weight") and not legacy:  # per key head [q | k | v | z] -> [q all | k all | v all], z
            r = hv // hk
            q, k, v, z = w.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            base = key.removesuffix(".in_proj_qkvz.weight")
            put(base + ".in_proj_qkv.weight", torch.cat([t.reshape(-1, w.shape[1]) for t in (q, k, v)]))
            put(base + ".in_proj_z.weight", z.reshape(-1, w.shape[1]))
            continue
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2 I, H]: gate rows first
            half = w.shape[1] // 2
            base = key.removesuffix(".gate_up_proj")
            put(base + ".gate_proj.weight", w[:, :half])
            put(base + ".up_proj.weight", w[:, half:])
            continue
        if key.endswith("mlp.experts.down_proj"):
            key += ".weight"
        put(key, w)
    return out


def write_gguf(path, tensors: dict[str, torch.Tensor], cfg, arch: str, quantized: set[str]) -> None:
    _, vocab = byte_tokenizer()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers + (arch == "qwen35"))  # qwen35: with its MTP block
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(getattr(cfg, "intermediate_size", None) or 0)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    rot = int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(rot)
    if arch != "qwen3next":  # the released Qwen3.5 configs all carry mrope sections (pairs of rotary dims)
        w.add_rope_dimension_sections(list(rope.get("mrope_section") or [rot // 2 - rot // 4, rot // 8, rot // 8]) + [0])
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    types = cfg.layer_types
    if arch == "qwen35moe":  # the per-block form
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in types])
    else:  # the interval form (llama.cpp's rule reproduces TEXT's layer_types)
        w.add_full_attention_interval(2)
    if arch == "qwen35":  # one multi-token-prediction block appended (skipped by the loader)
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
        last = cfg.num_hidden_layers - 1
        tensors = dict(tensors, **{n.replace(f"blk.{last}.", f"blk.{last + 1}."): t for n, t in tensors.items()
                                   if n.startswith(f"blk.{last}.")})
        tensors[f"blk.{last + 1}.nextn.eh_proj.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)
    if getattr(cfg, "num_experts", 0):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        arr = t.numpy().astype(np.float32)
        if name in quantized:
            w.add_tensor(name, quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, float64_reference):  # noqa: F811
    out = {}
    for kind, arch in ARCH.items():
        legacy = kind == "qwen3_next_legacy"
        model = make_model(kind.removesuffix("_legacy")).float().eval()
        _randomise(model, seed=SEEDS[kind])
        text = model.config.get_text_config()
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fake = {k: _q8_roundtrip(v) if _quantized(k, v) else v for k, v in sd.items()}
        tensors = convert(sd, text, arch, legacy)
        expected = convert(fake, text, arch, legacy)  # what the Q8_0 file must decode to
        quantized = {n for n, t in tensors.items() if t.dim() >= 2 and t.shape[-1] % 32 == 0
                     and not torch.equal(expected[n], tensors[n])}
        assert legacy == ("blk.0.ssm_in.weight" in tensors)
        path = tmp_path_factory.mktemp(arch) / f"{kind}.gguf"
        write_gguf(path, tensors, text, arch, quantized)
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:  # the file holds the round-tripped weights, exactly
            if t.name not in expected:  # qwen35's MTP block
                assert arch == "qwen35" and t.name.startswith(f"blk.{text.num_hidden_layers}."), t.name
                continue
            shape = tuple(int(x) for x in reversed(t.shape))
            got = quants.dequantize(t.data, t.tensor_type).reshape(shape)
            assert np.array_equal(got, expected[t.name].numpy()), t.name
        assert len(quantized) > 10
        model.load_state_dict(fake)
        out[kind] = (path, model.double())
    return out


@pytest.mark.parametrize("kind", list(ARCH))
def test_gguf_logprobs_match_float64_transformers(kind, gguf_models):
    path, ref = gguf_models[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and scorer.info.architecture == ARCH[kind]
    assert type(scorer.loaded.model).__name__ == "HybridModel"
    seqs = _sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin = 0, 0.0, float("inf")
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _reference(ref, ids)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for p in routers:
            top = p[:hi].topk(3, dim=-1).values
            margin = min(margin, (top[:, 1] - top[:, 2]).min().item())
    assert compared > 50
    if kind != "qwen3_5_text":
        assert margin > MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"{ARCH[kind]} GGUF (Q8_0 + F32): max |delta| {worst:.2e} over {compared} tokens")
    assert worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e} over {compared} tokens"


def _copy_with(src, dst, set_kv=None, rename=None):
    """A copy of a GGUF file with metadata keys replaced and tensors renamed."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    set_kv = set_kv or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in set_kv:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, value in set_kv.items():
        V = gguf.GGUFValueType
        w.add_key_value(key, value, V.STRING if isinstance(value, str) else V.UINT32 if isinstance(value, int)
                        else V.FLOAT32)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        name = (rename or {}).get(t.name, t.name)
        if t.tensor_type == Q.F32:
            w.add_tensor(name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_refusals_name_the_key(gguf_models, tmp_path):
    path = gguf_models["qwen3_5_moe"][0]
    bad = _copy_with(path, tmp_path / "yarn.gguf", set_kv={"qwen35moe.rope.scaling.type": "yarn"})
    with pytest.raises(LogprobeError, match="qwen35moe.rope.scaling.type"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)
    bad = _copy_with(path, tmp_path / "scale.gguf", set_kv={"qwen35moe.expert_weights_scale": 2.5})
    with pytest.raises(LogprobeError, match="expert_weights_scale"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)
    bad = _copy_with(path, tmp_path / "extra.gguf", rename={"blk.0.ssm_out.weight": "blk.0.ssm_x.weight"})
    with pytest.raises(LogprobeError, match="blk.0.ssm_x.weight"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)


# -- deepseek2 ------------------------------------------------------------------------------------

DS_KINDS = {"split_kv_b": dict(VARIANTS["qlora"]),  # newer converts: attn_k_b / attn_v_b
            "yarn_kv_b": dict(VARIANTS["yarn"], rope_parameters=dict(  # older: attn_kv_b; llama.cpp's YaRN
                VARIANTS["yarn"]["rope_parameters"], mscale=1.0, mscale_all_dim=1.0))}  # (cos/sin factor 1)
DS_SEEDS = {"split_kv_b": 0, "yarn_kv_b": 2}


def _ds_quantized(name: str, w: torch.Tensor) -> bool:
    """Q8_0 where the conversion moves whole rows (not kv_b: its k half is stored transposed)."""
    return w.dim() >= 2 and w.shape[-1] % 32 == 0 and not name.endswith(("mlp.gate.weight", "kv_b_proj.weight"))


def convert_deepseek(sd: dict[str, torch.Tensor], cfg, split_kv_b: bool) -> dict[str, torch.Tensor]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    out = {}

    def put(hf: str, w: torch.Tensor) -> None:
        base, _, suffix = hf.rpartition(".")
        name = names.get_name(base)
        assert name is not None, hf
        out[f"{name}.{suffix}"] = w.contiguous()

    H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for key, w in sd.items():
        if key.endswith("e_score_correction_bias"):
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        if key.endswith("mlp.experts.gate_up_proj"):
            half = w.shape[1] // 2
            base = key.removesuffix(".gate_up_proj")
            put(base + ".gate_proj.weight", w[:, :half])
            put(base + ".up_proj.weight", w[:, half:])
            continue
        if key.endswith("mlp.experts.down_proj"):
            key += ".weight"
        if split_kv_b and key.endswith("kv_b_proj.weight"):  # per head [k_nope | v]: k_b transposed, v_b
            k_b, v_b = w.view(H, nope + v, -1).split([nope, v], dim=1)
            put(key.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2))
            put(key.replace("kv_b_proj", "v_b_proj"), v_b)
            continue
        put(key, w)
    return out


def write_deepseek_gguf(path, tensors, cfg, quantized: set[str]) -> None:
    _, vocab = byte_tokenizer()
    w = gguf.GGUFWriter(str(path), arch="deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # latent attention written as MQA
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        arr = t.numpy().astype(np.float32)
        if name in quantized:
            w.add_tensor(name, quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfds.DeepseekV3RMSNorm, "forward", _norm64)
    out = {}
    for kind, variant in DS_KINDS.items():
        cfg = transformers.DeepseekV3Config(**BASE, **variant)
        model = transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager",
                                                                experts_implementation="eager").float().eval()
        _ds_randomise(model, seed=DS_SEEDS[kind])
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fake = {k: _q8_roundtrip(v) if _ds_quantized(k, v) else v for k, v in sd.items()}
        split = kind.startswith("split")
        tensors, expected = convert_deepseek(sd, cfg, split), convert_deepseek(fake, cfg, split)
        quantized = {n for n, t in tensors.items() if not torch.equal(expected[n], t)}
        path = tmp_path_factory.mktemp(kind) / f"{kind}.gguf"
        write_deepseek_gguf(path, tensors, cfg, quantized)
        for t in gguf.GGUFReader(str(path)).tensors:
            got = quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
            assert np.array_equal(got, expected[t.name].numpy()), t.name
        assert len(quantized) > 10 and split == ("blk.1.attn_k_b.weight" in tensors)
        model.load_state_dict(fake)
        out[kind] = (path, model.double())
    yield out
    mp.undo()


@pytest.mark.parametrize("kind", list(DS_KINDS))
def test_deepseek2_gguf_matches_float64_transformers(kind, deepseek_models):
    path, ref = deepseek_models[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.architecture == "deepseek2" and type(scorer.loaded.model).__name__ == "DeepseekModel"
    seqs = _ds_sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin, changed = 0, 0.0, float("inf"), 0
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _ds_reference(ref, ids)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for logits, bias, chosen in routers:
            m, c = _routing_stats(logits, bias, chosen, hi)
            margin, changed = min(margin, m), changed + c
    assert compared > 50 and changed > 0
    assert margin > DS_MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"deepseek2 GGUF {kind} (Q8_0 + F32): max |delta| {worst:.2e} over {compared} tokens")
    assert worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e} over {compared} tokens"


def test_deepseek2_refusals(deepseek_models, tmp_path):
    path = deepseek_models["split_kv_b"][0]
    bad = _copy_with(path, tmp_path / "softmax.gguf", set_kv={"deepseek2.expert_gating_func": 1})
    with pytest.raises(LogprobeError, match="deepseek2.expert_gating_func"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)
    bad = _copy_with(path, tmp_path / "lone.gguf", rename={"blk.1.attn_v_b.weight": "blk.1.attn_v.weight"})
    with pytest.raises(LogprobeError, match="blk.1.attn_v.weight"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)


# -- glm4moe, minimax-m2 ---------------------------------------------------------------------------

SG_ARCH = {"glm4_moe": ("glm4moe", gguf.MODEL_ARCH.GLM4_MOE), "minimax_m2": ("minimax-m2", gguf.MODEL_ARCH.MINIMAXM2)}


def convert_sigmoid_moe(sd: dict[str, torch.Tensor], cfg, family: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> the checkpoint's (MiniMax: Mixtral's block_sparse_moe.experts.w1/w3/w2)
    -> GGUF names, experts stacked, the correction bias as ``*.e_score_correction.bias``."""
    names = gguf.get_tensor_name_map(SG_ARCH[family][1], cfg.num_hidden_layers)
    mm = family == "minimax_m2"
    gate, up, down = ("w1", "w3", "w2") if mm else ("gate_proj", "up_proj", "down_proj")
    out = {}

    def put(hf: str, w: torch.Tensor) -> None:
        base, _, suffix = hf.rpartition(".")
        name = names.get_name(base)
        assert name is not None, hf
        out[f"{name}.{suffix}"] = w.contiguous()

    for key, w in sd.items():
        if mm:
            key = key.replace(".mlp.", ".block_sparse_moe.")
        key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        if key.endswith("experts.gate_up_proj"):  # [E, 2 I, H]: gate rows first
            half = w.shape[1] // 2
            base = key.removesuffix(".gate_up_proj")
            put(f"{base}.{gate}.weight", w[:, :half])
            put(f"{base}.{up}.weight", w[:, half:])
            continue
        if key.endswith("experts.down_proj"):
            key = key.removesuffix("down_proj") + f"{down}.weight"
        put(key, w)
    return out


def write_sigmoid_moe_gguf(path, tensors, cfg, family: str, quantized: set[str]) -> None:
    _, vocab = byte_tokenizer()
    glm = family == "glm4_moe"
    w = gguf.GGUFWriter(str(path), arch=SG_ARCH[family][0])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if glm:
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    else:
        w.add_rope_dimension_count(cfg.rotary_dim)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        arr = t.numpy().astype(np.float32)
        if name in quantized:
            w.add_tensor(name, quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def sigmoid_moe_models(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfglm.Glm4MoeRMSNorm, "forward", _sg_norm64)
    mp.setattr(hfmm.MiniMaxM2RMSNorm, "forward", _sg_norm64)
    out = {}
    for family in SG_ARCH:
        torch.manual_seed(SG_SEEDS[family])
        model = _sg_make_model(family).float().eval()
        _sg_randomise(model, seed=SG_SEEDS[family])
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        q8 = lambda k, v: v.dim() >= 2 and v.shape[-1] % 32 == 0 and not k.endswith("mlp.gate.weight")  # noqa: E731
        fake = {k: _q8_roundtrip(v) if q8(k, v) else v for k, v in sd.items()}
        tensors, expected = convert_sigmoid_moe(sd, model.config, family), convert_sigmoid_moe(fake, model.config, family)
        quantized = {n for n, t in tensors.items() if not torch.equal(expected[n], t)}
        path = tmp_path_factory.mktemp(family) / f"{family}.gguf"
        write_sigmoid_moe_gguf(path, tensors, model.config, family, quantized)
        for t in gguf.GGUFReader(str(path)).tensors:
            got = quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
            assert np.array_equal(got, expected[t.name].numpy()), t.name
        assert len(quantized) > 10
        model.load_state_dict(fake)
        out[family] = (path, model.double())
    yield out
    mp.undo()


@pytest.mark.parametrize("family", list(SG_ARCH))
def test_sigmoid_moe_gguf_matches_float64_transformers(family, sigmoid_moe_models):
    path, ref = sigmoid_moe_models[family]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.architecture == SG_ARCH[family][0] and scorer.info.backend == "native"
    seqs = _sg_sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin, changed = 0, 0.0, float("inf"), 0
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _sg_reference(ref, ids)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for logits, bias, chosen in routers:
            m, c = _sg_routing_stats(logits, bias, chosen, hi, GROUPS[family])
            margin, changed = min(margin, m), changed + c
    assert compared > 50 and (changed > 0 or family == "minimax_m2")
    assert margin > SG_MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"{SG_ARCH[family][0]} GGUF (Q8_0 + F32): max |delta| {worst:.2e} over {compared} tokens")
    assert worst < TOL, f"{family}: max |delta log-prob| {worst:.2e} over {compared} tokens"


def test_sigmoid_moe_refusals(sigmoid_moe_models, tmp_path):
    path = sigmoid_moe_models["minimax_m2"][0]
    bad = _copy_with(path, tmp_path / "scaled.gguf", set_kv={"minimax-m2.expert_weights_scale": 2.5})
    with pytest.raises(LogprobeError, match="minimax-m2.expert_weights_scale"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)
    path = sigmoid_moe_models["glm4_moe"][0]
    bad = _copy_with(path, tmp_path / "softmax.gguf", set_kv={"glm4moe.expert_gating_func": 1})
    with pytest.raises(LogprobeError, match="glm4moe.expert_gating_func"):
        Scorer(str(bad), device="cpu", dtype="float32", progress=False)


# -- gemma3 ---------------------------------------------------------------------------------------

GEMMA_LAYERS = 7  # llama.cpp's pattern: blocks 0-4 and 6 slide, block 5 attends fully


def _gemma_model():
    """test_gemma3's text model under llama.cpp's rules: query_pre_attn_scalar = head_dim, the period-6
    pattern, final logit soft-capping set (written to the file)."""
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(GEMMA_LAYERS)]
    cfg = transformers.Gemma3TextConfig(**dict(G3_TEXT, query_pre_attn_scalar=G3_TEXT["head_dim"]),
                                        num_hidden_layers=GEMMA_LAYERS, layer_types=types, final_logit_softcapping=5.0)
    return transformers.Gemma3ForCausalLM._from_config(cfg, attn_implementation="eager")


def convert_gemma(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    out = {}
    for key, w in sd.items():
        if key == "lm_head.weight":  # tied: the converter skips it
            continue
        if key.endswith("norm.weight"):
            w = w + 1  # Gemma3RMSNorm's 1 + w, baked in
        base, _, suffix = key.rpartition(".")
        name = names.get_name(base)
        assert name is not None, key
        out[f"{name}.{suffix}"] = w.contiguous()
    return out


def write_gemma_gguf(path, tensors, cfg, quantized: set[str]) -> None:
    _, vocab = byte_tokenizer()
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        arr = t.numpy().astype(np.float32)
        if name in quantized:
            w.add_tensor(name, quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg3.Gemma3RMSNorm, "forward", _g3_norm64)
    torch.manual_seed(0)
    model = _gemma_model().float().eval()
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=gen))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fake = {k: _q8_roundtrip(v) if v.dim() == 2 and v.shape[-1] % 32 == 0 else v for k, v in sd.items()}
    tensors, expected = convert_gemma(sd, model.config), convert_gemma(fake, model.config)
    quantized = {n for n, t in tensors.items() if not torch.equal(expected[n], t)}
    path = tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"
    write_gemma_gguf(path, tensors, model.config, quantized)
    for t in gguf.GGUFReader(str(path)).tensors:
        got = quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        assert np.array_equal(got, expected[t.name].numpy()), t.name
    assert len(quantized) > 10
    model.load_state_dict(fake)
    yield path, model.double()
    mp.undo()


def test_gemma3_gguf_matches_float64_transformers(gemma_gguf):
    path, ref = gemma_gguf
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    cfg = scorer.loaded.model.config
    assert scorer.info.architecture == "gemma3" and type(scorer.loaded.model).__name__ == "GemmaModel"
    assert cfg.layer_types == tuple(ref.config.layer_types) and cfg.query_pre_attn_scalar == cfg.head_dim
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.rope_local_theta, cfg.final_logit_softcapping) == \
        (1e5, 4.0, 1e3, 5.0)
    worst, n = _g3_worst(scorer, ref, _g3_sequences())
    print(f"gemma3 GGUF (Q8_0 + F32): max |delta| {worst:.2e} over {n} tokens")
    assert n > 200 and worst < TOL, f"gemma3: max |delta log-prob| {worst:.2e}"

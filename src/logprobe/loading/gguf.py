"""Llama-family GGUF files (llama, qwen2, qwen3 architectures; mixture-of-experts qwen2moe, qwen3moe and
llama-architecture Mixtral): config, weights, tokenizer."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES, QUANT_NAMES, dequantize, split_blocks
from ..layers.moe import MoeSpec, PackedExperts
from ..layers.quant_linear import GGUFLinear
from ..models.llama import LlamaConfig
from ..tokenizer import Tokenizer

ARCHES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
# llama.cpp's build_moe_ffn(norm_w) per architecture: whether the top-k weights are renormalised
_MOE_NORM_W = {"llama": True, "qwen3moe": True, "qwen2moe": False}

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts (models.moe): router, experts [E, out, in], Qwen2-MoE's shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_MOE_PREFIXES = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
                  "ffn_down_shexp")  # tensors of a mixture-of-experts file only: in a dense one, unexpected
_TOP_MAP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
            "output.weight": "lm_head.weight"}


def gguf_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # a corrupt or non-GGUF file
        raise LogprobeError("model", f"{path} is not a readable GGUF file ({e})") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _int_field(reader, key: str, path: Path, default=None) -> int | None:
    """An integer hyperparameter; a per-layer array is accepted only when all its entries are equal."""
    value = _field(reader, key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise LogprobeError("model", f"{path.name}: {key} differs per layer ({value[:8]}...), which the native "
                                "model does not have", "this file is not a plain Llama-family model")
        value = value[0]
    return None if value is None else int(value)


# metadata the native model has no place for: (key under the arch, value that means "not used", what it is).
# llama.cpp reads these for some architectures; a file that sets them is not the plain model logprobe runs.
_UNSUPPORTED_KEYS = (
    ("expert_count", 0, "a mixture of experts"),
    ("expert_used_count", 0, "a mixture of experts"),
    ("expert_shared_count", 0, "shared experts"),
    ("attn_logit_softcapping", 0, "attention logit soft-capping"),
    ("final_logit_softcapping", 0, "final logit soft-capping"),
    ("router_logit_softcapping", 0, "router logit soft-capping"),
    ("logit_scale", 1, "a logit scale"),
    ("embedding_scale", 1, "an embedding scale"),
    ("residual_scale", 1, "a residual scale"),
    ("use_parallel_residual", False, "parallel residual blocks"),
    ("swin_norm", False, "Swin-style norms"),
    ("nextn_predict_layers", 0, "multi-token prediction layers"),
    ("attention.sliding_window", 0, "sliding-window attention"),
    ("attention.sliding_window_pattern", None, "sliding-window attention"),
    ("attention.max_alibi_bias", 0, "ALiBi position biases"),
    ("attention.clamp_kqv", 0, "clamped q/k/v activations"),
    ("attention.causal", True, "non-causal attention"),
    ("attention.scale", 0, "a custom attention scale"),
    ("attention.output_scale", None, "an attention output scale"),
    ("attention.temperature_scale", None, "attention temperature scaling"),
    ("attention.q_lora_rank", 0, "low-rank (MLA) attention"),
    ("attention.kv_lora_rank", 0, "low-rank (MLA) attention"),
    ("attention.key_length_mla", None, "low-rank (MLA) attention"),
    ("rope.dimension_sections", None, "multimodal (sectioned) RoPE"),
    ("rope.freq_base_swa", None, "a second RoPE base for sliding-window layers"),
    ("rope.scaling.attn_factor", 1, "a RoPE attention factor"),
    ("rope.scaling.alpha", 0, "NTK-alpha RoPE scaling"),
)


# MoE metadata whose only value the native MoE model runs is the "unused" one (llama.cpp defaults)
_UNSUPPORTED_MOE_KEYS = (
    ("expert_group_count", 0, "grouped expert routing"),
    ("expert_group_used_count", 0, "grouped expert routing"),
    ("expert_weights_scale", 0, "scaled expert weights"),
    ("leading_dense_block_count", 0, "leading dense blocks"),
    ("moe_every_n_layers", 0, "interleaved dense and MoE blocks"),
    ("expert_chunk_feed_forward_length", 0, "chunked experts"),
)


def _check_metadata(reader, arch: str, path: Path, head_dim: int, moe: bool = False) -> None:
    """Refuse metadata that changes the model's function but has no place in the native model."""
    for suffix, unused, what in _UNSUPPORTED_KEYS + (_UNSUPPORTED_MOE_KEYS if moe else ()):
        if moe and suffix in ("expert_count", "expert_used_count", "expert_shared_count"):
            continue  # read by _moe_spec
        if suffix == "expert_weights_scale" and _field(reader, f"{arch}.{suffix}") == 1:
            continue
        key = f"{arch}.{suffix}"
        value = _field(reader, key)
        if value is None or value == unused or (isinstance(value, list) and all(v == unused for v in value)):
            continue
        raise LogprobeError("model", f"{path.name} sets {key} = {value!r} ({what}), which the native model does not "
                            "run: ignoring it would give a silently wrong model",
                            f"logprobe reads plain {', '.join(ARCHES)} GGUF files")
    for suffix in ("rope.dimension_count", "attention.value_length"):
        value = _int_field(reader, f"{arch}.{suffix}", path)
        if value is not None and value != head_dim:
            raise LogprobeError("model", f"{path.name} sets {arch}.{suffix} = {value}, but the heads are {head_dim} "
                                "wide: the native model rotates and attends over whole heads",
                                f"logprobe reads plain {', '.join(ARCHES)} GGUF files")


def _rope_scaling(reader, arch: str, path: Path) -> dict | None:
    """RoPE scaling as llama.cpp reads it: type "none" scales nothing; "linear" (also the default when
    the type is absent) divides positions by ``rope.scaling.factor`` (or the old ``rope.scale_linear``);
    any other type (yarn, longrope) is refused."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise LogprobeError("model", f"{path.name} sets {arch}.rope.scaling.type = {kind!r}, which the native model "
                            "does not run: ignoring it would give a silently wrong model",
                            "logprobe runs GGUF RoPE scaling types none and linear (and llama3 rope_freqs)")
    if kind == "none":
        return None
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = _field(reader, f"{arch}.rope.scale_linear")
    if factor is None or float(factor) in (0.0, 1.0):  # llama.cpp: 0 means unset
        return None
    return {"rope_type": "linear", "factor": float(factor)}


def gguf_config(reader, path: Path) -> tuple[str, LlamaConfig]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHES:
        raise LogprobeError("model", f"GGUF architecture {arch!r} of {path.name} is not supported",
                            f"logprobe reads GGUF files of {', '.join(ARCHES)}; for other models "
                            "give a Hugging Face directory (transformers backend)")
    names = {t.name for t in reader.tensors}
    for key in ("embedding_length", "attention.head_count", "feed_forward_length", "block_count",
                "attention.layer_norm_rms_epsilon"):
        if _field(reader, f"{arch}.{key}") is None:
            raise LogprobeError("model", f"{path.name} has no {arch}.{key}", "the file is not a complete "
                                f"{arch} model")
    if "token_embd.weight" not in names:
        raise LogprobeError("model", f"{path.name} has no token_embd.weight tensor")
    hidden = _int_field(reader, f"{arch}.embedding_length", path)
    heads = _int_field(reader, f"{arch}.attention.head_count", path)
    head_dim = _int_field(reader, f"{arch}.attention.key_length", path, hidden // heads)
    moe = arch in ("qwen2moe", "qwen3moe") or (arch == "llama" and (_int_field(reader, "llama.expert_count", path)
                                                                     or 0) > 0)
    _check_metadata(reader, arch, path, head_dim, moe)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    cfg = LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=_int_field(reader, f"{arch}.feed_forward_length", path),
        num_layers=_int_field(reader, f"{arch}.block_count", path),
        num_heads=heads,
        num_kv_heads=_int_field(reader, f"{arch}.attention.head_count_kv", path, heads),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, path),
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        moe=_moe_spec(reader, arch, path) if moe else None,
    )
    return arch, cfg


def _moe_spec(reader, arch: str, path: Path):
    """The MoE part of a GGUF's config, as llama.cpp runs these architectures: softmax routing,
    top-k renormalised for qwen3moe and llama (Mixtral), not for qwen2moe; Qwen2-MoE's shared expert
    gated by a sigmoid. Expert widths come from the tensors themselves."""
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # outermost first
    experts = _int_field(reader, f"{arch}.expert_count", path) or 0
    used = _int_field(reader, f"{arch}.expert_used_count", path) or 0
    if experts < 1 or used < 1:
        raise LogprobeError("model", f"{path.name}: a {arch} file needs {arch}.expert_count and "
                            f"{arch}.expert_used_count (got {experts}, {used})")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    if norm is not None and bool(norm) != _MOE_NORM_W[arch]:
        raise LogprobeError("model", f"{path.name} sets {arch}.expert_weights_norm = {norm!r}, but llama.cpp runs "
                            f"{arch} with it {_MOE_NORM_W[arch]}: the file is ambiguous")
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):
        raise LogprobeError("model", f"{path.name} sets {arch}.expert_gating_func = {gating!r} (not softmax), "
                            "which the native MoE model does not run")
    shared = _field(reader, f"{arch}.expert_shared_count")
    if shared not in (None, 0, 1) or (shared == 1 and arch != "qwen2moe"):
        raise LogprobeError("model", f"{path.name} sets {arch}.expert_shared_count = {shared!r}, which the native "
                            f"{arch} model does not run")
    layers = _int_field(reader, f"{arch}.block_count", path)
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes)
    first = next((i for i in range(layers) if i not in dense), None)
    if first is None:
        raise LogprobeError("model", f"{path.name}: {arch}.expert_count = {experts} experts, but no block has the "
                            "router tensor ffn_gate_inp: a mixture-of-experts file needs blk.N.ffn_gate_inp.weight")
    gate_exps = shapes.get(f"blk.{first}.ffn_gate_exps.weight")
    if gate_exps is None or len(gate_exps) != 3:
        raise LogprobeError("model", f"{path.name}: blk.{first}.ffn_gate_exps.weight (a 3-D [experts, ff, embd] "
                            "tensor) is missing; older per-expert tensors (ffn_gate.E) are not read")
    shexp = shapes.get(f"blk.{first}.ffn_gate_shexp.weight")
    return MoeSpec(num_experts=experts, top_k=used, intermediate_size=gate_exps[1], norm_topk_prob=_MOE_NORM_W[arch],
                   shared_intermediate_size=shexp[0] if shexp else 0, dense_layers=dense)


def rope_interleaved(arch: str) -> bool:
    """Whether this architecture's q/k rows are stored interleaved (llama.cpp's conversion permute)."""
    return arch == "llama"


def gguf_tensors(reader, arch: str, cfg: LlamaConfig, packed: bool = False):
    """Yield (module parameter name, float32 tensor); 'rope_freqs' is yielded as is.

    ``packed``: quantized matrices (Q8_0/Q4_0/Q4_1/Q4_K/Q6_K) come as ``GGUFLinear`` modules holding the
    blocks instead of float32 tensors (see ``layers.quant_linear``).

    q/k rows stay as stored: llama.cpp writes `llama` files already in the interleaved RoPE
    layout the native model uses (see ``rope_interleaved``), qwen2/qwen3 in the checkpoint one."""
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in GGML_TYPES:
            raise LogprobeError("model", f"tensor {t.name} has GGUF type {t.tensor_type.name}, which logprobe "
                                "does not read", "use a file with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K tensors")
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the innermost dim first
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if t.name == "rope_freqs.weight":
            name = "rope_freqs"
        elif m and m.group(2) in _LAYER_MAP and (cfg.moe is not None or not m.group(2).startswith(_MOE_PREFIXES)):
            name = f"layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
        elif t.name in _TOP_MAP:
            name = _TOP_MAP[t.name]
        else:
            raise LogprobeError("model", f"unexpected tensor {t.name!r} in a {arch} GGUF file",
                                "this file is not a plain Llama-family model")
        if packed and GGML_TYPES[type_id][0] in QUANT_NAMES and len(shape) == 2:
            yield name, GGUFLinear(GGML_TYPES[type_id][0], **split_blocks(t.data, type_id, shape))
        elif packed and GGML_TYPES[type_id][0] in QUANT_NAMES and len(shape) == 3:  # experts [E, out, in]

            blocks = split_blocks(t.data, type_id, shape)  # rows = E * out
            E, out = shape[0], shape[1]
            yield name, PackedExperts(GGML_TYPES[type_id][0], **{k: v.reshape(E, out, *v.shape[1:])
                                                                 for k, v in blocks.items()})
        elif name.endswith("shared_expert_gate.weight"):  # llama.cpp stores it as a vector [H]
            yield name, dequantize(t.data, type_id, shape).reshape(1, -1)  # [1, H]
        else:
            yield name, dequantize(t.data, type_id, shape)


def gguf_tokenizer(path: Path, reader):
    """A fast tokenizer built from the GGUF metadata by transformers, cached on disk (slow to build)."""
    from transformers import AutoTokenizer


    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:20]
    cache_root = Path(os.environ.get("LOGPROBE_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                     / "logprobe"))
    cache = cache_root / "tokenizers" / key
    hf = None
    if (cache / "tokenizer.json").exists():
        try:
            hf = AutoTokenizer.from_pretrained(str(cache))
        except Exception:
            hf = None
    if hf is None:
        if _field(reader, "tokenizer.ggml.model") is None:
            raise LogprobeError("model", f"{path.name} has no tokenizer metadata (tokenizer.ggml.*)")
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, KeyError) as e:  # transformers reads no config of this architecture (qwen3next),
            if isinstance(e, ValueError) and "not supported" not in str(e):  # or misses a key it wants there
                raise
            from transformers import PreTrainedTokenizerFast  # built from tokenizer.ggml.* alone
            hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            hf.save_pretrained(str(cache))
        except OSError:
            pass  # a read-only home only costs the rebuild next time
    return Tokenizer(hf, add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))

"""Llama-family GGUF files (llama, qwen2, qwen3 architectures): config, weights, tokenizer."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..errors import LogprobeError
from ..models.llama import LlamaConfig
from .gguf_quants import GGML_TYPES, QUANT_NAMES, dequantize, split_blocks

ARCHES = ("llama", "qwen2", "qwen3")

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
}
_TOP_MAP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
            "output.weight": "lm_head.weight"}


def _reader(path: Path):
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


def _check_metadata(reader, arch: str, path: Path, head_dim: int) -> None:
    """Refuse metadata that changes the model's function but has no place in the native model."""
    for suffix, unused, what in _UNSUPPORTED_KEYS:
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
    _check_metadata(reader, arch, path, head_dim)
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
    )
    return arch, cfg


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
        elif m and m.group(2) in _LAYER_MAP:
            name = f"layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
        elif t.name in _TOP_MAP:
            name = _TOP_MAP[t.name]
        else:
            raise LogprobeError("model", f"unexpected tensor {t.name!r} in a {arch} GGUF file",
                                "this file is not a plain Llama-family model")
        if packed and GGML_TYPES[type_id][0] in QUANT_NAMES and len(shape) == 2:
            from ..layers.quant_linear import GGUFLinear

            yield name, GGUFLinear(GGML_TYPES[type_id][0], **split_blocks(t.data, type_id, shape))
        else:
            yield name, dequantize(t.data, type_id, shape)


def gguf_tokenizer(path: Path, reader):
    """A fast tokenizer built from the GGUF metadata by transformers, cached on disk (slow to build)."""
    from transformers import AutoTokenizer

    from ..tokenizer import Tokenizer

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
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            hf.save_pretrained(str(cache))
        except OSError:
            pass  # a read-only home only costs the rebuild next time
    return Tokenizer(hf, add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))

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


def gguf_config(reader, path: Path) -> tuple[str, LlamaConfig]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHES:
        raise LogprobeError("model", f"GGUF architecture {arch!r} of {path.name} is not supported",
                            f"logprobe reads GGUF files of {', '.join(ARCHES)}; for other models "
                            "give a Hugging Face directory (transformers backend)")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rope_scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    cfg = LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
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

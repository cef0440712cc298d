"""Hugging Face directories (config.json + safetensors): native Llama family or transformers backend."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear
from ..layers.moe import ExpertStack, MoeSpec
from ..layers.quant_linear import CTLinear
from ..models.llama import LlamaConfig
from ..tokenizer import Tokenizer
from .awq import awq_tensors
from .checkpoint import _EXPERT, hf_param_name, mapped_tensors
from .compressed import ct_tensors
from .fp8_block import dense_fp8, fp8_block_tensors, fp8_scheme
from .gptq import gptq_tensors
from .phi3 import FUSED, phi3_config, split_fused

log = logging.getLogger(__name__)

NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
NATIVE_QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")  # loading.compressed, gptq, awq, fp8_block
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")  # models.moe
# config fields of other routers (DeepSeek-style grouped routing, score functions, scaling): a
# config of one of MOE_TYPES that sets them is not the model transformers' class runs
_FOREIGN_MOE_KEYS = ("n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
                     "first_k_dense_replace", "n_shared_experts", "moe_layer_freq", "num_shared_experts")


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise LogprobeError("model", f"{path} has no config.json",
                            "give a Hugging Face model directory, a .gguf file or a known model name")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LogprobeError("model", f"{cfg_path} is not valid JSON ({e})") from e


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")  # transformers >= 5
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", "default")
        return float(params["rope_theta"]), (None if kind == "default" else dict(params))
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def native_config(cfg: dict) -> tuple[LlamaConfig | None, str]:
    """LlamaConfig when the native model covers this config, else None and the reason."""
    mtype = cfg.get("model_type")
    if mtype == "phi3":  # fused checkpoint tensors, partial rotation, LongRoPE: loading.phi3
        return phi3_config(cfg)
    if mtype not in NATIVE_TYPES + MOE_TYPES:
        return None, f"model_type {mtype!r} is not in the native Llama family"
    moe, why = _moe_spec(cfg, mtype) if mtype in MOE_TYPES else (None, "")
    if why:
        return None, why
    if cfg.get("mlp_bias"):
        return None, "mlp_bias is not in the native model"
    theta, scaling = _rope(cfg)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ("default", "linear", "llama3", None):
        return None, f"rope type {kind!r} is not in the native model"
    sliding = None
    if mtype in ("mistral", "mixtral"):
        sliding = cfg.get("sliding_window")
    elif cfg.get("use_sliding_window"):
        return None, "per-layer sliding windows are not in the native model"
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        return None, "mixed attention layer types are not in the native model"
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    attention_bias = bool(cfg.get("attention_bias", False)) or mtype == "qwen2" \
        or (mtype == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
    lc = LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=attention_bias,
        qk_norm=mtype in ("qwen3", "qwen3_moe"),
        qk_norm_full=mtype == "olmoe",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        moe=moe,
    )
    return lc, ""


def _moe_spec(cfg: dict, mtype: str):
    """(MoeSpec, "") for a mixture-of-experts config the native model runs exactly, else (None, why)."""
    if cfg.get("hidden_act", "silu") != "silu":
        return None, f"hidden_act {cfg.get('hidden_act')!r} is not in the native MoE model"
    foreign = [k for k in _FOREIGN_MOE_KEYS if cfg.get(k) not in (None, 0, 1.0, [])]
    if foreign:
        return None, f"{foreign[0]} = {cfg[foreign[0]]!r} (another routing scheme) is not in the native MoE model"
    if mtype == "olmoe" and cfg.get("clip_qkv") is not None:
        return None, "clip_qkv is not in the native OLMoE model"
    if mtype == "olmoe" and cfg.get("attention_bias"):
        return None, "attention_bias on OLMoE (a bias on o_proj too) is not in the native model"
    if mtype == "olmoe" and int(cfg.get("head_dim") or 0) not in (0, int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])):
        return None, "head_dim != hidden_size / heads on OLMoE (its k_norm width assumes it) is not in the native model"
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts < 1:
        return None, "num_experts = 0: no expert layers"
    layers = int(cfg["num_hidden_layers"])
    dense: tuple[int, ...] = ()
    if mtype in ("qwen2_moe", "qwen3_moe"):  # transformers' Qwen*MoeDecoderLayer: which blocks are sparse
        step, only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if mtype == "qwen2_moe" else 0
    inter = cfg.get("moe_intermediate_size") if mtype in ("qwen2_moe", "qwen3_moe") else cfg.get("intermediate_size")
    spec = MoeSpec(num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 2)), intermediate_size=int(inter),
                   norm_topk_prob=True if mtype == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
                   shared_intermediate_size=shared, dense_layers=dense)
    return spec, ""


_PACKED_CODES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4")


def check_quantization(raw: dict, path: Path, native: bool) -> None:
    """Refuse quantization metadata that the chosen backend would not run exactly.

    Native: compressed-tensors, GPTQ and AWQ (checked in detail by ``compressed.ct_tensors``,
    ``gptq.gptq_tensors``, ``awq.awq_tensors``). The
    transformers backend: none at all, since transformers would dequantize it or run it with its own
    kernels (GPTQ, AWQ, bitsandbytes, FP8, ...), which is not the checkpoint's exact function."""
    configs = {"quantization_config": raw.get("quantization_config")}
    for sub in ("text_config", "llm_config", "language_config"):
        if isinstance(raw.get(sub), dict) and raw[sub].get("quantization_config") is not None:
            configs[f"{sub}.quantization_config"] = raw[sub]["quantization_config"]
    supported = ("logprobe runs compressed-tensors checkpoints (W4A16, W8A16, FP8, W8A8, NVFP4), GPTQ (4/8-bit), "
                 "AWQ (GEMM) and FP8 block (quant_method fp8) checkpoints of the native Llama family (llama, mistral, qwen2, qwen3) and GGUF "
                 "files; score the unquantized model otherwise")
    for field, q in configs.items():
        if q is None:
            continue
        method = q.get("quant_method") if isinstance(q, dict) else None
        if not native:
            raise LogprobeError(field, f"{path.name}: quant_method {method!r} on model_type "
                                f"{raw.get('model_type')!r}, which runs on the transformers backend: transformers "
                                "would dequantize it or run it with its own kernels, not the checkpoint's exact "
                                "function", supported)
        if method not in NATIVE_QUANT_METHODS or (method != "compressed-tensors" and field != "quantization_config"):
            raise LogprobeError(field, f"{path.name}: quant_method {method!r} is not supported", supported)
    if configs["quantization_config"] is None:
        for name in ("quantize_config.json", "quant_config.json", "quantization_config.json"):
            if (path / name).exists():
                raise LogprobeError("model", f"{path} has {name} (GPTQ/AWQ-style quantization metadata) but no "
                                    "quantization_config in config.json: its tensors would be misread", supported)


def hf_tensors(path: Path, cfg: LlamaConfig, raw: dict | None = None, packed: bool = False,
               quantize_activations: bool = False, place=None):
    """Yield (module parameter name, tensor) from the safetensors files of a native model.

    A compressed-tensors checkpoint (``quantization_config.quant_method == "compressed-tensors"``)
    yields its quantized Linear weights as ``CTLinear`` layers (``packed``) or dequantized. Any other
    quantization metadata, and any tensor that is not a plain float, is refused. ``place``: the
    model's (device, dtype), where float experts are stacked as read (``stack_experts``)."""
    check_quantization(raw or {}, path, native=True)
    qcfg = (raw or {}).get("quantization_config")
    if cfg.extra.get(FUSED):  # Phi-3: qkv_proj and gate_up_proj cut into the Llama model's matrices
        if qcfg is not None:
            raise LogprobeError("quantization_config", f"{path.name}: a quantized Phi-3 checkpoint (fused "
                                "qkv_proj / gate_up_proj) is not read natively yet", "score the unquantized model")
        yield from split_fused(_plain_tensors(path, cfg), cfg)
        return
    if qcfg is not None and qcfg.get("quant_method") == "fp8":  # DeepSeek-style FP8 blocks (loading.fp8_block)
        scheme = fp8_scheme(qcfg, quantize_activations)
        stream = fp8_block_tensors(path, scheme, lambda key, file: hf_param_name(key, cfg, file), log)
        yield from stack_experts(stream if packed else ((n, dense_fp8(w)) for n, w in stream), cfg, place=place)
        return
    if qcfg is not None and cfg.moe is not None and qcfg.get("quant_method") != "compressed-tensors":
        raise LogprobeError("quantization_config", f"{path.name}: a quantized mixture-of-experts checkpoint "
                            f"(quant_method {qcfg.get('quant_method')!r}) is not read natively yet",
                            "score the unquantized model, a compressed-tensors or a GGUF file of it")
    if qcfg is not None and qcfg.get("quant_method") == "gptq":
        yield from gptq_tensors(path, cfg, qcfg, packed)
        return
    if qcfg is not None and qcfg.get("quant_method") == "awq":
        yield from awq_tensors(path, cfg, qcfg, packed)
        return
    if qcfg is not None:
        yield from stack_experts(ct_tensors(path, cfg, qcfg, packed), cfg, place=place)  # W4A16/W8A16: packed
        return
    yield from stack_experts(_plain_tensors(path, cfg), cfg, place=place)


def _plain_tensors(path: Path, cfg: LlamaConfig):
    return mapped_tensors(path, lambda key, file: hf_param_name(key, cfg, file))


def stack_experts(tensors, cfg: LlamaConfig, held: tuple[int, int] | list[int] | None = None, place=None):
    """Per-expert matrices ``layers.N.mlp.experts.{e}.{gate,up,down}_proj.weight`` [out, in] (what
    ``save_pretrained`` writes) -> ``layers.N.mlp.experts.{gate,up,down}_proj`` [E, out, in], yielded
    once all E are read; transformers' in-memory ``experts.gate_up_proj`` [E, 2I, H] is split into
    gate (first I rows) and up. Other tensors pass through. ``held``: the experts [start, end) this
    rank reads (expert parallelism, ``loading.sharding``; default all of them), or a list of expert
    ids stacked in its order (a rank's own experts, then replicas: ``parallel.placement``).

    ``place``: (device, dtype) of the model: float experts are then copied, as each is read, into
    one [E, out, in] tensor made there in that dtype (one conversion from the file's bytes, no
    stack on the host first; what the builder's ``.to(device, dtype)`` would give, bit for bit,
    and then a no-op). None: stacked where and as read."""
    whole = (0, cfg.moe.num_experts if cfg.moe is not None else 0)
    want = held if isinstance(held, list) else list(range(*(held or whole)))
    slot = {e: i for i, e in enumerate(want)}
    pending: dict[str, dict[int, torch.Tensor | None]] = {}
    dests: dict[str, torch.Tensor] = {}  # stacked name -> [E, out, in] being filled (``place``)
    for name, value in tensors:
        m = _EXPERT.fullmatch(name)
        if cfg.moe is None or (m is None and not name.endswith(".experts.gate_up_proj")):
            yield name, value
            continue
        if m is None:  # fused gate_up [E, 2I, H]
            gate, up = split_gate_up(value, place)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
            continue
        stacked, e = f"{m.group(1)}.{m.group(3)}", int(m.group(2))
        got = pending.setdefault(stacked, {})
        if place is not None and e in slot and isinstance(value, torch.Tensor):
            _fill(dests, stacked, len(want), slot[e], value, place)
            value = None  # copied: its place in ``got`` only marks it read
        got[e] = value
        if len(got) == len(want):
            if sorted(got) != sorted(want):
                raise LogprobeError("model", f"{stacked}: expert ids {sorted(got)[:8]}... do not match "
                                    f"num_experts {cfg.moe.num_experts}")
            yield stacked, _done(dests.pop(stacked, None), [got[e] for e in want], stacked)
            del pending[stacked]
    for stacked, got in pending.items():
        missing = sorted(set(want) - set(got))
        raise LogprobeError("model", f"{stacked}: experts {missing[:8]} are missing from the checkpoint "
                            f"(num_experts {cfg.moe.num_experts})")


def _done(filled: torch.Tensor | None, experts: list, name: str):
    """The stacked experts: ``filled`` (copied in as read; ``experts`` then all None) or ``_stack``'s."""
    if filled is None:
        return _stack(experts, name)
    rest = [w for w in experts if w is not None]
    if rest:  # float experts mixed with packed ones: _stack names both kinds
        _stack([filled[0], *rest], name)
    return filled


SLAB_BYTES = 256 << 20  # how much of a fused gate_up tensor crosses to the device per copy


def split_gate_up(value: torch.Tensor, place, slab_bytes: int = SLAB_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused experts ``[E, 2I, H]`` (gate rows first) -> gate, up ``[E, I, H]`` each in its own storage
    (the expert kernels read them whole), on ``place``'s (device, dtype) when given.

    The halves are strided views of the file: copied to a device as they are, each would first be
    gathered into a contiguous host copy. Whole experts ``value[e0:e1]`` are contiguous in the file,
    so slabs of them cross as read and are split on the device (one slab of ``slab_bytes`` extra).
    For example E = 4, I = 2, H = 3, a slab of two experts: rows 0-1 of experts 0 and 1 -> gate[0:2],
    rows 2-3 -> up[0:2]; then experts 2 and 3."""
    inter = value.shape[1] // 2
    if place is None:
        return value[:, :inter].contiguous(), value[:, inter:].contiguous()
    device, dtype = place
    gate = torch.empty((value.shape[0], inter, *value.shape[2:]), device=device, dtype=dtype)
    up = torch.empty_like(gate)
    step = max(1, slab_bytes // max(1, value[0].numel() * value.element_size()))
    for e0 in range(0, value.shape[0], step):
        slab = value[e0:e0 + step].to(device)  # the file's dtype: converted below, on the device
        gate[e0:e0 + step].copy_(slab[:, :inter])
        up[e0:e0 + step].copy_(slab[:, inter:])
    return gate, up


def _fill(dests: dict, stacked: str, n: int, i: int, value: torch.Tensor, place) -> None:
    """Copy expert ``value`` [out, in] into row ``i`` of ``dests[stacked]`` [n, out, in] (made on
    ``place`` at the first expert). ``copy_`` would broadcast a smaller matrix: shapes are checked."""
    dst = dests.get(stacked)
    if dst is None:
        dst = dests[stacked] = torch.empty((n, *value.shape), device=place[0], dtype=place[1])
    if value.shape != dst.shape[1:]:
        _same_shapes(stacked, [dst[0], value])
    dst[i].copy_(value)


def _same_shapes(name: str, experts: list[torch.Tensor]) -> None:
    shapes = sorted({tuple(w.shape) for w in experts})
    if len(shapes) > 1:
        raise LogprobeError("model", f"{name}: experts of shapes {shapes[0]} and {shapes[1]} in the checkpoint, "
                            "one [out, in] for all is expected")


def _stack(experts: list, name: str):
    """E expert weights -> [E, out, in]: float tensors stacked, packed integer layers (compressed-
    tensors ``CTLinear``) kept packed side by side (``ExpertStack``). Anything else is refused: an
    expert with activation quantization would need its rounding inside the expert kernels."""
    if all(isinstance(w, torch.Tensor) for w in experts):
        _same_shapes(name, experts)
        return torch.stack(experts)  # [E, out, in]
    if all(type(w) is CTLinear for w in experts):
        return ExpertStack(experts)
    if all(type(w) is FP8BlockLinear for w in experts):  # FP8 block experts, float activations
        return FP8BlockExperts.stack(experts)
    kinds = sorted({type(w).__name__ for w in experts})
    raise LogprobeError("quantization_config", f"{name}: experts stored as {', '.join(kinds)} are not run natively "
                        "(weight-only integer experts are; activation-quantized ones are not yet)",
                        "quantize the experts weight-only (W4A16 / W8A16), or score a GGUF file")


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer


    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise LogprobeError("model", f"{path} has no tokenizer (tokenizer.json)",
                            "save the tokenizer into the model directory")
    hf = AutoTokenizer.from_pretrained(str(path))
    probe = "a"
    with_special = hf(probe, add_special_tokens=True)["input_ids"]
    add_bos = hf.bos_token_id is not None and len(with_special) > 0 and with_special[0] == hf.bos_token_id
    return Tokenizer(hf, add_bos=add_bos)


def load_transformers_model(path: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    cfg = read_config(path)
    check_quantization(cfg, path, native=False)
    _check_transformers_dtypes(path)
    problem = fla_float32_problem(cfg, device.type, dtype, importlib.util.find_spec("fla") is not None)
    if problem:
        raise LogprobeError("dtype", problem, "score in bfloat16, or with the native backend (this family's "
                            "default), which keeps float32 exact on CUDA")
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    except (ValueError, KeyError, OSError) as e:
        raise LogprobeError("model", f"transformers cannot load {path} as a causal LM ({e})") from e


def fla_float32_problem(cfg: dict, device_type: str, dtype: torch.dtype, fla_installed: bool) -> str | None:
    """Why transformers would not score this model exactly in float32, or None: where fla-core is
    installed, transformers runs linear-attention layers (Qwen3-Next, Qwen3.5: ``layer_types``
    holding ``linear_attention``) in its Triton kernels on CUDA, whose products of float32 inputs
    are TF32 (measured 8.9e-3 from float64 on a tiny Qwen3.5, where float32 is ~1e-5).

    >>> cfg = {"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention", "full_attention"]}}
    >>> fla_float32_problem(cfg, "cuda", torch.float32, True).split(" in ")[0]
    "transformers would run qwen3_5's linear-attention layers"
    >>> [fla_float32_problem(cfg, d, t, f) for d, t, f in (("cpu", torch.float32, True),
    ...  ("cuda", torch.bfloat16, True), ("cuda", torch.float32, False))]
    [None, None, None]
    >>> fla_float32_problem({"model_type": "llama"}, "cuda", torch.float32, True) is None
    True
    """
    text = cfg.get("text_config") or cfg
    linear = "linear_attention" in (text.get("layer_types") or cfg.get("layer_types") or ())
    if not (linear and fla_installed and device_type == "cuda" and dtype == torch.float32):
        return None
    return (f"transformers would run {cfg.get('model_type')}'s linear-attention layers in fla-core's kernels, "
            "whose float32 products are TF32 (about 1e-2 from float64, not float32's 1e-5)")


def _check_transformers_dtypes(path: Path) -> None:
    """transformers casts float8/fp6/fp4 tensors of an unquantized checkpoint to ``dtype`` with no
    scale: refuse them (integer buffers such as GPT-2's attention masks are left to transformers)."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                code = st.get_slice(key).get_dtype()
                if code in _PACKED_CODES:
                    raise LogprobeError("model", f"tensor {key!r} in {f.name} is {code}, and no quantization "
                                        "scheme logprobe reads says how to expand it: transformers would cast it "
                                        "to the model dtype without its scale",
                                        "give float32/float16/bfloat16 weights")

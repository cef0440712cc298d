"""compressed-tensors checkpoints (what llm-compressor saves): integer weight-only schemes, and
FP8 / INT8 schemes that quantize activations.

config.json carries ``quantization_config`` with ``quant_method: compressed-tensors``, a
``format`` and ``config_groups`` of schemes; each quantized Linear ``<m>`` stores

    pack-quantized:  <m>.weight_packed int32 [out, in*bits/32], <m>.weight_scale [out, G],
                     <m>.weight_shape [2], <m>.weight_zero_point (asymmetric: packed along dim 0)
    naive-quantized: <m>.weight int8 [out, in], <m>.weight_scale [out, G] (+ weight_zero_point)

with G = ceil(in / group_size) for the "group" strategy and 1 for "channel". Supported: int4/int8
weights with float activations (W4A16, W4A16_ASYM, W8A16), stored compressed
(``quantization_status: compressed``), or already dequantized (``decompressed``: float weights,
which compressed-tensors itself then uses as they are).

Activation-quantized schemes (``layers.act_quant_linear.ActQuantLinear``, which runs the
activation rounding as the format defines it):

    float-quantized: <m>.weight float8_e4m3fn [out, in], <m>.weight_scale per tensor [1], per
                     channel [out, 1] or per 128x128 block [ceil(out/128), ceil(in/128)], with
                     float8 activations dynamic per token (FP8_DYNAMIC), dynamic per token and
                     group of 128 (FP8_BLOCK) or static per tensor (FP8: <m>.input_scale [1])
    int-quantized:   <m>.weight int8 [out, in], <m>.weight_scale [out, 1], with int8 activations
                     dynamic per token (W8A8)

all symmetric. ``weights="dense"`` builds the same layers with the weight expanded once: the
activation quantization is part of the model's function, so no load drops it.

NVFP4 schemes (``layers.fp4_linear.FP4Linear``, a float32 emulation of the package's functions):

    nvfp4-pack-quantized: <m>.weight_packed uint8 [out, in/2] (two FP4 e2m1 values per byte),
                          <m>.weight_scale float8_e4m3fn [out, in/16], <m>.weight_global_scale [1];
                          NVFP4A16: activations in float; NVFP4: FP4 activations, dynamic "local"
                          scales per token and group of 16 under <m>.input_global_scale [1]

Everything else is refused with an error naming the module, the scheme and what logprobe reads:
other activation schemes (W4A8, MXFP4, asymmetric or dynamic per-tensor activations, quantized
activations of lm_head), float weights without activation quantization (but NVFP4A16), unknown
formats, strategies, tensor suffixes and dtypes, KV-cache / attention quantization, transforms,
sparsity, and float weights whose status says they are not yet quantized. A scheme logprobe does not run is never loaded
"plainly": that computes a different function with no error (an FP8 weight read without its
scale is off by about a nat per token).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..kernels.packing import unpack_int32
from ..layers.act_quant_linear import ActQuantLinear
from ..layers.fp4_linear import FP8, GROUP, FP4Linear
from ..layers.quant_linear import CTLinear
from ..models.llama import LlamaConfig
from .checkpoint import check_plain_dtype, hf_param_name, open_files

_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")  # the layouts logprobe reads
# every compressed-tensors CompressionFormat (0.20): a value outside this list is unknown
_KNOWN_FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
                  "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized",
                  "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized")
_TOP_KEYS = {"config_groups", "quant_method", "kv_cache_scheme", "format", "quantization_status",
             "global_compression_ratio", "ignore", "moe_sparsity_config", "sparsity_config", "transform_config",
             "version"}
_SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
              "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LINEAR_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
_PLAIN_LEAVES = {"weight", "bias", "inv_freq"}

SUPPORTED = ("logprobe runs compressed-tensors int4/int8 weight-only schemes (W4A16, W4A16_ASYM, W8A16: "
             "int weights with group or channel scales, stored pack-quantized or naive-quantized, activations "
             "in float), FP8 (FP8, FP8_DYNAMIC, FP8_BLOCK), INT8 W8A8, NVFP4 and NVFP4A16 schemes; for anything "
             "else score the unquantized model")


def _refuse(problem: str, fix: str = SUPPORTED):
    raise LogprobeError("quantization_config", problem, fix)


def _check_layout(module: str, where: str, fmt: str, t: dict, layout: set[str], optional: set[str]) -> None:
    """The module's stored tensors are ``layout`` plus some of ``optional``: an extra one would be
    ignored (a different model), a missing one cannot be read."""
    extra = sorted(set(t) - layout - optional)
    if extra:
        _refuse(f"{where} stores {', '.join(module + '.' + x for x in extra)}, which the {fmt} layout logprobe "
                f"reads ({', '.join(sorted(layout | optional))}) does not have: it would be ignored, and the "
                "model would compute something else")
    missing = sorted(layout - set(t))
    if missing:
        _refuse(f"{where} lacks {', '.join(module + '.' + x for x in missing)}")


# -- the config -----------------------------------------------------------------------------------------


def _args_text(a: dict) -> str:
    """QuantizationArgs in words: 'float8 dynamic per-token', 'int4 per-group 128'."""
    kind = f"{a.get('type', 'int')}{a.get('num_bits', 8)}"
    if a.get("dynamic"):
        kind += f" dynamic{'' if a['dynamic'] is True else ' ' + str(a['dynamic'])}"
    strategy = a.get("strategy")
    if strategy:
        kind += f" per-{strategy}"
    if a.get("group_size"):
        kind += f" {a['group_size']}"
    if a.get("block_structure"):
        kind += f" blocks {a['block_structure']}"
    return kind


def describe(scheme: dict, fmt: str | None) -> str:
    """A scheme in words, e.g. "format 'float-quantized', weights float8 per-channel, input activations
    float8 dynamic per-token"."""
    parts = [f"format {fmt!r}"]
    for key, label in (("weights", "weights"), ("input_activations", "input activations"),
                       ("output_activations", "output activations")):
        if isinstance(scheme.get(key), dict):
            parts.append(f"{label} {_args_text(scheme[key])}")
    return ", ".join(parts)


def check_config(qcfg: dict) -> None:
    """Refuse a quantization_config whose top level asks for something logprobe does not run."""
    if not isinstance(qcfg, dict):
        _refuse(f"must be a JSON object, got {type(qcfg).__name__}")
    method = qcfg.get("quant_method")
    if method != "compressed-tensors":
        _refuse(f"quant_method {method!r} is not supported",
                "logprobe reads compressed-tensors checkpoints (llm-compressor), GGUF files, or unquantized "
                "safetensors; dequantize the model or score the unquantized original")
    unknown = sorted(set(qcfg) - _TOP_KEYS)
    if unknown:
        _refuse(f"compressed-tensors keys {unknown} are not known to logprobe, which cannot tell whether they "
                "change the model's function")
    status = qcfg.get("quantization_status")
    if status not in ("compressed", "decompressed"):
        _refuse(f"quantization_status {status!r}: the stored weights are not compressed (nor stated to be "
                "already dequantized), so compressed-tensors would still quantize them in every forward pass; "
                "loading them as they are would score a different model",
                "save the model compressed (llm-compressor save_compressed=True, quantization_status "
                "'compressed')")
    top = qcfg.get("format")
    if top is not None and top not in _KNOWN_FORMATS:
        _refuse(f"format {top!r} is not a compressed-tensors format logprobe knows")
    if qcfg.get("kv_cache_scheme") is not None:
        _refuse(f"kv_cache_scheme {qcfg['kv_cache_scheme']!r} quantizes the KV cache, which logprobe does not run")
    if qcfg.get("transform_config"):
        _refuse("transform_config applies online transforms (rotations) that logprobe does not run")
    sparsity = qcfg.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        _refuse(f"sparsity_config with format {fmt!r} stores weights in a sparse layout logprobe does not read")
    if qcfg.get("moe_sparsity_config"):
        _refuse("moe_sparsity_config is not run by logprobe")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse("config_groups is empty or missing: no scheme says how the weights are stored")
    for name, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("targets"), list):
            _refuse(f"config group {name!r} is not a scheme with a list of targets")
        unknown = sorted(set(g) - _SCHEME_KEYS)
        if unknown:
            _refuse(f"config group {name!r} has keys {unknown} that logprobe does not know")
        fmt = g.get("format")
        if fmt is not None and fmt not in _KNOWN_FORMATS:
            _refuse(f"config group {name!r} has format {fmt!r}, which is not a compressed-tensors format "
                    "logprobe knows")
        for t in g["targets"]:
            if not isinstance(t, str):
                _refuse(f"config group {name!r} has a target {t!r} that is not a string")
            if _targets_attention(t):
                _refuse(f"config group {name!r} targets attention modules ({t!r}): attention / KV-cache "
                        f"quantization ({describe(g, fmt or top)}) is not run by logprobe")
    if not isinstance(qcfg.get("ignore") or [], list):
        _refuse(f"ignore must be a list of module names or patterns, got {qcfg['ignore']!r}")


def _match_name(name: str, target: str) -> bool:
    """compressed-tensors' ``match_name``: "re:<regex>" (re.match) or the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _classes(module: str) -> tuple[str, ...]:
    """The torch classes (MRO names that matter) of a module of the native Llama family."""
    leaf = module.rpartition(".")[2]
    if leaf in _LINEAR_LEAVES or module == "lm_head":
        return ("Linear", "Module")
    if leaf == "embed_tokens":
        return ("Embedding", "Module")
    return ("Module",)


def _targets_attention(target: str) -> bool:
    """Whether a target selects attention modules themselves (compressed-tensors then quantizes the
    attention / KV cache): a class name like LlamaAttention, or a name that matches ``self_attn``
    but not its projections."""
    if not target.startswith("re:") and "." not in target and target.endswith("Attention"):
        return True
    attn = "model.layers.0.self_attn"
    return _match_name(attn, target) and not _match_name("model.layers.0", target) \
        and not any(_match_name(f"{attn}.{p}", target) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def _ignored(module: str, ignore: list[str]) -> bool:
    return any(_match_name(module, t) or t in _classes(module) for t in ignore)


def scheme_for(module: str, groups: dict, ignore: list[str]) -> tuple[str, dict] | None:
    """(group name, scheme) that compressed-tensors applies to a module, or None (not quantized).

    As ``apply_quantization_config`` decides: only Linear and Embedding modules are quantized; a
    module is skipped if an ``ignore`` entry matches its name or class; of the targets matching it,
    exact names come first, then regexes, then class names (each alphabetical); a target named by
    several groups belongs to the last of them."""
    classes = _classes(module)
    if "Linear" not in classes and "Embedding" not in classes:
        return None
    owner: dict[str, tuple[str, dict]] = {}
    for gname, g in groups.items():
        for t in g["targets"]:
            owner[t] = (gname, g)
    if _ignored(module, ignore):
        return None
    targets = sorted(owner, key=lambda x: ("re:" in x, x))
    matched = [t for t in targets if _match_name(module, t)] + [t for t in targets if t in classes]
    return owner[matched[0]] if matched else None


def _check_scheme(module: str, gname: str, scheme: dict, fmt: str | None) -> dict | None:
    """The weights' QuantizationArgs, if logprobe runs this scheme exactly; else a LogprobeError."""
    where = f"{module} (config group {gname!r}: {describe(scheme, fmt)})"
    if scheme.get("output_activations") is not None:
        _refuse(f"{where} quantizes its output activations, which logprobe does not run")
    if _is_fp4(scheme):
        return _check_fp4_scheme(module, where, scheme, fmt)
    if scheme.get("input_activations") is not None:
        return _check_act_scheme(module, where, scheme, fmt)
    w = scheme.get("weights")
    if w is None:
        return None
    if not isinstance(w, dict):
        _refuse(f"{where}: weights must be an object, got {w!r}")
    unknown = sorted(set(w) - _ARGS_KEYS)
    if unknown:
        _refuse(f"{where}: weight options {unknown} are not known to logprobe")
    if w.get("type", "int") != "int":
        _refuse(f"{where}: {w.get('type')} weights are not supported without activation quantization "
                "(weight-only schemes: integer codes times a float scale)")
    if w.get("num_bits", 8) not in (4, 8):
        _refuse(f"{where}: {w.get('num_bits')}-bit weights are not supported")
    if fmt is None:
        _refuse(f"{where}: neither the group nor the config names a format, so the stored layout is unknown")
    if fmt not in _FORMATS:
        _refuse(f"{where}: format {fmt!r} is not a layout logprobe reads")
    if w.get("strategy") not in ("group", "channel"):
        _refuse(f"{where}: weight strategy {w.get('strategy')!r} is not supported", "use group or channel scales")
    if w.get("strategy") == "group" and (not isinstance(w.get("group_size"), int) or w["group_size"] < 1):
        _refuse(f"{where}: group strategy with group_size {w.get('group_size')!r}")
    if w.get("dynamic", False) is not False:
        _refuse(f"{where}: dynamic weight scales ({w.get('dynamic')!r}) are not supported")
    if w.get("block_structure") is not None:
        _refuse(f"{where}: block_structure {w['block_structure']!r} is not supported")
    if w.get("actorder") not in (None, "weight", "static"):  # "group"/"dynamic" reorder groups: g_idx
        _refuse(f"{where}: actorder {w.get('actorder')!r} is not supported",
                "use actorder 'weight' (or none), which keeps groups contiguous")
    if not isinstance(w.get("symmetric", True), bool):
        _refuse(f"{where}: symmetric must be true or false, got {w.get('symmetric')!r}")
    return w


def _check_act_scheme(module: str, where: str, scheme: dict, fmt: str | None) -> dict:
    """The weights' QuantizationArgs of a scheme that quantizes input activations, if it is one that
    ``ActQuantLinear`` runs exactly (FP8 / FP8_DYNAMIC / FP8_BLOCK, W8A8 int8); else a LogprobeError."""
    a, w = scheme["input_activations"], scheme.get("weights")
    runs = ("logprobe runs activation quantization for float8 e4m3 weights (per-tensor, per-channel or "
            "128x128 block scales, format 'float-quantized') with float8 activations (static per-tensor, dynamic "
            "per-token or per-token groups), and int8 per-channel weights (format 'int-quantized') with int8 "
            "dynamic per-token activations, all symmetric; for anything else score the unquantized model")
    if not isinstance(a, dict) or not isinstance(w, dict):
        _refuse(f"{where} quantizes its input activations but its weights / input_activations are not both "
                "objects", runs)
    for label, args in (("weight", w), ("input activation", a)):
        unknown = sorted(set(args) - _ARGS_KEYS)
        if unknown:
            _refuse(f"{where}: {label} options {unknown} are not known to logprobe", runs)
    if module == "lm_head" or "Linear" not in _classes(module):
        _refuse(f"{where} quantizes the input activations of {module}, which logprobe does not run there (the "
                "log-prob head and the embedding read their weights directly)", "leave lm_head unquantized "
                "(ignore: ['lm_head'], as llm-compressor does)")
    kind = w.get("type", "int")
    if kind not in ("float", "int") or w.get("num_bits", 8) != 8 or a.get("type", "int") != kind \
            or a.get("num_bits", 8) != 8:
        _refuse(f"{where} quantizes its input activations with {_args_text(w)} weights and {_args_text(a)} "
                "activations, a combination logprobe does not run", runs)
    want = "float-quantized" if kind == "float" else "int-quantized"
    if fmt != want:
        _refuse(f"{where}: {kind}8 weights with quantized activations are read from format {want!r}, not {fmt!r}",
                runs)
    for label, args in (("weights", w), ("input activations", a)):
        if args.get("symmetric", True) is not True:
            _refuse(f"{where}: asymmetric {label} (a zero point) are not run with activation quantization", runs)
        if args.get("actorder") is not None:
            _refuse(f"{where}: {label} actorder {args['actorder']!r} is not supported", runs)
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block") or w.get("dynamic", False) is not False:
        _refuse(f"{where}: weight strategy {strategy!r} (dynamic {w.get('dynamic', False)!r}) is not run with "
                "activation quantization", runs)
    block = w.get("block_structure")
    if strategy == "block" and (not isinstance(block, list) or len(block) != 2
                                or not all(isinstance(b, int) and b > 0 for b in block)):
        _refuse(f"{where}: block strategy with block_structure {block!r}", runs)
    if strategy != "block" and block is not None:
        _refuse(f"{where}: block_structure {block!r} with weight strategy {strategy!r}", runs)
    dynamic, astrategy = a.get("dynamic", False), a.get("strategy")
    if a.get("scale_dtype") is not None:
        _refuse(f"{where}: input activation scales rounded to {a['scale_dtype']!r} are not run", runs)
    if dynamic is True and astrategy == "token":
        pass
    elif dynamic is True and astrategy == "group" and kind == "float":
        if not isinstance(a.get("group_size"), int) or a["group_size"] < 1:
            _refuse(f"{where}: input activation group strategy with group_size {a.get('group_size')!r}", runs)
    elif dynamic is False and astrategy == "tensor" and kind == "float":
        pass
    elif dynamic is True and astrategy == "tensor":
        _refuse(f"{where}: dynamic per-tensor input activations (one scale from every token of the batch) are "
                "not run: a token's log-prob would depend on the other tokens scored with it", runs)
    else:
        _refuse(f"{where}: {'dynamic ' + repr(dynamic) if dynamic else 'static'} input activations with "
                f"strategy {astrategy!r} are not run", runs)
    return w


def _is_fp4(scheme: dict) -> bool:
    """Whether a scheme's weights are 4-bit floats (NVFP4 / NVFP4A16, and MXFP4, which is refused)."""
    w = scheme.get("weights")
    return isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 4


_FP4_SCALE_DTYPES = (None, "torch.float8_e4m3fn", "float8_e4m3fn")


def _check_fp4_scheme(module: str, where: str, scheme: dict, fmt: str | None) -> dict:
    """The weights' QuantizationArgs of an NVFP4 / NVFP4A16 scheme ``layers.fp4_linear.FP4Linear``
    runs exactly; else a LogprobeError. An activation scale_dtype of None (checkpoints written before
    compressed-tensors had the key) is read as float8 e4m3, the rounding those versions and vLLM apply."""
    w, a = scheme["weights"], scheme.get("input_activations")
    runs = ("logprobe runs NVFP4A16 (FP4 e2m1 weights in groups of 16 with float8 e4m3 scales and a float32 "
            "global scale, format 'nvfp4-pack-quantized', symmetric) and NVFP4 (the same weights with FP4 "
            "activations: dynamic 'local' per-token groups of 16 under a static global scale); for anything else "
            "score the unquantized model")
    for label, args in (("weight", w), ("input activation", a)):
        if args is None:
            continue
        if not isinstance(args, dict):
            _refuse(f"{where}: {label} arguments must be an object, got {args!r}", runs)
        unknown = sorted(set(args) - _ARGS_KEYS)
        if unknown:
            _refuse(f"{where}: {label} options {unknown} are not known to logprobe", runs)
    if a is not None and (module == "lm_head" or "Linear" not in _classes(module)):
        _refuse(f"{where} quantizes the input activations of {module}, which logprobe does not run there (the "
                "log-prob head and the embedding read their weights directly)", "leave lm_head unquantized "
                "(ignore: ['lm_head'], as llm-compressor does)")
    if fmt != "nvfp4-pack-quantized":
        _refuse(f"{where}: float4 weights are read from format 'nvfp4-pack-quantized', not {fmt!r}", runs)
    for label, args in (("weights", w), ("input activations", a)):
        if args is None:
            continue
        if args.get("type") != "float" or args.get("num_bits") != 4:
            _refuse(f"{where}: {label} {_args_text(args)} with float4 weights is a combination logprobe does not "
                    "run", runs)
        if args.get("strategy") != "tensor_group" or args.get("group_size") != 16:
            _refuse(f"{where}: {label} strategy {args.get('strategy')!r} with group_size {args.get('group_size')!r} "
                    "is not NVFP4's (tensor_group, 16; MXFP4's groups of 32 with power-of-two scales are not run)",
                    runs)
        if args.get("symmetric", True) is not True:
            _refuse(f"{where}: asymmetric {label} are not run", runs)
        if args.get("actorder") is not None or args.get("block_structure") is not None:
            _refuse(f"{where}: {label} actorder / block_structure "
                    f"{args.get('actorder') or args.get('block_structure')!r} are not run", runs)
        if args.get("scale_dtype") not in _FP4_SCALE_DTYPES:
            _refuse(f"{where}: {label} scale_dtype {args['scale_dtype']!r} is not NVFP4's float8_e4m3fn", runs)
    if w.get("dynamic", False) is not False:
        _refuse(f"{where}: dynamic weight scales ({w.get('dynamic')!r}) are not run", runs)
    if a is not None and a.get("dynamic") != "local":
        _refuse(f"{where}: input activations dynamic {a.get('dynamic')!r}: NVFP4 activations are run with dynamic "
                "'local' scales (per token and group) under the stored input_global_scale", runs)
    return w


# -- the tensors ------------------------------------------------------------------------------------------


def _check_dtype(module: str, leaf: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        _refuse(f"{module}.{leaf} is {str(t.dtype).removeprefix('torch.')}, but the {what} logprobe reads "
                f"holds {names}")


def ct_layer(module: str, t: dict[str, torch.Tensor], scheme: dict, fmt: str, gname: str = "?"):
    """One module's stored tensors (leaf -> tensor, bias excluded) -> a ``CTLinear``; anything in them
    that the scheme's layout does not define, or defines differently, is refused."""
    w = _check_scheme(module, gname, scheme, fmt)
    if w is None:
        _refuse(f"{module} holds quantized tensors but config group {gname!r} has no weight scheme")
    if _is_fp4(scheme):
        return fp4_layer(module, t, scheme, fmt)
    if scheme.get("input_activations") is not None:
        return act_quant_layer(module, t, scheme, fmt)
    where = f"{module} ({describe(scheme, fmt)})"
    bits = int(w.get("num_bits", 8))
    codes = "weight_packed" if fmt == "pack-quantized" else "weight"
    layout = {codes, "weight_scale"} | ({"weight_shape"} if fmt == "pack-quantized" else set())
    optional = {"weight_zero_point", "weight_g_idx"}
    _check_layout(module, where, fmt, t, layout, optional)
    scale = t["weight_scale"]
    _check_dtype(module, "weight_scale", scale, _SCALE_DTYPES, f"{fmt} scale")
    if fmt == "pack-quantized":
        qweight = t["weight_packed"]
        _check_dtype(module, "weight_packed", qweight, (torch.int32,), f"{fmt} weight")
        shape = t["weight_shape"]
        if shape.is_floating_point() or shape.numel() != 2 or qweight.ndim != 2:
            _refuse(f"{where}: weight_shape {shape.tolist()} / weight_packed {tuple(qweight.shape)} is not a "
                    "2-D weight")
        out, cols = (int(x) for x in shape.tolist())
        if out != qweight.shape[0] or qweight.shape[1] != -(-cols * bits // 32):
            _refuse(f"{where}: weight_packed {tuple(qweight.shape)} does not hold a [{out}, {cols}] {bits}-bit "
                    "weight")
    else:
        qweight = t["weight"]
        _check_dtype(module, "weight", qweight, (torch.int8,), f"{fmt} {bits}-bit weight")
        if qweight.ndim != 2:
            _refuse(f"{where}: weight of shape {tuple(qweight.shape)} is not 2-D")
        out, cols = qweight.shape
    if scale.ndim == 1:
        scale = scale[:, None]  # [out] -> [out, 1]
    group = int(w["group_size"]) if w["strategy"] == "group" else cols
    if "weight_g_idx" in t:  # only the trivial order (group k // group_size) is what CTLinear computes
        g_idx = t["weight_g_idx"]
        if g_idx.is_floating_point() or not torch.equal(g_idx.long().flatten(), torch.arange(cols) // group):
            _refuse(f"{where}: {module}.weight_g_idx reorders columns into groups (activation ordering), which "
                    "logprobe does not run", "quantize with actorder 'weight' or none")
    zp = t.get("weight_zero_point")
    if zp is not None:
        if zp.is_floating_point():
            if not torch.equal(zp, zp.round()):
                _refuse(f"{where}: {module}.weight_zero_point holds non-integer values")
            zp = zp.to(torch.int16)  # unpacked codes (never the packed int32 layout)
        if zp.ndim == 1:
            zp = zp[:, None]
        if fmt == "pack-quantized" and zp.dtype == torch.int32:
            zp = unpack_int32(zp.T.contiguous(), bits, out).T  # packed along the output dim
        if zp.is_floating_point() or zp.dtype == torch.bool or tuple(zp.shape) != tuple(scale.shape):
            _refuse(f"{where}: {module}.weight_zero_point ({str(zp.dtype).removeprefix('torch.')}, "
                    f"{tuple(zp.shape)}) does not match its scales {tuple(scale.shape)}")
        zp = zp.to(torch.int8).contiguous()  # [out, G]
    if w.get("symmetric", True):
        if zp is not None and bool(zp.any()):
            _refuse(f"{where} is symmetric but stores a non-zero {module}.weight_zero_point")
        zp = None
    elif zp is None:
        _refuse(f"{where} is asymmetric but has no {module}.weight_zero_point")
    return CTLinear(qweight.contiguous(), scale.contiguous(), zp, bits, group, cols)


def _zero(module: str, where: str, t: dict[str, torch.Tensor], leaf: str) -> None:
    zp = t.get(leaf)
    if zp is not None and bool((zp.float() != 0).any()):
        _refuse(f"{where} is symmetric but stores a non-zero {module}.{leaf}")


def act_quant_layer(module: str, t: dict[str, torch.Tensor], scheme: dict, fmt: str):
    """One module's stored tensors (bias excluded) of a scheme ``_check_act_scheme`` accepted -> an
    ``ActQuantLinear``; tensors the layout does not define, or defines differently, are refused.

    float-quantized / int-quantized: <m>.weight float8_e4m3fn / int8 [out, in], <m>.weight_scale
    ([1] per tensor, [out, 1] per channel, [ceil(out/bh), ceil(in/bw)] per block), <m>.input_scale [1]
    for static activations; zero points, if stored, must be zero (symmetric)."""
    w, a = scheme["weights"], scheme["input_activations"]
    where = f"{module} ({describe(scheme, fmt)})"
    static = a.get("dynamic") is False
    layout = {"weight", "weight_scale"} | ({"input_scale"} if static else set())
    optional = {"weight_zero_point", "input_zero_point"}
    _check_layout(module, where, fmt, t, layout, optional)
    kind = w.get("type", "int")
    qweight, scale = t["weight"], t["weight_scale"]
    _check_dtype(module, "weight", qweight, (FP8,) if kind == "float" else (torch.int8,), f"{fmt} weight")
    _check_dtype(module, "weight_scale", scale, _SCALE_DTYPES, f"{fmt} scale")
    if qweight.ndim != 2:
        _refuse(f"{where}: weight of shape {tuple(qweight.shape)} is not 2-D")
    out, cols = qweight.shape
    for leaf in optional:
        _zero(module, where, t, leaf)
    strategy = w["strategy"]
    if strategy == "block":
        bh, bw = w["block_structure"]
        want = (-(-out // bh), -(-cols // bw))
        if tuple(scale.shape) != want:
            _refuse(f"{where}: {module}.weight_scale {tuple(scale.shape)} is not one scale per {bh}x{bw} block "
                    f"of a [{out}, {cols}] weight {want}")
        scale, block_cols = scale.repeat_interleave(bh, dim=0)[:out], bw  # [out, ceil(in/bw)]
    elif strategy == "channel":
        if scale.numel() != out or scale.ndim not in (1, 2) or scale.shape[0] != out:
            _refuse(f"{where}: {module}.weight_scale {tuple(scale.shape)} is not one scale per output channel "
                    f"({out})")
        scale, block_cols = scale.reshape(out, 1), cols
    else:  # tensor
        if scale.numel() != 1:
            _refuse(f"{where}: {module}.weight_scale {tuple(scale.shape)} is not one per-tensor scale")
        scale, block_cols = scale.reshape(1, 1).expand(out, 1), cols
    input_scale = None
    if static:
        input_scale = t["input_scale"]
        _check_dtype(module, "input_scale", input_scale, _SCALE_DTYPES, f"{fmt} input scale")
        if input_scale.numel() != 1:
            _refuse(f"{where}: {module}.input_scale {tuple(input_scale.shape)} is not one per-tensor scale")
        if not bool(input_scale.float() > 0) or not bool(torch.isfinite(input_scale.float())):
            _refuse(f"{where}: {module}.input_scale is {input_scale.item()!r}, not a positive finite scale")
    group = a.get("group_size") if a.get("strategy") == "group" else None
    if group is not None and cols % group:
        _refuse(f"{where}: input activation groups of {group} do not divide the input width {cols}")
    return ActQuantLinear(qweight.contiguous(), scale.contiguous(), block_cols, kind, input_scale, group)


def _global_scale(module: str, where: str, t: dict[str, torch.Tensor], leaf: str) -> torch.Tensor:
    g = t[leaf]
    _check_dtype(module, leaf, g, _SCALE_DTYPES, "nvfp4-pack-quantized global scale")
    if g.numel() != 1:
        _refuse(f"{where}: {module}.{leaf} {tuple(g.shape)} is not one global scale")
    if not bool(g.float() > 0) or not bool(torch.isfinite(g.float())):
        _refuse(f"{where}: {module}.{leaf} is {g.item()!r}, not a positive finite scale")
    return g.float().reshape(1)


def fp4_layer(module: str, t: dict[str, torch.Tensor], scheme: dict, fmt: str):
    """One NVFP4 / NVFP4A16 module's stored tensors (bias excluded) -> an ``FP4Linear``:
    <m>.weight_packed uint8 [out, in/2], <m>.weight_scale float8_e4m3fn [out, in/16],
    <m>.weight_global_scale [1], and for NVFP4 <m>.input_global_scale [1]; zero points, if stored,
    must be zero (symmetric)."""
    where = f"{module} ({describe(scheme, fmt)})"
    act = scheme.get("input_activations") is not None
    layout = {"weight_packed", "weight_scale", "weight_global_scale"} | ({"input_global_scale"} if act else set())
    optional = {"weight_zero_point"} | ({"input_zero_point"} if act else set())
    _check_layout(module, where, fmt, t, layout, optional)
    packed, scale = t["weight_packed"], t["weight_scale"]
    _check_dtype(module, "weight_packed", packed, (torch.uint8,), f"{fmt} weight")
    _check_dtype(module, "weight_scale", scale, (FP8,), f"{fmt} group scale")
    if packed.ndim != 2 or scale.ndim != 2 or (2 * packed.shape[1]) % GROUP \
            or tuple(scale.shape) != (packed.shape[0], 2 * packed.shape[1] // GROUP):
        _refuse(f"{where}: {module}.weight_packed {tuple(packed.shape)} and {module}.weight_scale "
                f"{tuple(scale.shape)} are not a [out, in/2] weight with one scale per {GROUP} columns")
    for leaf in optional:
        _zero(module, where, t, leaf)
    wgs = _global_scale(module, where, t, "weight_global_scale")
    igs = _global_scale(module, where, t, "input_global_scale") if act else None
    return FP4Linear(packed.contiguous(), scale.contiguous(), wgs, igs)


def ct_tensors(path: Path, cfg: LlamaConfig, qcfg: dict, packed: bool):
    """Yield (parameter name, tensor or CTLinear) for a compressed-tensors checkpoint."""


    check_config(qcfg)
    groups, ignore = qcfg["config_groups"], qcfg.get("ignore") or []
    top_format, status = qcfg.get("format"), qcfg["quantization_status"]
    modules: dict[str, dict[str, torch.Tensor]] = {}
    files: dict[str, str] = {}
    for f, st in open_files(path):
        for key in st.keys():
            module, _, leaf = key.rpartition(".")
            modules.setdefault(module, {})[leaf] = st.get_tensor(key)
            files[key] = f.name
    for module, t in modules.items():
        found = scheme_for(module, groups, ignore)
        w = None
        if found is not None:
            gname, scheme = found
            fmt = scheme.get("format") or top_format
            w = _check_scheme(module, gname, scheme, fmt)
        if w is None:  # not quantized: plain float tensors only
            odd = sorted(set(t) - _PLAIN_LEAVES)
            if odd:
                if found is not None:
                    why = f"config group {found[0]!r} has no weight scheme"
                elif "Linear" not in _classes(module) and "Embedding" not in _classes(module):
                    why = "it is not a Linear or Embedding module"
                elif _ignored(module, ignore):
                    why = "it is in the ignore list"
                else:
                    why = "no config group targets it"
                _refuse(f"{module} stores {', '.join(module + '.' + x for x in odd)}, but the quantization config "
                        f"does not quantize {module} ({why}): logprobe will not guess what these tensors do")
            for leaf, value in t.items():
                key = f"{module}.{leaf}" if module else leaf
                name = hf_param_name(key, cfg, files[key])
                if name is not None:
                    check_plain_dtype(key, value, files[key])
                    yield name, value
            continue
        bias = t.get("bias")
        if bias is not None:
            check_plain_dtype(f"{module}.bias", bias, files[f"{module}.bias"])
        if status == "decompressed" and scheme.get("input_activations") is not None:
            _refuse(f"{module} ({describe(scheme, fmt)}) is 'decompressed': its float weights would still need "
                    "their activation quantization, which logprobe runs only from the compressed layout",
                    "save the model compressed (llm-compressor save_compressed=True)")
        if status == "decompressed":  # float weights already dequantized: compressed-tensors uses them as they are
            odd = sorted(set(t) - {"weight", "bias", "weight_scale", "weight_zero_point", "weight_g_idx"})
            if odd or "weight" not in t:
                _refuse(f"{module} ({describe(scheme, fmt)}) is 'decompressed' but stores "
                        f"{sorted(t)}, not a float weight beside its quantization parameters")
            check_plain_dtype(f"{module}.weight", t["weight"], files[f"{module}.weight"])
            layer = t["weight"]
        else:
            layer = ct_layer(module, {k: v for k, v in t.items() if k != "bias"}, scheme, fmt, gname)
            if not packed:  # an activation-quantized layer stays one: its rounding is part of the model
                layer = layer.expand() if scheme.get("input_activations") is not None else layer.dense()
        name = hf_param_name(module + ".weight", cfg, files.get(module + ".weight", path.name))
        if name is not None:
            yield name, layer
        if bias is not None:
            bname = hf_param_name(module + ".bias", cfg, files[f"{module}.bias"])
            if bname is not None:
                yield bname, bias

"""GPTQ checkpoints (``quantization_config.quant_method: "gptq"``), repacked once at load into ``CTLinear``.

What a GPTQ Linear ``<m>`` stores (AutoGPTQ / optimum / GPTQModel, ``bits`` b in {4, 8}, p = 32 / b
values per int32 word, G = number of groups):

    <m>.qweight  int32 [in / p, out]   packed along the INPUT dim: word r of column o holds inputs
                                       r*p .. r*p+p-1, input r*p+i at bits b*i .. b*i+b-1 (unsigned)
    <m>.qzeros   int32 [G, out / p]    packed along the OUTPUT dim, same bit order: zero point of
                                       output c*p+i at bits b*i of word c
    <m>.scales   fp16  [G, out]
    <m>.g_idx    int32 [in]            group of each input channel (k // group_size unless desc_act)

    W[o, k] = (q[k, o] - z[g_idx[k], o]) * scales[g_idx[k], o]

Worked example (b = 4): qweight[0, o] = 0x76543210 holds q = 0, 1, ..., 7 for inputs 0..7 of
output o (input 0 in the lowest nibble). ``group_size`` -1 means one group (G = 1).

The zero point: GPTQ v1 (``checkpoint_format``/``format`` "gptq", AutoGPTQ's layout and the default)
stores z - 1, and every v1 runtime (AutoGPTQ's kernels, optimum, transformers) adds 1 back to each
unpacked value; "gptq_v2" (GPTQModel) stores z itself. GPTQModel converts v1 to v2 by adding
0x11111111 to each *word*, which differs from the per-value +1 only where a stored value is all ones
(z - 1 = -1 packed by AutoGPTQ, which also corrupts the values above it in that word): such a v1
checkpoint has no single meaning, so it is refused.

Mapping onto ``CTLinear`` (w = (c - zp) * scale with codes c = u - 2^(b-1), u the stored unsigned
value, packed along the input dim at the same bit positions): the CT words are ``qweight.T``
unchanged, zp = z - 2^(b-1) (int8), scale = scales.T. With ``desc_act`` (a ``g_idx`` that is not
k // group_size) the input channels are sorted by group once (a stable sort), codes repacked in that
order, and the layer is an ``ActOrderLinear`` that permutes the activation (CUDA) or un-permutes
the weight (CPU): the function is unchanged, only the order of the dot product's terms. A stored
``g_idx`` is authoritative whatever ``desc_act`` says (GPTQModel's group-aware reordering writes a
non-trivial one with desc_act false; its reference torch kernel reads scales[g_idx]). Anything
else (2/3 bits, marlin/bitblas layouts, per-module overrides, unknown keys or tensors) is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.act_order_linear import ActOrderLinear
from ..layers.quant_linear import CTLinear
from ..models.llama import LlamaConfig
from .checkpoint import check_plain_dtype, hf_param_name, open_files

GPTQ_FORMATS = ("gptq", "gptq_v2")
# keys that only describe how the checkpoint was calibrated or which kernel a runtime should pick
_GPTQ_HARMLESS = {"quant_method", "bits", "group_size", "desc_act", "sym", "format", "checkpoint_format",
                  "true_sequential", "damp_percent", "damp_auto_increment", "dataset", "tokenizer", "meta",
                  "backend", "use_exllama", "exllama_config", "max_input_length", "use_cuda_fp16", "model_seqlen",
                  "block_name_to_quantize", "module_name_preceding_first_block", "modules_in_block_to_quantize",
                  "batch_size", "pad_token_id", "cache_block_outputs", "static_groups", "act_group_aware",
                  "model_name_or_path", "model_file_base_name", "pack_dtype", "lm_head", "dynamic",
                  "is_marlin_format", "modules_to_not_convert", "mse", "hyb_act", "v2", "v2_alpha"}
SUPPORTED = ("logprobe runs GPTQ checkpoints with bits 4 or 8 (any group size, -1 included; sym or not; desc_act "
             "with g_idx), format 'gptq' (v1) or 'gptq_v2', int32 packing; for anything else score the "
             "unquantized model")


def _refuse(problem: str, fix: str = SUPPORTED):
    raise LogprobeError("quantization_config", problem, fix)


# -- packing (pure index functions) -------------------------------------------------------------------------


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [r, w] -> unsigned values [r, w * 32/bits] (int32): value i of word j is column
    j * (32/bits) + i, read from bits ``bits*i .. bits*i + bits-1``.
    Example (bits 4): [[0x76543210]] -> [[0, 1, 2, 3, 4, 5, 6, 7]]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)  # [per]
    u = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [r, w, per]; & drops the sign extension
    return u.reshape(words.shape[0], words.shape[1] * per)  # [r, w * per]


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``unpack_words``: unsigned values [r, c] (each < 2^bits; a partial last word is
    zero-padded) -> int32 words [r, ceil(c * bits / 32)]. Example (bits 8): [[1, 2, 3, 4]] -> [[0x04030201]]."""
    per = 32 // bits
    r, c = values.shape
    v = torch.nn.functional.pad(values.to(torch.int64), (0, -c % per))  # [r, ceil(c / per) * per]
    v = v.reshape(r, -(-c // per), per)  # [r, w, per]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)  # [per]
    w = (v << shifts).sum(-1)  # [r, w] in [0, 2^32): the values occupy disjoint bits
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # the same 32 bits, as int32


def group_order(g_idx: torch.Tensor, group_size: int, name: str = "g_idx") -> torch.Tensor | None:
    """Input channels sorted by group (a stable sort), or None when they already are (g_idx[k] =
    k // group_size). Refuses a g_idx whose sorted groups are not contiguous runs of ``group_size``
    (what GPTQ's act-order writes). Example: g_idx [1, 0, 1, 0], group 2 -> [1, 3, 0, 2]."""
    g = g_idx.long()
    k = g.numel()
    want = torch.arange(k) // group_size  # [in]
    if torch.equal(g, want):
        return None
    perm = torch.sort(g, stable=True).indices  # [in]
    if not torch.equal(g[perm], want):
        counts = torch.bincount(g.clamp(min=0)).tolist()
        _refuse(f"{name} assigns {counts[:6]}... channels to its groups, not groups of group_size {group_size}: "
                "logprobe runs act-order g_idx whose groups hold group_size channels each")
    return perm


# -- config ------------------------------------------------------------------------------------------------


def gptq_settings(qcfg: dict) -> tuple[int, int, bool, bool]:
    """(bits, group_size, desc_act, v1) of a GPTQ quantization_config, or a LogprobeError naming the field."""
    unknown = sorted(set(qcfg) - _GPTQ_HARMLESS)
    if unknown:
        _refuse(f"GPTQ keys {unknown} are not known to logprobe, which cannot tell whether they change the model")
    bits = qcfg.get("bits")
    if bits not in (4, 8):
        _refuse(f"GPTQ bits {bits!r}: logprobe reads 4- and 8-bit GPTQ weights (2- and 3-bit packings cross "
                "word boundaries and are not run)")
    group = qcfg.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or (group < 1 and group != -1):
        _refuse(f"GPTQ group_size {group!r} is neither -1 nor a positive integer")
    fmt = qcfg.get("checkpoint_format", qcfg.get("format")) or "gptq"
    if str(fmt).lower() not in GPTQ_FORMATS:
        _refuse(f"GPTQ checkpoint_format {fmt!r} is not a layout logprobe reads ({', '.join(GPTQ_FORMATS)})")
    for key in ("desc_act", "sym"):
        if not isinstance(qcfg.get(key, False), bool):
            _refuse(f"GPTQ {key} must be true or false, got {qcfg[key]!r}")
    if qcfg.get("is_marlin_format"):
        _refuse("GPTQ is_marlin_format true: the Marlin-repacked layout is not read")
    if qcfg.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        _refuse(f"GPTQ pack_dtype {qcfg['pack_dtype']!r}: logprobe reads int32 packing")
    if qcfg.get("dynamic"):
        _refuse(f"GPTQ dynamic {qcfg['dynamic']!r}: per-module overrides of bits / group size are not run")
    return bits, group, bool(qcfg.get("desc_act", False)), str(fmt).lower() == "gptq"


# -- one module --------------------------------------------------------------------------------------------


def _check_int32(module: str, t: dict[str, torch.Tensor], leaves: tuple[str, ...]) -> None:
    for leaf in leaves:
        if leaf in t and t[leaf].dtype != torch.int32:
            _refuse(f"{module}.{leaf} is {str(t[leaf].dtype).removeprefix('torch.')}, not the int32 words the "
                    "layout defines")


def _check_scales(module: str, scales: torch.Tensor, shape: tuple[int, int]) -> None:
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32) or tuple(scales.shape) != shape:
        _refuse(f"{module}.scales ({str(scales.dtype).removeprefix('torch.')}, {tuple(scales.shape)}) is not a "
                f"float [groups, out] = {list(shape)} tensor")


def gptq_layer(module: str, t: dict[str, torch.Tensor], bits: int, group_size: int, desc_act: bool, v1: bool):
    """One GPTQ module's tensors (bias excluded) -> a ``CTLinear`` (or ``ActOrderLinear`` for act-order)."""
    layout, optional = {"qweight", "qzeros", "scales"}, {"g_idx"}
    extra, missing = sorted(set(t) - layout - optional), sorted(layout - set(t))
    if extra:
        _refuse(f"{module} stores {', '.join(module + '.' + x for x in extra)}, which the GPTQ layout logprobe reads "
                "(qweight, qzeros, scales, g_idx) does not have: it would be ignored")
    if missing:
        _refuse(f"{module} lacks {', '.join(module + '.' + x for x in missing)} (GPTQ layout)")
    if desc_act and "g_idx" not in t:
        _refuse(f"{module}: desc_act is true but {module}.g_idx is missing, so the group of each input channel "
                "is unknown")
    _check_int32(module, t, ("qweight", "qzeros"))
    per, offset = 32 // bits, 1 << (bits - 1)
    qweight = t["qweight"]  # [in / per, out]
    cols, out = qweight.shape[0] * per, qweight.shape[1]
    group = cols if group_size == -1 else group_size
    G = -(-cols // group)
    _check_scales(module, t["scales"], (G, out))
    if tuple(t["qzeros"].shape) != (G, -(-out // per)):
        _refuse(f"{module}.qzeros {tuple(t['qzeros'].shape)} is not [groups, out / {per}] = [{G}, {-(-out // per)}]")
    z = unpack_words(t["qzeros"], bits)[:, :out]  # [G, out] stored zero points
    if v1:
        if bool((z == (1 << bits) - 1).any()):
            _refuse(f"{module}.qzeros holds the value {(1 << bits) - 1} in a GPTQ v1 checkpoint (a zero point of 0 "
                    "stored as -1, which v1 packing spreads into the neighbouring values): runtimes disagree on it",
                    "re-export the model with format 'gptq_v2'")
        z = z + 1  # v1 stores z - 1
    zp = (z - offset).T.to(torch.int8).contiguous()  # [out, G]
    scale = t["scales"].T.contiguous()  # [out, G]
    perm = None
    if "g_idx" in t:
        g_idx = t["g_idx"]
        if g_idx.is_floating_point() or tuple(g_idx.shape) != (cols,):
            _refuse(f"{module}.g_idx ({str(g_idx.dtype).removeprefix('torch.')}, {tuple(g_idx.shape)}) is not one "
                    f"integer group per input channel ({cols})")
        if bool((g_idx < 0).any()) or bool((g_idx >= G).any()):
            _refuse(f"{module}.g_idx names groups outside 0..{G - 1}")
        perm = group_order(g_idx, group, f"{module}.g_idx")
    words = qweight.T.contiguous()  # [out, in / per]: CT's layout, the same bits
    if perm is None:
        return CTLinear(words, scale, zp, bits, group, cols)
    u = unpack_words(words, bits)[:, perm]  # [out, in], channels sorted by group
    return ActOrderLinear(pack_words(u, bits), scale, zp, bits, group, cols, perm)


# -- the checkpoint ----------------------------------------------------------------------------------------


def read_modules(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Every safetensors tensor grouped by module: module -> {leaf: tensor}, and key -> file name."""


    modules: dict[str, dict[str, torch.Tensor]] = {}
    files: dict[str, str] = {}
    for f, st in open_files(path):
        for key in st.keys():
            module, _, leaf = key.rpartition(".")
            modules.setdefault(module, {})[leaf] = st.get_tensor(key)
            files[key] = f.name
    return modules, files


def packed_tensors(path: Path, cfg: LlamaConfig, packed: bool, make_layer, method: str):
    """Yield (parameter name, tensor or packed layer): modules holding ``qweight`` become
    ``make_layer(module, tensors)``; every other tensor must be a plain float."""
    modules, files = read_modules(path)
    found = False
    for module, t in modules.items():
        if "qweight" not in t:
            for leaf, value in t.items():
                key = f"{module}.{leaf}" if module else leaf
                if leaf in ("qzeros", "scales", "g_idx"):
                    _refuse(f"{key} is stored without {module}.qweight ({method} layout)")
                name = hf_param_name(key, cfg, files[key])
                if name is not None:
                    check_plain_dtype(key, value, files[key])
                    yield name, value
            continue
        found = True
        bias = t.get("bias")
        layer = make_layer(module, {k: v for k, v in t.items() if k != "bias"})
        name = hf_param_name(module + ".weight", cfg, files[f"{module}.qweight"])
        if name is not None:
            yield name, layer if packed else layer.dense()
        if bias is not None:
            check_plain_dtype(f"{module}.bias", bias, files[f"{module}.bias"])
            bname = hf_param_name(module + ".bias", cfg, files[f"{module}.bias"])
            if bname is not None:
                yield bname, bias
    if not found:
        _refuse(f"quant_method {method!r} but {path.name} holds no <module>.qweight tensor: the checkpoint is not "
                f"in the {method} layout")


def gptq_tensors(path: Path, cfg: LlamaConfig, qcfg: dict, packed: bool):
    """Yield (parameter name, tensor or CTLinear) for a GPTQ checkpoint."""
    bits, group, desc_act, v1 = gptq_settings(qcfg)
    yield from packed_tensors(path, cfg, packed, lambda m, t: gptq_layer(m, t, bits, group, desc_act, v1), "gptq")

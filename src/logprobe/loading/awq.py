"""AWQ checkpoints (``quantization_config.quant_method: "awq"``, AutoAWQ's GEMM layout), repacked once
at load into ``CTLinear``.

What an AWQ GEMM Linear ``<m>`` stores (4 bits, 8 values per int32 word, G = in / group_size):

    <m>.qweight  int32 [in, out / 8]   packed along the OUTPUT dim, interleaved: nibble i (bits
                                       4i .. 4i+3) of word c holds output c*8 + AWQ_ORDER[i]
    <m>.qzeros   int32 [G, out / 8]    the same packing, unsigned zero points
    <m>.scales   fp16  [G, out]

    AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    W[o, k] = (q[k, o] - z[k // group_size, o]) * scales[k // group_size, o]   (no +1, unlike GPTQ v1)

Worked example: outputs 0..7 holding q = 0, 1, ..., 7 pack to 0x75316420 (nibble 1 holds output 2,
nibble 4 holds output 1). Unpacked nibbles in word order are outputs AWQ_ORDER; output o sits at
nibble AWQ_REVERSE[o % 8], AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7).

Repack: unpack, put outputs in order, transpose to [out, in] and pack along the input dim as
``CTLinear`` reads it (codes u - 8, zero points z - 8, scales.T). Only ``version``/``format`` "gemm"
with zero points is read; GEMV / GEMV_FAST / llm-awq / exllama / marlin layouts are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.quant_linear import CTLinear
from ..models.llama import LlamaConfig
from .gptq import _check_int32, _check_scales, pack_words, packed_tensors, unpack_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8c + AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + j sits at nibble AWQ_REVERSE[j]
_AWQ_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "format", "backend",
             "modules_to_not_convert", "do_fuse", "fuse_max_seq_len", "exllama_config", "modules_to_fuse"}
SUPPORTED = ("logprobe runs AWQ checkpoints in the GEMM layout (version 'gemm'), 4-bit with zero points; for "
             "anything else score the unquantized model")


def _refuse(problem: str, fix: str = SUPPORTED):
    raise LogprobeError("quantization_config", problem, fix)


def awq_output_order(out: int) -> torch.Tensor:
    """Index into a row of unpacked nibbles (word order) that yields outputs 0..out-1 in order.
    Example: out 8 -> [0, 4, 1, 5, 2, 6, 3, 7]; out 16 -> the same, then 8 + each."""
    reverse = torch.tensor(AWQ_REVERSE)
    return (torch.arange(out // 8)[:, None] * 8 + reverse).reshape(out)  # [out]


def unpack_awq(words: torch.Tensor, out: int) -> torch.Tensor:
    """AWQ words [r, out / 8] -> unsigned 4-bit values [r, out] with outputs in order."""
    return unpack_words(words, 4)[:, awq_output_order(out)]  # [r, out]


def awq_settings(qcfg: dict) -> int:
    """The group size of an AWQ quantization_config logprobe runs, or a LogprobeError naming the field."""
    unknown = sorted(set(qcfg) - _AWQ_KEYS)
    if unknown:
        _refuse(f"AWQ keys {unknown} are not known to logprobe, which cannot tell whether they change the model")
    if qcfg.get("bits", 4) != 4:
        _refuse(f"AWQ bits {qcfg.get('bits')!r}: logprobe reads 4-bit AWQ weights")
    version = str(qcfg.get("version", qcfg.get("format")) or "gemm").lower()
    if version != "gemm":
        _refuse(f"AWQ version {version!r}: only the GEMM layout is read (GEMV, GEMV_FAST, llm-awq, exllama and "
                "marlin pack their words differently)")
    if qcfg.get("zero_point", True) is not True:
        _refuse(f"AWQ zero_point {qcfg.get('zero_point')!r}: logprobe reads AWQ weights with zero points")
    group = qcfg.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        _refuse(f"AWQ group_size {group!r} is not a positive integer")
    return group


def awq_layer(module: str, t: dict[str, torch.Tensor], group: int):
    """One AWQ GEMM module's tensors (bias excluded) -> a ``CTLinear``."""
    layout = {"qweight", "qzeros", "scales"}
    extra, missing = sorted(set(t) - layout), sorted(layout - set(t))
    if extra:
        _refuse(f"{module} stores {', '.join(module + '.' + x for x in extra)}, which the AWQ GEMM layout logprobe "
                "reads (qweight, qzeros, scales) does not have: it would be ignored")
    if missing:
        _refuse(f"{module} lacks {', '.join(module + '.' + x for x in missing)} (AWQ GEMM layout)")
    _check_int32(module, t, ("qweight", "qzeros"))
    qweight = t["qweight"]  # [in, out / 8]
    cols, out = qweight.shape[0], qweight.shape[1] * 8
    if cols % group:
        _refuse(f"{module}: AWQ group_size {group} does not divide the input width {cols}")
    G = cols // group
    _check_scales(module, t["scales"], (G, out))
    if tuple(t["qzeros"].shape) != (G, out // 8):
        _refuse(f"{module}.qzeros {tuple(t['qzeros'].shape)} is not [groups, out / 8] = [{G}, {out // 8}]")
    u = unpack_awq(qweight, out).T  # [out, in]
    zp = (unpack_awq(t["qzeros"], out) - 8).T.to(torch.int8).contiguous()  # [out, G]
    return CTLinear(pack_words(u, 4), t["scales"].T.contiguous(), zp, 4, group, cols)


def awq_tensors(path: Path, cfg: LlamaConfig, qcfg: dict, packed: bool):
    """Yield (parameter name, tensor or CTLinear) for an AWQ GEMM checkpoint."""
    group = awq_settings(qcfg)
    yield from packed_tensors(path, cfg, packed, lambda m, t: awq_layer(m, t, group), "awq")

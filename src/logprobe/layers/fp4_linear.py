"""NVFP4 linear layers (compressed-tensors ``nvfp4-pack-quantized``): FP4 e2m1 weights in groups of 16
with FP8 e4m3 group scales and one float32 global scale; NVFP4 also quantizes activations to FP4.

This is the CPU reference (emulation) path: weights and activations are dequantized to float32 and
multiplied in float32 (an input in another dtype is widened first, the result cast back), computing
the function compressed-tensors defines (``dequantize`` and ``forward_quantize`` / ``fake_quantize``
for the ``tensor_group`` strategy), op for op:

* weight: w[o, k] = fp4(code[o, k]) * (weight_scale[o, k // 16] / weight_global_scale), the FP8
  scale widened to float32 and divided by the global scale in float32 (``_dequantize``).
* activation (NVFP4, ``dynamic: "local"``), per token and group of 16 columns, in float32:
  amax = max(|min(x, 0)|, max(x, 0)); s = fp8_e4m3(input_global_scale * (amax / 6)) (clamped to
  +-448, round to nearest even; 0 becomes 0.125, the e4m3 eps); s' = s / input_global_scale;
  x_q = fp4(clamp(x / s', -6, 6)) * s'.
* fp4 rounding (compressed-tensors' ``cast_to_fp4``), of |v| to 0, 0.5, 1, 1.5, 2, 3, 4, 6: ties go
  to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.

Packing: byte j of a row holds columns 2j (low nibble) and 2j + 1 (high nibble); a nibble is
sign (bit 3) and the index (bits 0-2) of |v| in E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
Example: byte 0xA3 -> columns (1.5, -1.0) (low 0x3 = +1.5, high 0xA = sign + index 2).

Quantization is per token, so deterministic mode's batch invariance holds (the product is the
row-tiled one of ``linear``). No FP4 tensor-core GEMM here: on CUDA the same float32 emulation runs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import LogprobeError
from .linear import Linear, float32_product
from .quant_linear import _PackedLinearMixin

FP8 = torch.float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # |value| of nibble index 0..7
GROUP = 16  # NVFP4's group of columns per FP8 scale
_FP4_MAX = 6.0
_FP8_EPS = 0.125  # compressed-tensors' eps for an e4m3 scale: what a zero scale becomes


def e2m1_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``E2M1`` [8] made on ``device`` from the format's bits (index = exponent << 1 | mantissa:
    0.5 * m below exponent 1, else 2^(e - 1) * (1 + m / 2); exact in every float dtype): no host
    copy, which a CUDA graph would replay from freed pinned memory (``engine.graphs``).

    >>> e2m1_table(torch.float32, torch.device("cpu")).tolist() == list(E2M1)
    True
    """
    i = torch.arange(8, device=device, dtype=torch.float32)
    e, m = torch.div(i, 2, rounding_mode="floor"), torch.remainder(i, 2)
    return torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m)).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [r, c / 2] -> float32 [r, c]: low nibble = even column, high nibble = odd column."""
    table = e2m1_table(torch.float32, packed.device)
    nib = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)  # [r, c]
    mag = table[(nib & 0x07).long()]
    return torch.where((nib & 0x08).bool(), -mag, mag)


def round_to_fp4(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of each element (|v| <= 6 expected), ties to the even mantissa as
    compressed-tensors' ``cast_to_fp4``: boundaries 0.25] (0.75 [1.25] (1.75 [2.5] (3.5 [5] where
    ``]`` keeps the tie below and ``[`` sends it up. Same dtype as ``v``."""
    a = v.abs()
    idx = ((a > 0.25).to(torch.int64) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))  # [...] index into E2M1
    table = e2m1_table(v.dtype, v.device)
    return torch.sign(v) * table[idx]


def nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic local scales of float32 activations [T, in]: the FP8-rounded ``global * amax / 6`` of
    each token and group of 16 columns, as float32 [T, in / 16] (``calculate_qparams``)."""
    T, k = x.shape
    xv = x.view(T, k // GROUP, GROUP)  # [T, G, 16]
    lo = torch.clamp(xv.amin(-1), max=0.0)
    hi = torch.clamp(xv.amax(-1), min=0.0)
    s = torch.maximum(lo.abs(), hi) / torch.full_like(hi, (2 * _FP4_MAX) / 2)  # [T, G]; tensor divisor: see act_quant
    s = global_scale * s
    fp8 = torch.finfo(FP8)
    s = torch.clamp(s, fp8.min, fp8.max).to(FP8).to(x.dtype)
    return torch.where(s == 0, torch.tensor(_FP8_EPS, dtype=s.dtype), s)


def quantize_fp4_groups(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantize float32 activations [T, in] to NVFP4 (``forward_quantize`` of the
    ``tensor_group`` strategy with a dynamic local scale): float32 [T, in]."""
    T, k = x.shape
    s = nvfp4_group_scales(x, global_scale)[..., None] / global_scale  # [T, G, 1]
    xv = x.view(T, k // GROUP, GROUP)  # [T, G, 16]
    q = round_to_fp4(torch.clamp(xv / s, -_FP4_MAX, _FP4_MAX))
    return (q * s).view(T, k)


class FP4Linear(_PackedLinearMixin, Linear):
    """An NVFP4 weight, ``y = X @ W^T (+ bias)`` in float32, with X = the NVFP4 fake-quantized input
    when ``input_global_scale`` is set (NVFP4), the input itself otherwise (NVFP4A16, whose product
    then runs in the model dtype like every weight-only layer).

    Buffers: ``weight_packed`` uint8 [out, in / 2], ``weight_scale`` float8_e4m3fn [out, in / 16],
    ``weight_global_scale`` float32 [1], ``input_global_scale`` float32 [1] or None, ``expanded``
    (``weights="dense"`` for NVFP4: the float32 weight, made once) or None."""

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                 input_global_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
            raise LogprobeError("weight_packed", f"{weight_packed.dtype} {tuple(weight_packed.shape)} is not a 2-D "
                                "uint8 tensor of FP4 pairs")
        self.out_features, self.in_features = int(weight_packed.shape[0]), 2 * int(weight_packed.shape[1])
        if self.in_features % GROUP or tuple(weight_scale.shape) != (self.out_features, self.in_features // GROUP):
            raise LogprobeError("weight_scale", f"shape {tuple(weight_scale.shape)} is not one scale per 16 "
                                f"columns of a [{self.out_features}, {self.in_features}] weight")
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_global_scale", weight_global_scale.reshape(1).float())
        self.register_buffer("input_global_scale",
                             None if input_global_scale is None else input_global_scale.reshape(1).float())
        self.register_buffer("bias", bias)
        self.register_buffer("expanded", None)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        """Dequantized weight rows, float32 [n, in]: fp4 * (fp8 scale / global scale)."""
        if self.expanded is not None:
            return self.expanded[idx]
        q = unpack_fp4(self.weight_packed[idx])  # [n, in]
        n, k = q.shape
        s = self.weight_scale[idx].float() / self.weight_global_scale  # [n, G]
        return (q.view(n, k // GROUP, GROUP) * s[..., None]).view(n, k)

    def expand(self) -> FP4Linear:
        """Keep the dequantized float32 weight (NVFP4 under ``weights="dense"``); activations stay quantized."""
        self.expanded = self.rows()
        return self

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> the NVFP4 fake-quantized activation, float32 [T, in]."""
        return quantize_fp4_groups(x.float().contiguous(), self.input_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_global_scale is None:  # NVFP4A16: a weight-only layer
            return super().forward(x)
        shape = x.shape
        xq = self.quantize_input(x.reshape(-1, shape[-1]))  # [T, in] float32: quantized per row
        y = float32_product(self, xq, self.rows()).to(x.dtype)  # rows(): [out, in] float32
        return y.view(*shape[:-1], self.out_features)

    def permute_rows(self, perm: torch.Tensor) -> None:
        for name in ("weight_packed", "weight_scale", "bias", "expanded"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[perm].contiguous())

    def extra_repr(self) -> str:
        act = "activations NVFP4 (dynamic per-token groups of 16)" if self.input_global_scale is not None \
            else "activations unquantized (NVFP4A16)"
        return f"weights NVFP4 (e2m1, e4m3 scales per 16), {act}, in={self.in_features}, out={self.out_features}"

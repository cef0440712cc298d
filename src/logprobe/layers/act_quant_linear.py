"""Linear layers whose input activations are quantized: FP8 (e4m3) and INT8 W8A8 checkpoints.

A checkpoint that quantizes activations (compressed-tensors ``float-quantized`` FP8_DYNAMIC / FP8 /
FP8_BLOCK, ``int-quantized`` W8A8) defines its model as: quantize each Linear's input, then
multiply it with the quantized weight. The activation rounding is part of the function, so
``ActQuantLinear`` runs it, by the format's own rules (those of compressed-tensors'
``forward_quantize`` / ``fake_quantize``, which llm-compressor calibrates with):

* scale: static (the stored ``input_scale``, one per tensor) or dynamic, per token or per token
  and group of ``group`` columns: ``absmax / (range / 2)`` with ``absmax = max(|min(x, 0)|,
  max(x, 0))`` and range = qmax - qmin, i.e. 448 for float8 e4m3 and 127.5 for int8 (the int8 code
  -128 is reachable, +128 is not); a zero scale becomes the float32 epsilon. (vLLM's int8 kernels
  divide by 127 instead: its W8A8 numbers differ from the format's by that rounding.)
* codes: ``clamp(x / scale, qmin, qmax)`` then round half to even (int8) or a cast to float8 e4m3
  (round to nearest even); the value used is ``code * scale``.
* weight: ``code * scale`` with per-tensor, per-channel or 128x128 block scales.

Everything is computed in float32 (an input in another dtype is widened first, the result is
cast back): the dequantized activation times the dequantized weight, one float32 product. That
is the exact reference path, on CPU (and on CUDA with ``ActQuantLinear.kernels = False``, a class
switch). CUDA inputs go through ``kernels.act_quant`` by default: a fused quantizer that gives the
reference's codes bit for bit, and a tensor-core GEMM of the codes with float32 accumulation
(``kernels.act_quant.product_path``): INT8 exact int32 tile sums; FP8 in a float32 model codes
widened exactly to fp16 (within 2.5e-6 of the float64 product at llama-8b shapes), in a bf16 /
fp16 model the FP8 tensor cores (``torch._scaled_mm`` row-wise, or the kernel's FP8 MMA), whose
truncated partial sums (2e-4 relative) stay under a tenth of the output's own rounding.
Quantization is row-wise (per token), so deterministic mode's batch invariance holds on every
path: a row's codes and scale depend on that row only, and the product is the row-tiled one of
``linear`` or the kernel's fixed tiles (deterministic mode never takes ``torch._scaled_mm``).

Two fusions remove passes over the activations and change no bit (llama-8b FP8_DYNAMIC: q, k, v
quantized the same [T, 4096] input three times, and SiLU(gate) * up went to memory as bf16 [T,
14336] only to be read back by down_proj's quantizer):

* ``fuse_parts``: layers that quantize one input alike (q/k/v, gate/up; same kind, group and
  static scale or none) become one layer whose rows are theirs: one quantization, one GEMM. Parts
  with different static input scales stay apart: their codes differ (e.g. x = 1.0 is code 256
  under scale 1/256 and 128 under 1/128), and one code per element is what fusion shares.
* ``gated(gate, up)`` = ``self(silu_mul(gate, up))``: with dynamic per-token activations on CUDA,
  ``kernels.act_quant.silu_mul_quantize`` computes SiLU(gate) * up, rounds it to the activation
  dtype (the unfused model quantizes that stored tensor) and quantizes it in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.act_quant import FP8, KINDS, act_quant_linear, gated_act_quant_linear, quantize_rows_reference
from .linear import Linear, float32_product
from .quant_linear import _PackedLinearMixin


def quantize_rows(x: torch.Tensor, kind: str, scale: torch.Tensor | None = None, group: int | None = None,
                  ) -> torch.Tensor:
    """Fake-quantize float32 activations [T, in] to 8-bit ``kind`` ("float": e4m3, "int": int8)
    codes times their scale, returned as float32 [T, in].

    ``scale`` given: static (a one-element tensor). Else dynamic: one scale per row, or per row and
    group of ``group`` consecutive columns (``kernels.act_quant.quantize_rows_reference``)."""
    codes, s = quantize_rows_reference(x, kind, group, scale)  # [T, K], [T, G]
    T, K = x.shape
    G = s.shape[1]
    return (codes.float().view(T, G, K // G) * s.view(T, G, 1)).view(T, K)  # each code times its scale


class ActQuantLinear(_PackedLinearMixin, Linear):
    """``y = Q(x) @ W^T (+ bias)`` with ``Q`` the activation quantization above and ``W`` the
    dequantized 8-bit weight, all in float32.

    Buffers: ``qweight`` [out, in] (float8_e4m3fn or int8 codes), ``scale`` [out, G] (the weight
    scale of each row and column block of ``block_cols`` columns; per-tensor and per-channel scales
    are G = 1, 128x128 blocks are expanded to one row of scales per weight row, so rows can be
    permuted), ``input_scale`` (static activations: one element) or None.
    ``act_kind``: "float" (e4m3) or "int" (int8); ``act_group``: columns per dynamic scale (None:
    one per token)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block_cols: int, act_kind: str,
                 input_scale: torch.Tensor | None = None, act_group: int | None = None,
                 bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if act_kind not in KINDS:
            raise LogprobeError("quantization_config", f"activation type {act_kind!r} is not run",
                                "logprobe runs float8 (e4m3) and int8 activations")
        if qweight.dtype not in (FP8, torch.int8) or qweight.ndim != 2:
            raise LogprobeError("weight", f"{qweight.dtype} {tuple(qweight.shape)} is not a 2-D float8_e4m3fn or "
                                "int8 weight")
        self.out_features, self.in_features = (int(n) for n in qweight.shape)
        self.block_cols, self.act_kind, self.act_group = int(block_cols), act_kind, act_group
        groups = -(-self.in_features // self.block_cols)
        if tuple(scale.shape) != (self.out_features, groups):
            raise LogprobeError("weight_scale", f"shape {tuple(scale.shape)} does not match "
                                f"[{self.out_features}, {groups}] (in {self.in_features}, blocks of {block_cols})")
        if act_group is not None and (act_group < 1 or self.in_features % act_group):
            raise LogprobeError("input_activations", f"group_size {act_group} does not divide the input width "
                                f"{self.in_features}")
        if input_scale is not None and (input_scale.numel() != 1 or not input_scale.is_floating_point()):
            raise LogprobeError("input_scale", f"{tuple(input_scale.shape)} {input_scale.dtype}: a static "
                                "per-tensor scale is one float")
        self.register_buffer("qweight", qweight)
        # float32 whatever the checkpoint's (bf16 for a bf16 model): the widening is exact, and
        # cuBLAS's FP8 GEMM refuses 16-bit scales
        self.register_buffer("scale", scale.float())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.register_buffer("bias", bias)
        self.register_buffer("expanded", None)  # weights="dense": the float32 weight, made once

    def rows(self, idx=slice(None)) -> torch.Tensor:
        """Dequantized weight rows, float32 [n, in]: code * scale (an exact float32 product)."""
        if self.expanded is not None:
            return self.expanded[idx]
        q = self.qweight[idx].float()  # [n, in]; e4m3 and int8 values are exact in float32
        n, k = q.shape
        scale = self.scale[idx].float()  # [n, G]
        G, b = scale.shape[1], self.block_cols
        q = F.pad(q, (0, G * b - k)).view(n, G, b)  # a last partial block
        return (q * scale[..., None]).view(n, G * b)[:, :k]

    def expand(self) -> ActQuantLinear:
        """Keep the dequantized float32 weight (``weights="dense"``): faster, 4x the memory of the
        8-bit codes, the same numbers. The activations are still quantized: that is the model."""
        if self.shares_buffers:
            raise LogprobeError("weights", "this layer shares its buffers with a fused layer (fuse_parts): "
                                "expanding one of them alone would split the two", "expand before fusing")
        self.expanded = self.rows()
        return self

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> the dequantized quantized activation, float32 [T, in]."""
        return quantize_rows(x.float().contiguous(), self.act_kind, self.input_scale, self.act_group)

    kernels = True  # CUDA inputs through kernels.act_quant (see the module's docstring)

    def use_kernels(self, x: torch.Tensor) -> bool:
        """The kernels run a whole product (quantized checkpoints are not split by tensor
        parallelism), not on the dense expansion, and only with K tiles that fit the scale blocks."""
        if not (self.kernels and x.is_cuda and self.expanded is None):
            return False

        k = self.in_features
        return triton_available() and all(g >= k or g % 128 == 0 for g in (self.block_cols, self.act_group or k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [..., in] -> [T, in]: quantization is per row
        if self.use_kernels(x2):
            y = act_quant_linear(x2, self.act_kind, self.act_group, self.input_scale, self.qweight, self.scale,
                                 self.block_cols, self.bias, deterministic=self.numerics.deterministic)
        else:
            xq = self.quantize_input(x2)  # [T, in] float32
            y = float32_product(self, xq, self.rows()).to(x.dtype)  # rows(): [out, in] float32
        return y.view(*shape[:-1], self.out_features)

    def gated(self, gate: torch.Tensor, up: torch.Tensor, triton: bool = False) -> torch.Tensor:
        """``self(silu_mul(gate, up, triton))``, bit for bit. With dynamic per-token activations on
        the kernels' path (and ``triton``), one pass computes SiLU(gate) * up and its codes
        (``kernels.act_quant.silu_mul_quantize``), then the same GEMM as ``forward``."""
        if not self._gates_in_one_pass(gate, up, triton):
            return super().gated(gate, up, triton)

        return gated_act_quant_linear(gate, up, self.act_kind, self.qweight, self.scale, self.block_cols, self.bias,
                                      deterministic=self.numerics.deterministic)

    def _gates_in_one_pass(self, gate: torch.Tensor, up: torch.Tensor, triton: bool) -> bool:
        """Where the unfused path is the two Triton passes (``activation.silu_mul``'s Triton case,
        then ``forward``'s kernels) and the scheme is dynamic per token."""
        return (triton and self.input_scale is None and self.act_group is None and self.use_kernels(gate)
                and gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype and gate.shape[0] > 0
                and gate.shape[1] == self.in_features and gate.stride(1) == 1 and up.stride(1) == 1)

    shares_buffers = False  # set by fuse_parts on the fused layer and its parts (views of one storage)
    fused_part = False  # set by fuse_parts on the parts: their bytes are the fused layer's

    def packed_bytes(self) -> int:
        """Bytes of weight storage; 0 for a part of a fused layer (``weight_bytes`` counts it there)."""
        return 0 if self.fused_part else super().packed_bytes()

    @classmethod
    def fuse_parts(cls, parts: list[ActQuantLinear]) -> ActQuantLinear | None:
        """One layer computing ``parts`` side by side (``layers.linear.fuse_linears``' hook), or None
        unless it is exact: every part must quantize its input alike (one kind, group, static scale
        or none), on one device and layout. Then the input is quantized once
        and multiplied once: q/k/v, gate/up. The parts' buffers become row views of the fused ones
        (no memory duplicated, their names still in ``state_dict``; ``permute_rows`` works in place)."""
        first = parts[0]
        if any(_fusion_key(p) != _fusion_key(first) or not _same_static(p, first) for p in parts):
            return None
        names = [n for n in ("qweight", "scale", "bias", "expanded") if getattr(first, n) is not None]
        cat = {n: torch.cat([getattr(p, n) for p in parts]) for n in names}  # [sum out, ...]
        fused = cls(cat["qweight"], cat["scale"], first.block_cols, first.act_kind, first.input_scale,
                    first.act_group, cat.get("bias"))
        fused.numerics = first.numerics
        fused.expanded = cat.get("expanded")
        fused.compute_dtype = first.compute_dtype
        if all(p.col_blocks for p in parts):  # deterministic mode's column blocks, as the dense fusion
            fused.col_blocks = [w for p in parts for w in p.col_blocks]
        if "kernels" in first.__dict__:  # an instance switch; else the class's stays in force
            fused.kernels = first.kernels
        offset = 0
        for p in parts:
            for n in names:
                setattr(p, n, cat[n][offset:offset + p.out_features])
            p.shares_buffers = p.fused_part = True
            offset += p.out_features
        fused.shares_buffers = True
        return fused

    def permute_rows(self, perm: torch.Tensor) -> None:
        """Reorder the output rows (q/k to the interleaved RoPE layout, at load). Buffers shared with
        a fused layer are permuted in place, so the fused layer sees it (within this part's rows)."""
        for name in ("qweight", "scale", "bias", "expanded"):
            t = getattr(self, name)
            if t is not None and self.shares_buffers:
                t.copy_(t[perm])
            elif t is not None:
                setattr(self, name, t[perm].contiguous())

    def extra_repr(self) -> str:
        w = "float8_e4m3" if self.qweight.dtype == FP8 else "int8"
        a = "e4m3" if self.act_kind == "float" else "int8"
        act = "static per-tensor" if self.input_scale is not None else \
            f"dynamic per-token group {self.act_group}" if self.act_group else "dynamic per-token"
        return (f"weights {w} (column blocks of {self.block_cols}), activations {a} {act}, "
                f"in={self.in_features}, out={self.out_features}")


def _fusion_key(p: ActQuantLinear) -> tuple:
    """What must be equal for ``fuse_parts``: the activation quantization, the weight layout and
    dtypes, the device, bias and dense expansion present or not, the numerics."""
    def dtype(t):
        return None if t is None else t.dtype

    return (type(p), p.in_features, p.act_kind, p.act_group, p.block_cols, p.qweight.dtype, p.scale.dtype,
            p.qweight.device, dtype(p.bias), dtype(p.expanded), dtype(p.input_scale), p.numerics, p.kernels,
            p.compute_dtype)


def _same_static(p: ActQuantLinear, first: ActQuantLinear) -> bool:
    """Both dynamic, or both static with the same input scale (different ones quantize differently)."""
    if p.input_scale is None or first.input_scale is None:
        return p.input_scale is None and first.input_scale is None
    return torch.equal(p.input_scale, first.input_scale)

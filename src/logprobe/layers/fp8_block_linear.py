"""FP8 block-quantized weights with float activations (DeepSeek / Kimi / Qwen3-FP8 checkpoints, weight-only).

A block-quantized FP8 matrix stores e4m3 codes ``q`` [out, in] and one float32 scale per block of
``bh`` x ``bw`` weights (``weight_scale_inv`` [ceil(out/bh), ceil(in/bw)]; the last blocks of a
width that is not a multiple are partial). The weight it stands for is

    w[o, i] = float32(q[o, i]) * scale[o // bh, i // bw]       (one float32 product, rounded once)

which is what DeepSeek's ``fp8_cast_bf16.py`` computes before storing bf16. ``FP8BlockLinear``
keeps the codes (1 byte a weight) and a row of scales per weight row (row ``o`` reads block row
``o // bh``: rows can then be permuted, at 1/32 of the codes' bytes for 128-wide blocks), and
multiplies a float activation by that weight expanded to the model dtype inside ``forward``, one
layer at a time (``layers.quant_linear``'s packed path): bitwise what a model loaded from the
dequantized weights computes. ``FP8BlockExperts`` is the same for stacked expert matrices.

Worked example (blocks of 2x2): q = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] with scales [[0.5, 2], [1, 4]]
stands for [[0.5, 1, 6], [2, 2.5, 12], [7, 8, 36]].

>>> import torch
>>> q = torch.tensor([[1., 2, 3], [4, 5, 6], [7, 8, 9]]).to(torch.float8_e4m3fn)
>>> FP8BlockLinear.from_blocks(q, torch.tensor([[0.5, 2.], [1., 4.]]), 2, 2).rows().tolist()
[[0.5, 1.0, 6.0], [2.0, 2.5, 12.0], [7.0, 8.0, 36.0]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from .linear import Linear
from .moe import ExpertMatrices
from .quant_linear import _PackedLinearMixin

FP8 = torch.float8_e4m3fn


def block_rows(scale: torch.Tensor, block_rows_: int, rows: int) -> torch.Tensor:
    """Block scales [ceil(rows/bh), G] -> one row of scales per weight row [rows, G] (float32)."""
    return scale.float().repeat_interleave(block_rows_, dim=0)[:rows].contiguous()


def expand_codes(q: torch.Tensor, scale: torch.Tensor, block_cols: int, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """codes [n, in] (e4m3) times per-row block scales [n, G] -> [n, in] in ``dtype``: each code
    times the scale of its column block, one float32 product (e4m3 values are exact in float32),
    rounded once to ``dtype`` as it is stored (bitwise ``expand_codes(q, scale, bc).to(dtype)``,
    without the float32 product in memory: every call of an FP8 layer expands its weight)."""
    n, k = q.shape
    G = scale.shape[1]
    pad = G * block_cols - k  # a last partial block padded
    qf = (F.pad(q.float(), (0, pad)) if pad else q.float()).view(n, G, block_cols)
    out = torch.empty(n, G, block_cols, dtype=dtype, device=q.device)
    torch.mul(qf, scale[..., None].float(), out=out)
    out = out.view(n, G * block_cols)
    return out[:, :k].contiguous() if pad else out


class FP8BlockLinear(_PackedLinearMixin, Linear):
    """``y = x @ W^T (+ bias)`` with W the dequantized FP8 block weight (module docstring), cast
    to the activation dtype. Buffers: ``qweight`` [out, in] float8_e4m3fn, ``scale`` [out, G]
    float32 (G = ceil(in / block_cols)), ``bias`` or None. ``block_height``: the checkpoint's block
    rows (``bh``; what a weight update's ``weight_scale_inv`` is expanded by), None where unknown."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block_cols: int,
                 bias: torch.Tensor | None = None, block_height: int | None = None) -> None:
        nn.Module.__init__(self)
        if qweight.dtype != FP8 or qweight.ndim != 2:
            raise LogprobeError("weight", f"{qweight.dtype} {tuple(qweight.shape)} is not a 2-D float8_e4m3fn weight")
        self.out_features, self.in_features = (int(n) for n in qweight.shape)
        self.block_cols = int(block_cols)
        self.block_height = None if block_height is None else int(block_height)
        groups = -(-self.in_features // self.block_cols)
        if tuple(scale.shape) != (self.out_features, groups):
            raise LogprobeError("weight_scale_inv", f"row scales {tuple(scale.shape)} do not match "
                                f"[{self.out_features}, {groups}] (in {self.in_features}, blocks of {block_cols})")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", bias)

    @classmethod
    def from_blocks(cls, qweight: torch.Tensor, scale_inv: torch.Tensor, block_rows_: int, block_cols: int
                    ) -> FP8BlockLinear:
        """From the checkpoint's layout: ``weight_scale_inv`` [ceil(out/bh), ceil(in/bw)]."""
        return cls(qweight, block_rows(scale_inv, block_rows_, qweight.shape[0]), block_cols,
                   block_height=block_rows_)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        """Dequantized weight rows, float32 [n, in]."""
        return expand_codes(self.qweight[idx], self.scale[idx], self.block_cols)

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in ``dtype``, rounded once from its float32 rows (``expand_codes``)."""
        return expand_codes(self.qweight, self.scale, self.block_cols, dtype)

    def permute_rows(self, perm: torch.Tensor) -> None:
        """Reorder the output rows (q/k to the interleaved rotary layout, at load)."""
        for name in ("qweight", "scale", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[perm].contiguous())

    def extra_repr(self) -> str:
        return (f"float8_e4m3 weights (column blocks of {self.block_cols}), float activations, "
                f"in={self.in_features}, out={self.out_features}")


class FP8BlockExperts(ExpertMatrices):
    """E FP8 block matrices ``[E, out, in]``: ``qweight`` [E, out, in] float8_e4m3fn, ``scale``
    [E, out, G] float32. ``expert(e)`` is expert e's weight expanded as ``FP8BlockLinear.rows``,
    then the model dtype (the dense loader's bits). ``block_height``: as ``FP8BlockLinear``'s."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block_cols: int,
                 block_height: int | None = None) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.out_features, self.in_features = (int(n) for n in qweight.shape)
        self.block_cols = int(block_cols)
        self.block_height = None if block_height is None else int(block_height)
        self.compute_dtype = torch.float32
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def stack(cls, layers: list[FP8BlockLinear]) -> FP8BlockExperts:
        first = layers[0]
        if any((m.out_features, m.in_features, m.block_cols) != (first.out_features, first.in_features,
                                                                 first.block_cols) or m.bias is not None
               for m in layers):
            raise LogprobeError("model", "the FP8 experts of one matrix differ in shape or block size (or have a bias)")
        heights = {m.block_height for m in layers}
        return cls(torch.stack([m.qweight for m in layers]), torch.stack([m.scale for m in layers]), first.block_cols,
                   heights.pop() if len(heights) == 1 else None)

    def expert(self, e: int) -> torch.Tensor:
        return expand_codes(self.qweight[e], self.scale[e], self.block_cols, self.compute_dtype)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        q = self.qweight.reshape(-1, self.in_features)[idx]  # [E, out, in] -> [E*out, in] rows
        return expand_codes(q, self.scale.reshape(-1, self.scale.shape[-1])[idx], self.block_cols)

    def stacked(self, dtype: torch.dtype, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Experts ``first`` .. ``last - 1`` (all by default) expanded, [n, out, in] in ``dtype``
        (the fused expert kernel's input), each bitwise its ``expert(e)`` in ``dtype``."""
        q, scale = self.qweight[first:last], self.scale[first:last]
        n, out, k = q.shape
        return expand_codes(q.reshape(n * out, k), scale.reshape(n * out, -1), self.block_cols, dtype).view(n, out, k)

    def extra_repr(self) -> str:
        return (f"float8_e4m3 blocks of {self.block_cols} columns, experts={self.num_experts}, "
                f"in={self.in_features}, out={self.out_features}")

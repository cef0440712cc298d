"""RMSNorm, normalising in float32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import triton_available
from ..kernels.rmsnorm import invariant_rmsnorm
from .numerics import NumericsUser


class RMSNorm(NumericsUser, nn.Module):
    """On CUDA each row is reduced alone by the Triton kernel ``kernels.rmsnorm``: one read and
    one write instead of PyTorch's chain of float32 intermediates, and batch-invariant (PyTorch's
    reduction layout depends on the number of rows). ``numerics.triton = False`` keeps the PyTorch
    ops (a benchmark baseline) except in deterministic mode. On CPU the PyTorch reduction of a
    row is already independent of the others."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.numerics.deterministic or self.numerics.triton) and x.is_cuda:
            if triton_available():
                return invariant_rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the gain, as the reference implementations do, so bf16 runs match them.
        return self.weight * xf.to(dtype)


class OffsetRMSNorm(NumericsUser, nn.Module):
    """RMSNorm whose stored weight ``w`` is an offset from one: ``x / rms(x) * (1 + w)``, as
    Qwen3-Next and Qwen3.5 (``Qwen3NextRMSNorm``, Gemma's convention) store their decoder, final
    and q/k norms (initialised to zeros). Rounded as they compute it: the norm and the gain in
    float32, one cast to x's dtype at the end (``RMSNorm`` casts before its gain). On CUDA (as
    ``RMSNorm``: deterministic mode, or ``numerics.triton``) each row is reduced alone by
    ``kernels.rmsnorm``, which reads x in its dtype and computes in float32 with the float32 gain
    ``1 + w``, rounding once at the store: the same rounding."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.numerics.deterministic or self.numerics.triton) and x.is_cuda:
            if triton_available():
                return invariant_rmsnorm(x, 1.0 + self.weight.float(), self.eps, round_normed=False)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Float32RMSNorm(NumericsUser, nn.Module):
    """x / rms(x) in float32, times w in float32 (no weight: ``scale=False``), one cast back to x's
    dtype; over the last dim, so per head when given [T, heads, D]. Gemma 4's RMSNorm, its text
    blocks' and its vision tower's (``models.gemma4``, ``models.gemma4_vision``)."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.to(x.dtype)

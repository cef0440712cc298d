"""RMSNorm, normalising in float32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``invariant`` (deterministic mode, set by the engine): on CUDA each row is reduced alone by
    ``kernels.rmsnorm`` (PyTorch's reduction layout depends on the number of rows); on CPU the
    PyTorch reduction of a row is already independent of the others."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and x.is_cuda:
            from ..kernels import triton_available

            if triton_available():
                from ..kernels.rmsnorm import invariant_rmsnorm

                return invariant_rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the gain, as the reference implementations do, so bf16 runs match them.
        return self.weight * xf.to(dtype)

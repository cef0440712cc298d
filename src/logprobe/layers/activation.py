"""SiLU(gate) * up, the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """gate, up [T, I] -> SiLU(gate) * up [T, I].

    ``triton`` on CUDA: one Triton pass in float32, rounded once (``kernels.elementwise.silu_mul``);
    otherwise PyTorch's two ops, which round SiLU(gate) to the activation dtype first, as
    transformers does (identical in float32)."""
    if triton and gate.is_cuda and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1:
        from ..kernels import triton_available

        if triton_available():
            from ..kernels.elementwise import silu_mul as fused

            return fused(gate, up)
    return F.silu(gate) * up

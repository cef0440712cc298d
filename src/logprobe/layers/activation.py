"""SiLU(gate) * up, the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import triton_available
from ..kernels.elementwise import row_invariant
from ..kernels.elementwise import silu_mul as fused


def silu_mul(gate: torch.Tensor, up: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """gate, up [T, I] -> SiLU(gate) * up [T, I].

    ``triton`` on CUDA: one Triton pass in float32, rounded once (``kernels.elementwise.silu_mul``);
    otherwise PyTorch's two ops, which round SiLU(gate) to the activation dtype first, as
    transformers does (identical in float32).

    On CPU a row's bits must not depend on how many rows come with it (deterministic mode; an
    expert of a mixture gets a different number of rows in every batch). PyTorch's CPU loops run
    SIMD chunks and a scalar tail that rounds SiLU differently, and with a width I that is not a
    multiple of the vector length the tail falls on different elements as T changes (I = 24: 184 of
    300 rows differed from the same row alone); so do the ends of the threads' ranges.
    ``kernels.elementwise.row_invariant`` pads the rows and, where needed, runs them in blocks."""
    if triton and gate.is_cuda and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1:
        if triton_available():
            return fused(gate, up)
    return row_invariant(lambda g, u: F.silu(g) * u, gate, up)

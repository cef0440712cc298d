"""Rotary position embeddings (the "rotate half" layout) with Llama-3 and linear frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.elementwise import rotary, rotary_reference


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float64, after the configured scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise LogprobeError("rope_scaling", f"rope type {kind!r} is not supported by the native model",
                        "this model runs through the transformers backend instead")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None,
                 freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        if freq_factors is not None:  # GGUF `rope_freqs`: per-frequency divisors (Llama 3 scaling)
            inv = inv / freq_factors.double()
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Unit complex rotations exp(i * pos * freq) [T, D/2] (complex64) for positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary(x: torch.Tensor, cis: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """x [T, H, D] in the *interleaved* layout (dims 2j, 2j+1 form pair j) rotated by cis [T, D/2].

    One complex multiply instead of the rotate-half gather; the model stores q/k weights with
    their rows permuted to this layout (see ``to_interleaved``), which leaves q.k unchanged.
    ``triton``: on CUDA, one Triton pass (``kernels.elementwise.rotary``, same arithmetic).
    """
    if triton and x.is_cuda and x.stride(2) == 1 and triton_available():
        return rotary(x, cis)
    return rotary_reference(x, cis)


def to_interleaved(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias, or per-head norm weight) from the rotate-half layout
    (dim j pairs with j + D/2) to the interleaved one (dim 2j pairs with 2j + 1), per head."""
    rows = w.shape[0]
    # [n_head, 2, D/2, ...] -> [n_head, D/2, 2, ...]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

"""Rotary position embeddings (the "rotate half" layout) with Llama-3 and linear frequency scaling,
LongRoPE (Phi-3 / Phi-4-mini: its short factors and attention factor, see ``RotaryEmbedding``) and
partial rotation (``partial_rotary_factor`` in the scaling dict: only the first ``rotary_dim``
dims of a head turn; the rest get frequency 0, a rotation by exactly 1)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.elementwise import rotary, rotary_pair, rotary_reference


def rotary_dim(head_dim: int, scaling: dict | None) -> int:
    """How many leading dims of a head rotate (``partial_rotary_factor`` of the scaling dict)."""
    factor = float((scaling or {}).get("partial_rotary_factor", 1.0) or 1.0)
    rot = int(head_dim * factor)
    if rot < 2 or rot > head_dim or rot % 2:
        raise LogprobeError("partial_rotary_factor", f"{factor} of head_dim {head_dim} gives {rot} rotary dims, "
                            "which must be even and in [2, head_dim]")
    return rot


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float64, after the configured scaling; with partial
    rotation the pairs past ``rotary_dim`` get frequency 0."""
    rot = rotary_dim(head_dim, scaling)
    inv = _inv_freq(rot, theta, scaling)
    return torch.cat([inv, inv.new_zeros((head_dim - rot) // 2)]) if rot < head_dim else inv


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # on the host even while a model is built on the meta device: a meta arange runs torch's Python
    # references, whose first call imports torch._dynamo (about 1 s of every load); the table is tiny
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind == "default":
        return inv
    if kind == "longrope":  # the short factors: what transformers uses while a sequence fits the original length
        short = torch.tensor([float(f) for f in scaling["short_factor"]], dtype=torch.float64, device="cpu")
        if short.shape != inv.shape:
            raise LogprobeError("rope_scaling.short_factor", f"has {short.numel()} entries, rotary_dim / 2 is "
                                f"{inv.numel()}")
        return inv / short
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
        # LongRoPE: transformers turns cos and sin by `attention_factor` (on the rotary pairs), and
        # switches a whole sequence to the long factors once it is longer than the original
        # length, so a token's log-prob would hang on the sequence's total length. Positions
        # stay below `max_positions` instead (short factors, exactly transformers' numbers for
        # each such sequence; its last token is not fed, so position max_positions - 1 is the
        # first too far); where long and short factors agree nothing switches.
        self.max_positions: int | None = None
        mag = None
        if (scaling or {}).get("rope_type") == "longrope":
            factor = float(scaling.get("attention_factor", 1.0))
            if factor != 1.0:
                mag = torch.ones(head_dim // 2)
                mag[:rotary_dim(head_dim, scaling) // 2] = factor
            if [float(f) for f in scaling["long_factor"]] != [float(f) for f in scaling["short_factor"]]:
                self.max_positions = int(scaling["original_max_position_embeddings"])
        self.register_buffer("magnitude", mag, persistent=False)  # None: unit rotations

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex rotations exp(i * pos * freq) [T, D/2] (complex64) for positions [T] (of
        magnitude ``attention_factor`` on LongRoPE's rotary pairs)."""
        if self.max_positions is not None and positions.numel() and int(positions.max()) >= self.max_positions - 1:
            raise LogprobeError("rope_scaling", f"a sequence longer than original_max_position_embeddings "
                                f"({self.max_positions}) under LongRoPE: transformers switches the whole sequence "
                                "to long_factor then, so every token's log-prob would depend on the total length",
                                f"score sequences of at most {self.max_positions} tokens with this model")
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        if self.magnitude is not None:
            return torch.polar(self.magnitude.expand_as(freqs), freqs)
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


def apply_rotary_pair(q: torch.Tensor, k: torch.Tensor, cis: torch.Tensor, triton: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rotary(q, cis, triton), apply_rotary(k, cis, triton))``, bit for bit; on the Triton
    path in one launch (a launch costs the host tens of microseconds: on a small pass the GPU
    waits for them)."""
    if triton and q.is_cuda and q.stride(2) == 1 and k.stride(2) == 1 and triton_available():
        return rotary_pair(q, k, cis)
    return apply_rotary(q, cis, triton), apply_rotary(k, cis, triton)


def to_interleaved(w: torch.Tensor, n_head: int, rot: int | None = None) -> torch.Tensor:
    """Rows of a q/k projection (or bias, or per-head norm weight) from the rotate-half layout
    (dim j pairs with j + D/2) to the interleaved one (dim 2j pairs with 2j + 1), per head.
    ``rot``: only the first ``rot`` dims of each head rotate (partial rotation); the rest stay."""
    rows = w.shape[0]
    if rot is not None and rot < rows // n_head:
        heads = w.reshape(n_head, rows // n_head, *w.shape[1:])  # [n_head, D, ...]
        turned = to_interleaved(heads[:, :rot].reshape(n_head * rot, *w.shape[1:]), n_head)
        return torch.cat([turned.reshape(n_head, rot, *w.shape[1:]), heads[:, rot:]], 1).reshape(w.shape)
    # [n_head, 2, D/2, ...] -> [n_head, D/2, 2, ...]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def mrope_axes(pairs: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Which position row (0: t, 1: h, 2: w) turns each of the ``pairs`` rotary frequencies under
    Qwen3.5's interleaved multimodal rotary (transformers' ``recomposition_frequencies``): pair j is
    h where j % 3 == 1 and j < 3 * section[1], w where j % 3 == 2 and j < 3 * section[2], else t
    (sections need not sum to ``pairs``: transformers applies the rule as is, e.g. its default
    [11, 11, 10] on fewer frequencies).

    >>> mrope_axes(8, (4, 2, 2)).tolist()
    [0, 1, 2, 0, 1, 2, 0, 0]
    """
    if len(section) != 3:
        raise LogprobeError("rope_parameters.mrope_section", f"{list(section)} must be three sizes (t, h, w)")
    j = torch.arange(pairs, device="cpu")  # on the host even under a meta device (see _inv_freq)
    axes = torch.zeros(pairs, dtype=torch.long, device="cpu")
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


class MRotaryEmbedding(RotaryEmbedding):
    """The default rotary, whose positions may also be [3, T] rows (t, h, w): frequency j turns by
    row ``mrope_axes[j]``'s position. [T] positions (text: all three rows equal) take the plain path,
    bit for bit."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int]) -> None:
        super().__init__(head_dim, theta)
        self.register_buffer("axes", mrope_axes(head_dim // 2, tuple(section)), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] or [3, T] -> complex rotations [T, D/2]."""
        if positions.dim() == 1:
            return super().forward(positions)
        # [T, D/2]: pair j by row axes[j]; contiguous, as the plain path's: a transposed table takes
        # another CPU path through the rotary's complex multiply (other bits for text rows when a
        # pass holds images, measured 2e-7 on a 16-pair head)
        freqs = positions.float()[self.axes].T.contiguous() * self.inv_freq[None, :]
        return torch.polar(torch.ones_like(freqs), freqs)

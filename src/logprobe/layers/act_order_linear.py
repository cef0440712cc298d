"""A packed integer weight whose input channels are stored sorted by quantization group (GPTQ act-order).

GPTQ with ``desc_act`` quantizes input channels in order of decreasing activation size, so the
channels of one group are scattered: ``g_idx[k]`` names the group of input channel k. The loader
(``loading.gptq``) sorts the channels by group once (a stable sort: ``in_perm``), so the stored
weight has contiguous groups like any ``CTLinear``, and this layer remembers the permutation:

    stored column j  =  input channel in_perm[j]        W[:, in_perm[j]] = W_sorted[:, j]
    y = x @ W.T = x[:, in_perm] @ W_sorted.T            (the same sum, terms in another order)

``rows()`` returns columns in the model's order (``W``), so the CPU path, ``weights="dense"`` and
the log-prob head see the weight exactly as the checkpoint defines it; the CUDA int4 kernel, which
needs contiguous groups, is fed the permuted activation ``x[:, in_perm]`` instead.
"""

from __future__ import annotations

import torch

from .quant_linear import CTLinear


class ActOrderLinear(CTLinear):
    """``CTLinear`` over input channels stored in group order; ``in_perm`` [in] (long): stored
    column j is input channel ``in_perm[j]``. Example: g_idx = [1, 0, 1, 0] (group size 2) ->
    in_perm = [1, 3, 0, 2] (channels of group 0, then of group 1)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, num_bits: int,
                 group_size: int, in_features: int, in_perm: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight, scale, zero_point, num_bits, group_size, in_features, bias)
        in_perm = in_perm.long()
        if in_perm.shape != (self.in_features,) or not torch.equal(in_perm.sort().values,
                                                                    torch.arange(self.in_features)):
            raise ValueError(f"in_perm of shape {tuple(in_perm.shape)} is not a permutation of {self.in_features}")
        self.register_buffer("in_perm", in_perm)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        w_sorted = super().rows(idx)  # [n, in], stored (group) order
        w = torch.empty_like(w_sorted)
        w[:, self.in_perm] = w_sorted  # [n, in], the model's channel order
        return w

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return super()._cuda_forward(x[:, self.in_perm].contiguous())  # [T, in] in stored order

    def extra_repr(self) -> str:
        return super().extra_repr() + ", input channels in act-order (permuted)"

"""Integer codes packed into int32 words (compressed-tensors ``pack-quantized``; GPTQ and AWQ are
repacked into it at load): the unpacking rule, shared by the layers and the W4A16 kernel's reference."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` words [r, w] int32 -> signed codes [r, cols] int16.

    Element i of a row sits in word i // (32 / bits) at bit (i % (32 / bits)) * bits, stored
    with an offset of 2^(bits-1) so it is unsigned."""
    per_word = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)  # [per_word]
    u = (packed[..., None] >> shifts) & ((1 << num_bits) - 1)  # [r, w, per_word]
    u = u.reshape(packed.shape[0], packed.shape[1] * per_word)[:, :cols]  # [r, cols]
    return u.to(torch.int16) - (1 << (num_bits - 1))

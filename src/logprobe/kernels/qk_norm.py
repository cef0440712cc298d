r"""The per-head L2 norm of the gated delta rule's q and k, and the head copy fla-core needs, in Triton.

``l2_normalize`` is the PyTorch form (``x / sqrt(|x|^2 + 1e-6)`` over the last axis, fla's and
transformers' formula, written ``x * rsqrt(...)``). On CUDA the rule's inputs are views of the short
conv's output ``y [T, C]`` (``q = y[:, :Hk Dk]``, ``k``, ``v`` the next channel ranges, each row
``C`` elements apart), and fla-core copies every non-contiguous input; normalising in PyTorch took
a float32 copy, the norm, then a cast, per tensor. ``heads_triton(x, dtype, normalize)`` reads the
strided ``[T, H, D]`` view once and writes ``[T, H, D]`` contiguous in ``dtype``: each
(token, head) row normalised in float32 (``normalize``) or just copied, rounded once.

Each program takes a fixed tile of ``BT`` tokens of one head and reduces every row over its D
elements alone; the tile, the warp count and the reduction do not depend on T (no autotuning), so a
row's bits do not depend on what else is packed: batch-invariant by construction. Against the
PyTorch form the sum of squares is reduced in another order, so float32 results differ by a few ulp
and the rounded ones by at most one ulp of the output dtype (rarely).

On CUDA the kernel rounds to ``dtype`` as it stores; the interpreter's bfloat16 rounding differs
from torch's, so there it stores float32 and torch rounds.

    >>> y = torch.tensor([[3.0, 4.0, 0.0, 2.0, 1.0, 7.0]])   # [T=1, C]: q head [3, 4], k head [0, 2]
    >>> q = y[:, 0:2].view(1, 1, 2)                          # a strided [T, Hk, Dk] view
    >>> heads_triton(q, torch.float32, True)                 # doctest: +SKIP
    tensor([[[0.6000, 0.8000]]])
"""

from __future__ import annotations

import torch

from . import triton_available

L2_EPS = 1e-6  # inside the square root of the q/k L2 norm, as transformers and fla
BLOCK_T = 16  # tokens per program: fixed, never chosen by T (batch invariance)
CUDA_OPTIONS = {"enable_fp_fusion": False}  # squares rounded before their sum, as PyTorch's (x * x).sum

triton = None
if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel whatever T (no divisibility variants)
    def _heads_kernel(x_ptr, y_ptr, T, H, D, stride_t, stride_h, eps,
                      NORMALIZE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        # int64 offsets: T * row stride passes 2^31 at 262k tokens of 8192 channels
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BD)
        m = (t < T)[:, None] & (d < D)[None, :]
        x = tl.load(x_ptr + t[:, None] * stride_t + h * stride_h + d[None, :], mask=m, other=0.0).to(tl.float32)
        if NORMALIZE:  # masked lanes are 0: they add nothing to the sum
            x = x * tl.math.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]
        tl.store(y_ptr + (t[:, None] * H + h) * D + d[None, :], x.to(y_ptr.dtype.element_ty), mask=m)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last axis (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def heads_reference(x: torch.Tensor, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    """What ``heads_triton`` computes, in PyTorch: float32 (normalised), rounded to ``dtype``."""
    x = x.float()
    return (l2_normalize(x) if normalize else x).to(dtype).contiguous()


def heads_triton(x: torch.Tensor, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    """x [T, H, D], any token and head strides, the last axis contiguous -> [T, H, D] contiguous in
    ``dtype``: each row ``x / sqrt(|x|^2 + 1e-6)`` in float32 (``normalize``) or ``x`` as float32,
    rounded once (``heads_reference``'s result up to the order of the sum of squares)."""
    if triton is None:
        raise RuntimeError("heads_triton needs Triton; use kernels.qk_norm.heads_reference")
    if x.dim() != 3:
        raise ValueError(f"heads_triton takes [T, H, D], got {tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    T, H, D = x.shape
    cuda = x.device.type == "cuda"
    y = torch.empty((T, H, D), dtype=dtype if cuda else torch.float32, device=x.device)
    if T and H and D:
        grid = (triton.cdiv(T, BLOCK_T), H)
        _heads_kernel[grid](x, y, T, H, D, x.stride(0), x.stride(1), L2_EPS, NORMALIZE=normalize, BT=BLOCK_T,
                            BD=triton.next_power_of_2(D), num_warps=4, **(CUDA_OPTIONS if cuda else {}))
    return y.to(dtype)

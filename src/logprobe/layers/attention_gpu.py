"""Packed (varlen) causal attention on CUDA: one varlen call per layer for the whole batch.

Same result as ``attention.packed_attention``'s portable path (one SDPA call per segment): query
segment s is rows ``cu_q[s]:cu_q[s+1]`` of q [T, Hq, D], its keys rows ``cu_k[s]:cu_k[s+1]`` of
k/v [K, Hkv, D] (context first, then its own rows), causal with the diagonal aligned bottom-right.
The portable loop costs one launch (and, for GQA, a slower SDPA path) per sequence and layer,
which dominated GPU time on batches of many short sequences; PyTorch's bundled FlashAttention-2
takes the packed tensors with cumulative sequence offsets directly, supports GQA (Hkv divides
Hq) and a sliding window, and never crosses sequences.

Applies to float16 / bfloat16 on CUDA with head_dim <= 256 (FlashAttention's limits); anything
else returns None and the caller runs the portable loop.

Long segments (``LONG_ROWS`` query rows or more: a long request, or a chunk of one over its KV
cache) run on cuDNN's attention instead, outside deterministic mode: on an H200 it ran a 32k causal
sequence at 598 TFLOP/s against FlashAttention-2's 354 (``bench/gpu_attention.py``; it is also what
PyTorch's SDPA picks for transformers). PyTorch exposes it on dense [B, H, L, D] tensors with a
top-left causal mask only, so a segment whose n queries are the last n of m keys is split
(``causal_tail_attention``): the m - n earlier keys seen in full, the n own keys causally (square,
where top-left and bottom-right agree), and the two partial softmaxes merged by their
log-sum-exps (``merge_partials``). Deterministic mode keeps long segments off cuDNN: the split
puts a boundary at the chunk start, so a row's bits would depend on where its sequence was
chunked; the varlen kernels' key blocks start at each sequence's first key whatever the chunking.

The other segments run on the project's varlen kernel (``kernels.attention``, head_dim 64 and
128, no window, no sinks: ``triton_varlen_attention``), in both modes, and on FlashAttention-2
where it does not apply.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..kernels import attention as varlen_kernel
from ..kernels import host_values_to

LONG_ROWS = 4096  # query rows from which a segment runs on cuDNN in default mode (module docstring)


def flash_varlen_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [K, Hkv, D]
    v: torch.Tensor,  # [K, Hkv, D]
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    cu: tuple[torch.Tensor, torch.Tensor] | None = None,
    causal: bool = True,
) -> torch.Tensor | None:
    """-> [T, Hq, D], or None when this path does not apply. ``sinks`` [Hq]: a sink logit per head
    (gpt-oss), applied to the output through its log-sum-exp (``sink_rescale``). ``cu``: cu_q and
    cu_k already on the device (``cu_tensors``, built once per batch: each build is a host-to-device
    copy, which waits for the stream), else built here. ``causal=False``: every key of a sequence is
    visible but those past the window (query i of n over m keys sits at key index m - n + i, as
    in the causal case): a bidirectional span's rows (``attention._gpu_spans``)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and q.shape[1] % k.shape[1] == 0):
        return None
    max_q = max((b - a for a, b in zip(cu_q[:-1], cu_q[1:])), default=0)
    max_k = max((b - a for a, b in zip(cu_k[:-1], cu_k[1:])), default=0)
    if max_q == 0:
        return torch.empty_like(q)
    if sinks is not None and max_q == 1:
        return None  # FlashAttention swaps query groups into rows here; its log-sum-exp layout then differs
    cq, ck = cu if cu is not None else cu_tensors(cu_q, cu_k, q.device)
    # token i sees j with i - window < j <= i (the transformers convention): left = window - 1;
    # right: 0 = causal, -1 = unbounded (FlashAttention widens it to the sequence when left is set)
    left = -1 if sliding_window is None else sliding_window - 1
    right = 0 if causal and sliding_window is not None else -1
    try:
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cq, ck, max_q, max_k, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right)
    except (RuntimeError, TypeError, NotImplementedError):  # a build without flash, or an older signature
        return None
    if sinks is None:
        return out[0]  # [T, Hq, D]
    lse = out[1]  # varlen: [Hq, T] float32
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        return None  # a layout we do not know: the portable path (SDPA with a sink key) instead
    return sink_rescale(out[0], lse.t(), sinks)


def triton_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                            scale: float, cu: tuple[torch.Tensor, torch.Tensor], plans: dict) -> torch.Tensor | None:
    """``flash_varlen_attention``'s causal case (no window, no sinks) on the project's kernel
    (``kernels.attention``), or None where it does not run: a Hopper GPU (where it was measured
    against FlashAttention-2; other GPUs keep FlashAttention-2), float16 / bfloat16, head_dim 64
    or 128 for queries, keys and values alike, Triton present. ``cu``: cu_q and cu_k on the
    device; ``plans``: the batch's programs by tile rows, built here once (``block_plan``) and
    kept for every layer."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and k.shape[-1] == q.shape[-1] == v.shape[-1] and q.shape[1] % k.shape[1] == 0
            and varlen_kernel.triton is not None and hopper(q.device)):
        return None
    shape = varlen_kernel.tile_shape(q.shape[-1], q.shape[1], k.shape[1])
    if shape is None:
        return None
    if shape[0] not in plans:
        seg, start = varlen_kernel.block_plan(cu_q, cu_k, shape[0])
        plans[shape[0]] = (host_to(torch.tensor(seg, dtype=torch.int32), q.device),
                           host_to(torch.tensor(start, dtype=torch.int32), q.device))
    return varlen_kernel.varlen_triton(q.contiguous(), k.contiguous(), v.contiguous(), cu[0], cu[1],
                                       plans[shape[0]], scale)


@functools.cache
def hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.x: H100, H200)."""
    return torch.cuda.get_device_capability(device)[0] == 9


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (``kernels.host_values_to``: a copy from
    pageable memory would wait for the GPU to drain first, inside the first layer).

    >>> host_to(torch.tensor([0, 2, 3]), torch.device("cpu")).tolist()
    [0, 2, 3]
    """
    return host_values_to(t, t.dtype, device)


def cu_tensors(cu_q: list[int], cu_k: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_q and cu_k as FlashAttention takes them: int32 [B + 1] on ``device`` (one tensor when equal).

    >>> cq, ck = cu_tensors([0, 2, 3], [0, 2, 3], torch.device("cpu"))
    >>> cq is ck, cq.tolist()
    (True, [0, 2, 3])
    """
    cq = host_to(torch.tensor(cu_q, dtype=torch.int32), device)  # [B + 1]
    return cq, cq if cu_k == cu_q else host_to(torch.tensor(cu_k, dtype=torch.int32), device)


def sink_rescale(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks -> with them: o [T, H, D] and its log-sum-exp lse [T, H] (float32)
    -> o * Z / (Z + exp(sink)) = o * sigmoid(lse - sink), in float32, cast once. A row that saw
    keys with scores summing to Z = e^0 = 1 and a sink of 0 keeps half its output:

    >>> sink_rescale(torch.ones(1, 1, 2), torch.zeros(1, 1), torch.zeros(1)).tolist()
    [[[0.5, 0.5]]]
    """
    w = torch.sigmoid(lse.float() - sinks.float()[None, :])  # [T, H]
    return (o.float() * w[..., None]).to(o.dtype)


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Attention over two disjoint key sets -> attention over their union, in float32 (or the inputs'
    wider dtype), cast once.

    o_* [n, H, D] are each set's softmax-weighted values, lse_* [n, H] float32 the natural log of
    each set's sum of exp(scores): the union's softmax weighs o_a by exp(lse_a - lse) and o_b by
    exp(lse_b - lse), lse = log(exp(lse_a) + exp(lse_b)). Worked example, one row and head: keys
    with scores [0] (value 1) and [0, 0] (values 4, 7): o_a = 1, lse_a = 0; o_b = 5.5, lse_b = log 2;
    lse = log 3, weights 1/3 and 2/3: 1/3 + 11/3 = 4, the mean of 1, 4 and 7.

    >>> t = lambda x: torch.tensor([[x]])
    >>> round(merge_partials(t([1.0]), t(0.0), t([5.5]), t(2.0).log(), torch.float32).item(), 5)
    4.0
    """
    wide = torch.promote_types(o_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a, lse_b)  # [n, H]
    wa = torch.exp(lse_a - lse).unsqueeze(-1).to(wide)  # [n, H, 1]
    wb = torch.exp(lse_b - lse).unsqueeze(-1).to(wide)
    return (o_a.to(wide) * wa).add_(o_b.to(wide) * wb).to(dtype)


Dense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], "tuple[torch.Tensor, torch.Tensor] | None"]


def causal_tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: Dense) -> torch.Tensor | None:
    """q [n, Hq, D], the queries of the last n of m keys k/v [m, Hkv, D], causal aligned bottom-right
    (query i sees keys 0 .. m - n + i) -> [n, Hq, D], from a ``dense(q, k, v, causal)`` that returns
    (output [n, Hq, D], log-sum-exp [n, Hq] float32) with a top-left causal mask, or None.

    m = n: one causal call. m > n: keys 0 .. m - n - 1 are visible to every query (one call, no
    mask) and keys m - n .. m - 1 are the square causal part (one call, top-left = bottom-right);
    ``merge_partials`` joins them. E.g. n = 2, m = 5: query 0 sees keys 0-2 (full part) and key 3;
    query 1 sees keys 0-2 and keys 3-4."""
    n, m = q.shape[0], k.shape[0]
    own = dense(q, k[m - n:], v[m - n:], True)
    if own is None or m == n:
        return None if own is None else own[0]
    early = dense(q, k[:m - n], v[:m - n], False)
    if early is None:
        return None
    return merge_partials(early[0], early[1], own[0], own[1], q.dtype)


def cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cuDNN's attention on one sequence (PyTorch's dense op; causal = top-left): q [n, Hq, D],
    k/v [m, Hkv, D] -> (out [n, Hq, D], log-sum-exp [n, Hq] float32), or None where it does not run.
    Key/value heads are repeated for the query heads that share them (GQA) if the op refuses
    them as they are."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    n, hq, d = q.shape
    heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [L, H, D] -> [1, H, L, D] (a view)
    for expand in (False, True):
        kk, vv = (k, v) if not expand else (x.repeat_interleave(hq // k.shape[1], dim=1) for x in (k, v))
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                heads(q), heads(kk), heads(vv), None, True, 0.0, causal, False, scale=scale)
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):
            continue
        o, lse = out[0], out[1]  # [1, Hq, n, D], [1, Hq, n] (or [1, Hq, n, 1])
        return o[0].transpose(0, 1), lse.reshape(hq, n).t().float()
    return None

r"""Fast paths for the gated delta rule and its short convolution (Qwen3-Next / Qwen3.5 linear attention).

``layers.gated_delta`` holds the float32 references (``gated_delta_rule_chunked``, ``causal_conv1d``),
which loop over packed sequences and chunks in Python: fine on CPU, far too slow on a GPU with
hundreds of packed sequences and dozens of layers. This module has drop-in replacements with the
same signatures and results (it may not import ``layers``, so it repeats the few helpers it needs):

* ``chunk_gated_delta_batched``: the same chunked (UT-transform) algorithm, vectorised across
  sequences. Every sequence's tokens are gathered into chunks of ``chunk_size`` counted from its
  own first token (the last chunk zero-padded with ``g = beta = 0, q = k = v = 0``, as the reference
  pads), the within-chunk quantities (the triangular solve, the masked decayed scores, ...) are
  computed for all chunks of all sequences in single batched ops, and the inter-chunk scan is a
  Python loop over the chunk index ``c`` that advances every sequence having a chunk ``c`` at once.
  Sequences are sorted by chunk count (descending) so the ones active at step ``c`` are a prefix of
  the state tensor and chunk ``c`` of all of them a contiguous block of rows: no gathers in the loop.
  Work is split into groups of at most ``max_group_chunks`` chunks (whole sequences) to bound memory.
  Computes in float32 (float64 stays float64); matches the reference to rounding.
* ``chunk_gated_delta_fixed``: the batched rule one chunk of one sequence at a time, so that no
  shape depends on the batch (deterministic mode's rule on CUDA where fla's is not used).
* ``causal_conv1d_batched``: every sequence's window ``[initial state ; x_i]`` laid end to end, so
  each tap of every token is one contiguous slice; taps summed in the reference's order and SiLU applied exactly as the
  reference applies it, so on CPU it is bit-identical to ``causal_conv1d``.
* ``causal_conv1d_fast``: the Triton conv (``kernels.short_conv``; taps bitwise those of the
  reference), the conv on CUDA; the batched one stays where Triton is missing.
* ``chunk_gated_delta_fla``: ``fla-core``'s Triton ``chunk_gated_delta_rule`` (optional extra ``fla``),
  behind our signature; CUDA only.
* ``gated_delta_kernels(device, deterministic)``: which of them to use (see its docstring).

Batch invariance: within a sequence the batched rule performs the reference's operations, but on
CUDA a batched GEMM / triangular solve may choose its kernel by the batch count, so bits could
depend on what else is packed (on an H100 it did at small shapes: see ``gated_delta_kernels``);
``bench/gpu_gated_delta.py`` checks it for both GPU paths.

    >>> T, Hk, Hv, Dk, Dv = 5, 1, 2, 4, 3
    >>> q, k = torch.randn(T, Hk, Dk), torch.randn(T, Hk, Dk)
    >>> v, g, beta = torch.randn(T, Hv, Dv), -torch.rand(T, Hv), torch.rand(T, Hv)
    >>> o, s = chunk_gated_delta_batched(q, k, v, g, beta, cu_seqlens=[0, 2, 5])
    >>> o.shape, s.shape
    (torch.Size([5, 2, 3]), torch.Size([2, 2, 4, 3]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from . import host_values_to, triton_available
from .elementwise import row_invariant
from .qk_norm import L2_EPS, heads_reference, heads_triton, l2_normalize  # noqa: F401 (L2_EPS: re-exported)
from .short_conv import causal_conv1d_triton

CHUNK_SIZE = 64  # the chunk length of transformers' and fla's chunked forms
MAX_GROUP_CHUNKS = 1024  # chunks (of all sequences) computed together: ~1 GiB per float32 tensor at Hv=32, D=128

CuSeqlens = torch.Tensor | Sequence[int] | None
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Helpers (shared with the float32 reference, layers.gated_delta)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, unless an input is float64 (the tests' reference precision)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def sequence_bounds(cu_seqlens: CuSeqlens, total: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each packed sequence; ``None`` is one sequence of ``total`` tokens."""
    if cu_seqlens is None:
        return [(0, total)]
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {cu}")
    return list(zip(cu[:-1], cu[1:]))


def initial_states(initial_state, n: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros((n, *shape), dtype=dtype, device=device)
    if tuple(initial_state.shape) != (n, *shape):
        raise ValueError(f"initial_state must be {(n, *shape)}, got {tuple(initial_state.shape)}")
    return initial_state.to(dtype)




# --------------------------------------------------------------------------------------------
# The gated delta rule, batched across sequences


def _groups(lengths: list[int], size: int, budget: int) -> list[list[int]]:
    """Sequence indices in consecutive groups of at most ``budget`` chunks (a longer sequence alone);
    empty sequences are left out (their final state is their initial state)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        chunks = -(-n // size)
        if not chunks:
            continue
        if cur and used + chunks > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += chunks
    if cur:
        groups.append(cur)
    return groups


def _chunk_layout(starts: list[int], lengths: list[int], size: int, device):
    """For sequences already sorted by chunk count, descending: the token index of every chunk row,
    chunk-major (chunk 0 of every sequence, then chunk 1 of those that have one, ...), as
    ``idx [NC, size]`` (clamped into range) with ``valid [NC, size]``, and the row offsets of
    each chunk index: ``offsets[c]:offsets[c + 1]`` are the chunks ``c`` of sequences ``0..A_c-1``."""
    chunks = [-(-n // size) for n in lengths]
    seq, pos, offsets = [], [], [0]
    for c in range(chunks[0]):
        active = sum(1 for n in chunks if n > c)  # a prefix, chunks being sorted descending
        seq.extend(range(active))
        pos.extend([c * size] * active)
        offsets.append(offsets[-1] + active)
    seq_t = torch.tensor(seq, dtype=torch.long)
    local = torch.tensor(pos, dtype=torch.long)[:, None] + torch.arange(size)  # [NC, size] position in its sequence
    valid = local < torch.tensor(lengths, dtype=torch.long)[seq_t][:, None]
    idx = torch.tensor(starts, dtype=torch.long)[seq_t][:, None] + local
    idx = torch.where(valid, idx, 0)
    return host_values_to(idx, torch.long, device), host_values_to(valid, torch.bool, device), offsets


def _gather(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of a token-major ``x [T, H, ...]``, zero where not ``valid``, head-major:
    ``[NC, H, size, ...]``."""
    nc, size = idx.shape
    y = x.index_select(0, idx.reshape(-1)).view(nc, size, *x.shape[1:])
    y = y.masked_fill(~valid.view(nc, size, *([1] * (x.dim() - 1))), 0)
    return y.transpose(1, 2).contiguous()


def _rule_group(q, k, v, g, beta, S, starts, lengths, *, size, scale, qk_l2norm, cd):
    """One group of sequences (sorted by chunk count, descending; all non-empty). q, k [T, Hk, Dk],
    v [T, Hv, Dv], g, beta [T, Hv] in their own dtypes; S [n, Hv, Dk, Dv] in ``cd`` (updated in
    place). Returns the outputs as chunk rows ``[NC, Hv, size, Dv]`` with ``idx`` and ``valid``."""
    Hv, Dk = v.shape[1], k.shape[-1]
    group = Hv // k.shape[1]
    idx, valid, offsets = _chunk_layout(starts, lengths, size, v.device)
    qc, kc = _gather(q, idx, valid).to(cd), _gather(k, idx, valid).to(cd)  # [NC, Hk, C, Dk]
    if qk_l2norm:  # a zero (padding) row stays zero
        qc, kc = l2_normalize(qc), l2_normalize(kc)
    qc = qc * (Dk**-0.5 if scale is None else scale)
    qc, kc = qc.repeat_interleave(group, dim=1), kc.repeat_interleave(group, dim=1)  # [NC, Hv, C, Dk]
    vc = _gather(v, idx, valid).to(cd)  # [NC, Hv, C, Dv]
    gc, bc = _gather(g, idx, valid).to(cd), _gather(beta, idx, valid).to(cd)  # [NC, Hv, C]

    # within-chunk quantities, all chunks at once (the reference's _within_chunk)
    G = gc.cumsum(-1)  # from each chunk's first token
    causal = torch.ones(size, size, dtype=torch.bool, device=v.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [NC, Hv, C, C]
    system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    w_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, (bc * G.exp())[..., None] * kc, upper=False, unitriangular=True)
    del system
    scores = (qc @ kc.transpose(-1, -2)) * decay  # M * Q K^T, diagonal included
    del decay
    q_decayed = qc * G.exp()[..., None]
    k_to_end = (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # [NC, Hv, Dk, C]
    chunk_decay = G[..., -1].exp()[..., None, None]  # [NC, Hv, 1, 1]
    del qc, kc, vc

    # the scan: chunk c of every sequence that has one, at once
    out = torch.empty_like(w_v)
    for c in range(len(offsets) - 1):
        r0, r1 = offsets[c], offsets[c + 1]
        s = S[: r1 - r0]
        u = w_v[r0:r1] - w_k[r0:r1] @ s  # [A, Hv, C, Dv]
        out[r0:r1] = q_decayed[r0:r1] @ s + scores[r0:r1] @ u
        S[: r1 - r0] = s * chunk_decay[r0:r1] + k_to_end[r0:r1] @ u
    return out, idx, valid


def chunk_gated_delta_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
    max_group_chunks: int = MAX_GROUP_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.gated_delta.gated_delta_rule_chunked`` vectorised across the packed sequences (see
    the module docstring): q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; initial_state
    [N, Hv, Dk, Dv] or None. Returns ``(o [T, Hv, Dv] in v's dtype, final states [N, Hv, Dk, Dv]
    in float32, float64 if an input is)``. ``max_group_chunks`` bounds the chunks computed together."""
    T, Hv, Dv = v.shape
    Hk, Dk = k.shape[1], k.shape[2]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    bounds = sequence_bounds(cu_seqlens, T)
    finals = initial_states(initial_state, len(bounds), (Hv, Dk, Dv), cd, v.device).clone()
    out = torch.zeros((T, Hv, Dv), dtype=cd, device=v.device)
    lengths = [b - a for a, b in bounds]
    for members in _groups(lengths, chunk_size, max_group_chunks):
        members = sorted(members, key=lambda i: -(-lengths[i] // chunk_size), reverse=True)  # stable
        sel = host_values_to(members, torch.long, v.device)
        S = finals.index_select(0, sel)
        o, idx, valid = _rule_group(q, k, v, g, beta, S, [bounds[i][0] for i in members],
                                    [lengths[i] for i in members], size=chunk_size, scale=scale,
                                    qk_l2norm=qk_l2norm, cd=cd)
        rows = o.transpose(1, 2).reshape(-1, Hv, Dv)  # [NC, Hv, C, Dv] -> [NC * C, Hv, Dv]
        keep = valid.reshape(-1)
        out.index_copy_(0, idx.reshape(-1)[keep], rows[keep])
        finals.index_copy_(0, sel, S)
    return out.to(v.dtype), finals


def chunk_gated_delta_fixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched rule run on one chunk of one sequence at a time, so that every product, norm
    and triangular solve it launches has a shape fixed by the model (``[1, Hv, chunk_size, D]``),
    never by the batch: a sequence's bits are the same alone or packed on any device, whichever
    kernel cuBLAS picks for that one shape. Deterministic mode's rule on CUDA where fla's is not
    used (float32 activations, or fla-core missing); slow (a few launches per chunk and layer), as
    that mode's float32 runs may be. Same arguments and results as ``chunk_gated_delta_batched``.

    Chunks are counted from each sequence's first token; the engine splits a long request only at
    multiples of ``chunk_size`` (``ModelCaps.state_align``), so the chunks do not move with the
    split either.

        >>> x = (torch.randn(70, 1, 4), torch.randn(70, 1, 4), torch.randn(70, 2, 3),
        ...      -torch.rand(70, 2), torch.rand(70, 2))
        >>> o, s = chunk_gated_delta_fixed(*x, cu_seqlens=[0, 5, 70])
        >>> torch.equal(o[5:], chunk_gated_delta_fixed(*(t[5:] for t in x))[0])
        True
    """
    T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    bounds = sequence_bounds(cu_seqlens, T)
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    finals = initial_states(initial_state, len(bounds), (Hv, Dk, Dv), cd, v.device).clone()
    out = v.new_empty((T, Hv, Dv))
    for i, (a, b) in enumerate(bounds):
        S = finals[i:i + 1]
        for c0 in range(a, b, chunk_size):
            c1 = min(c0 + chunk_size, b)
            o, S = chunk_gated_delta_batched(q[c0:c1], k[c0:c1], v[c0:c1], g[c0:c1], beta[c0:c1], None, S,
                                             scale=scale, qk_l2norm=qk_l2norm, chunk_size=chunk_size)
            out[c0:c1] = o
        finals[i] = S[0]
    return out, finals


# --------------------------------------------------------------------------------------------
# The short causal convolution, batched across sequences


def causal_conv1d_batched(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.gated_delta.causal_conv1d`` without a loop over sequences: x [T, C]; weight [C, K];
    initial_state [N, C, K - 1] (oldest first) or None. Returns ``(y [T, C] in x's dtype, final
    states [N, C, K - 1] in x's dtype)``. Same operations in the same order as the reference, so
    bit-identical to it on CPU (and, being elementwise, batch-invariant on any device)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x.shape
    K = weight.shape[-1]
    cd = compute_dtype(x, weight)
    bounds = sequence_bounds(cu_seqlens, T)
    N = len(bounds)
    states = initial_states(initial_state, N, (C, K - 1), x.dtype, x.device)
    w = weight.reshape(C, K).to(cd)
    # The windows of all sequences, end to end: [state_0 ; x_0 ; state_1 ; x_1 ; ...] ([T + N (K - 1), C]),
    # so every tap of every token is a contiguous slice (token row r reads rows r - K + 1 .. r).
    lengths = torch.tensor([b - a for a, b in bounds], dtype=torch.long)
    starts = torch.tensor([a for a, _ in bounds], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(N), lengths)  # [T] sequence of each token
    token_rows = torch.arange(T) + (seq + 1) * (K - 1)  # where token t sits in the windows
    first = starts + torch.arange(N) * (K - 1)  # each window's first row
    state_rows = first[:, None] + torch.arange(K - 1)  # [N, K - 1]
    last_rows = (first + lengths)[:, None] + torch.arange(K - 1)  # each window's last K - 1 rows
    windows = torch.empty((T + N * (K - 1), C), dtype=cd, device=x.device)
    windows.index_copy_(0, state_rows.reshape(-1).to(x.device), states.transpose(1, 2).reshape(-1, C).to(cd))
    windows.index_copy_(0, token_rows.to(x.device), x.to(cd))
    R = windows.shape[0] - (K - 1)  # rows K - 1 .. end, each with K - 1 predecessors in the windows
    acc = windows[0:R] * w[:, 0]
    for j in range(1, K):  # taps in a fixed order, oldest input first
        acc = acc + windows[j : j + R] * w[:, j]
    acc = acc.index_select(0, (token_rows - (K - 1)).to(x.device))  # the tokens' rows: [T, C]
    if bias is not None:
        acc = acc + bias.to(cd)
    if activation is not None:
        acc = row_invariant(F.silu, acc)
    finals = windows.index_select(0, last_rows.reshape(-1).to(x.device)).view(N, K - 1, C).transpose(1, 2)
    return acc.to(x.dtype), finals.to(x.dtype).contiguous()


def causal_conv1d_fast(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv on CUDA: ``kernels.short_conv.causal_conv1d_triton`` (one read of x, one write of y;
    same taps bit for bit), or ``causal_conv1d_batched`` where an input is float64 (the Triton
    kernel computes in float32, the reference in float64). Same contract as both."""
    if torch.float64 in (x.dtype, weight.dtype, getattr(bias, "dtype", None)):
        return causal_conv1d_batched(x, weight, cu_seqlens, initial_state, bias, activation)
    return causal_conv1d_triton(x, weight, cu_seqlens, initial_state, bias, activation)


# --------------------------------------------------------------------------------------------
# fla-core (optional, CUDA)


@functools.cache
def fla_available() -> bool:
    """Whether ``fla.ops.gated_delta_rule`` imports (the optional extra ``fla``)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # missing, or broken (no triton, no CUDA libraries)
        return False
    return True


def chunk_gated_delta_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule through fla-core's ``chunk_gated_delta_rule`` (Triton, CUDA), same arguments and
    results as ``chunk_gated_delta_batched``.

    How the arguments map: fla takes packed ``[1, T, H, D]`` inputs with ``cu_seqlens`` (long, on
    the device) and counts chunks from each sequence's start, as we do; grouped value attention is
    native (q, k keep their Hk heads; value head h reads key head ``h // (Hv / Hk)``, our
    ``repeat_interleave`` order). The L2 norm is done here in float32 (``x / sqrt(|x|^2 + 1e-6)``,
    fla's formula) and rounded to the activation dtype, as fla's own in-kernel norm rounds it; it is
    not left to fla because fla's norm kernel is autotuned per token count, which could make a
    sequence's bits depend on the batch. On CUDA it is ``kernels.qk_norm``'s Triton kernel, which
    also hands fla contiguous q, k, v without PyTorch's copies (``fla_inputs``). The scale (default ``Dk^-1/2``) is passed to fla, which
    applies it in the output (``o = scale * q (...)``), the same product as our pre-scaled q up to
    rounding. ``g`` goes in float32, ``beta`` as given; states are float32 ``[N, Hv, Dk, Dv]``.
    Empty sequences are left out of fla's call (their final state is their initial state)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    T, Hv, Dv = v.shape
    Hk, Dk = k.shape[1], k.shape[2]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    bounds = sequence_bounds(cu_seqlens, T)
    finals = initial_states(initial_state, len(bounds), (Hv, Dk, Dv), torch.float32, v.device).clone()
    if T == 0:
        return v.new_zeros((0, Hv, Dv)), finals
    nonempty = [i for i, (a, b) in enumerate(bounds) if b > a]
    cu = [0] + [b for a, b in bounds if b > a]
    q, k, v = fla_inputs(q, k, v, qk_l2norm, triton=q.is_cuda and triton_available())
    h0 = finals if len(nonempty) == len(bounds) else finals[nonempty]
    o, ht = chunk_gated_delta_rule(
        q[None], k[None], v[None], g.float()[None], beta[None],
        scale=Dk**-0.5 if scale is None else scale, initial_state=h0.contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=False, cu_seqlens=host_values_to(cu, torch.long, v.device),  # no host sync
        cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long), chunk_size=chunk_size,
    )
    if len(nonempty) == len(bounds):
        finals = ht.float()
    else:
        finals[nonempty] = ht.float()
    return o[0].to(v.dtype), finals


def fla_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_l2norm: bool,
               triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] (normalised when ``qk_l2norm``) and v [T, Hv, Dv] as fla takes them: in the
    activation dtype (v's when half precision, else float32) and contiguous (fla copies any other
    input). On the rule's usual inputs, strided views of the conv output, ``triton`` reads each
    once and writes it once (``kernels.qk_norm``: the norm in float32, rounded once; one ulp of
    the dtype at most from the PyTorch form); otherwise PyTorch's float32 norm, then casts.

        >>> y = torch.randn(3, 2 * 4 + 2 * 5)  # conv output [T, C]: q, k one head of 4, v two of 5
        >>> q, k, v = y[:, :4].view(3, 1, 4), y[:, 4:8].view(3, 1, 4), y[:, 8:].view(3, 2, 5)
        >>> [t.is_contiguous() for t in fla_inputs(q, k, v, True, triton=False)]
        [True, True, True]
    """
    act = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    if triton:
        v = v if v.is_contiguous() and v.dtype == act else heads_triton(v, act, normalize=False)
        return heads_triton(q, act, qk_l2norm), heads_triton(k, act, qk_l2norm), v
    return heads_reference(q, act, qk_l2norm), heads_reference(k, act, qk_l2norm), v.to(act).contiguous()


# --------------------------------------------------------------------------------------------
# Which kernels


def gated_delta_kernels(device: torch.device | str, deterministic: bool, triton: bool = True,
                        dtype: torch.dtype = torch.bfloat16) -> tuple[Kernel | None, Kernel | None]:
    """``(rule, conv)`` for ``layers.linear_state.packed_gated_delta`` on ``device``; ``None`` means
    "keep the reference" (``layers.gated_delta``'s, which this floor cannot name).

    * CPU: ``(None, None)``, the references (bit-for-bit batch-invariant, the tests' ground truth).
    * CUDA, the conv in both modes: the Triton kernel (``causal_conv1d_fast``) when Triton imports
      and ``triton`` (``Numerics.triton``; False: a benchmark's PyTorch baseline), else the batched
      PyTorch conv. Both give each output element from its own sequence's inputs only (no
      reduction across tokens, no autotuning): batch-invariant by construction.
    * CUDA, default mode: fla-core's Triton rule when it imports, else the batched PyTorch rule.
    * CUDA, deterministic mode: the rule must give a sequence the same bits whatever is packed
      beside it. fla-core's kernels grid per (chunk, head) / (sequence, head) with autotune keys
      that do not depend on the token count (its L2-norm kernel's do, so we normalise ourselves),
      so it is batch-invariant by construction: fla when it imports (checked on an H100: alone =
      packed, bit for bit, in ``bench/gpu_gated_delta.py`` and tests/test_gated_delta_kernels.py).
      The batched PyTorch rule is not used there: its cuBLAS batched GEMMs and batched triangular
      solve pick kernels by batch count. On an H100 (torch 2.11, cu130) it was bit-identical alone
      and packed at Qwen3.5-9B shapes (Hv = 32, 15 sequences), but not at Hv = 8 with 7 short
      sequences. Nor is the reference: its per-sequence batches count the sequence's chunks (on
      an H100 a float32 tiny Qwen3.5 split at 64 vs 257 tokens differed by a few ulp). Without
      fla: ``chunk_gated_delta_fixed``, the batched rule one chunk at a time (fixed shapes).
    * CUDA, float32 activations (``dtype``): never fla. Its products of float32 inputs run in TF32
      (``tl.dot``'s default, and its triangular solve asks for TF32 where the GPU has it): on an
      H200 a tiny Qwen3.5 in float32 was 8.9e-3 from float64 through fla, where the float32 rule
      is exact to ~1e-5. Float32 gets the batched PyTorch rule (default mode; PyTorch keeps float32
      GEMMs in full precision unless told otherwise) or ``chunk_gated_delta_fixed`` (deterministic)."""
    if torch.device(device).type != "cuda":
        return None, None
    conv = causal_conv1d_fast if triton and triton_available() else causal_conv1d_batched
    if fla_available() and dtype in (torch.bfloat16, torch.float16):
        return chunk_gated_delta_fla, conv
    return (chunk_gated_delta_fixed if deterministic else chunk_gated_delta_batched), conv

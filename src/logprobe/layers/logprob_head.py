"""The log-prob head: target log-probs (and entropy, rank, top-k) without a [T, V] tensor.

For each scored row ``i`` with hidden state ``h_i`` and target ``y_i``:

    z_i      = softcap(scale * (W h_i + b)) / temperature_i          # logits, never stored whole
    lse_i    = log sum_v exp(z_iv)                                    # online over vocab chunks
    logprob  = z_{i,y_i} - lse_i
    entropy  = lse_i - sum_v softmax(z_i)_v * z_iv
    rank     = #{v != y_i : z_iv > z_{i,y_i}}                         # 0 <=> greedy
    top-k    = the k largest z_iv - lse_i, merged chunk by chunk

Rows are processed ``token_chunk`` at a time and the vocabulary ``vocab_chunk`` columns at a
time, all in float32, so the extra memory is O(token_chunk * vocab_chunk) whatever T and V are.

The vocabulary is folded into *partials* (max, sum-exp, sum-exp*z, count above the target, top-k)
that ``kernels.logprob_head.combine_head_partials`` folds into the results. Under tensor
parallelism each rank holds a vocabulary shard (``HeadParams.vocab_start``): the target logit
comes from the rank that owns the target row (an exact all-reduce max of one float per row), each
rank folds its shard, and only the partials cross ranks (an all-gather of a few floats per row),
never logits. Deterministic mode folds one partial per chunk of a fixed vocabulary grid
(``HeadParams.grid``, a function of the model only) and combines them in grid order, so a row's
bits are the same whatever the batch and whatever the TP size:

    V = 300, grid 48, TP = 2:  rank 0 chunks 0-3 (ids 0:192), rank 1 chunks 4-6 (ids 192:300)
    partials gathered in rank order = chunks 0..6 in order = what TP = 1 computes
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.logprob_head import (
    ALWAYS_LAUNCHES_TOP_K,
    DEFAULT_CONFIG,
    LAUNCH_ERRORS,
    MAX_TOP_K,
    _check,
    combine_head_partials,
    filling_split,
    fused_head_partials,
    fused_target_logits,
)
from ..parallel.shard import vocab_chunk_width, vocab_shard


@dataclass(slots=True)
class HeadParams:
    """What maps final hidden states to logits: ``softcap(scale * (h @ weight.T + bias))``.

    Under tensor parallelism ``weight`` holds vocabulary ids ``vocab_start .. vocab_start + rows``
    of ``vocab_total``, and ``comm`` is the rank's ``parallel.ParallelContext``."""

    weight: torch.Tensor  # [V_local, H]
    bias: torch.Tensor | None = None  # [V_local]
    scale: float = 1.0
    softcap: float | None = None
    vocab_start: int = 0
    vocab_total: int | None = None  # None: the weight holds the whole vocabulary
    comm: object | None = None  # ParallelContext, None = one rank
    grid: int | None = None  # deterministic vocabulary chunk width; None = vocab_chunk_width(V)

    @property
    def vocab_size(self) -> int:
        return self.vocab_total if self.vocab_total is not None else self.weight.shape[0]

    @property
    def grid_width(self) -> int:
        return self.grid if self.grid is not None else vocab_chunk_width(self.vocab_size)


@dataclass(slots=True)
class HeadOutput:
    logprobs: torch.Tensor  # [N] float32
    logsumexp: torch.Tensor  # [N] float32, of the temperature-scaled logits
    ranks: torch.Tensor  # [N] int64
    entropy: torch.Tensor | None = None  # [N] float32
    topk_ids: torch.Tensor | None = None  # [N, k] int64
    topk_logprobs: torch.Tensor | None = None  # [N, k] float32


def _transform(z: torch.Tensor, b: torch.Tensor | None, p: HeadParams) -> torch.Tensor:
    """Raw dot products -> logits (bias, scale, softcap), in float32."""
    if b is not None:
        z = z + b
    if p.scale != 1.0:
        z = z * p.scale
    if p.softcap is not None:
        z = torch.tanh(z / p.softcap) * p.softcap
    return z


def _kernel_applies(hidden: torch.Tensor, p: HeadParams, top_k: int, deterministic: bool) -> bool:
    if not hidden.is_cuda or top_k > MAX_TOP_K:
        return False
    if deterministic and p.grid_width % DEFAULT_CONFIG.block_n:
        return False  # the kernel's fixed splits are whole tiles: a grid that is not stays on this path
    w = p.weight
    return (triton_available() and w.device == hidden.device and w.dtype == hidden.dtype
            and hidden.stride(-1) == 1 and w.stride(-1) == 1)


def logprob_head(
    hidden: torch.Tensor,
    params: HeadParams,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    top_k: int = 0,
    entropy: bool = False,
    token_chunk: int = 512,
    vocab_chunk: int = 8192,
    deterministic: bool = False,
    backend: str = "auto",
    checked: bool = False,
) -> HeadOutput:
    """hidden [N, H], targets [N] -> HeadOutput. ``temperature`` is a float or a [N] tensor.

    ``deterministic`` (the mode): every row's numbers independent of the other rows and of
    the TP size, bitwise: this loop zero-pads the last token chunk to ``token_chunk`` rows so every
    row goes through identically shaped products, and the vocabulary is folded per chunk of the
    fixed grid, combined in grid order (the kernel splits at the same grid).
    ``backend``: "auto" runs the fused Triton kernel (``logprobe.kernels.logprob_head``) on CUDA
    when it applies (Triton present, top_k <= 256, hidden and weight of one dtype with contiguous
    rows) and this chunked PyTorch loop otherwise; "torch" always runs this loop; "triton"
    requires the kernel. ``checked``: the caller has checked on the host that the targets are in
    [0, V) and the temperatures finite and > 0 (the engine does, from the requests' lists), so
    their reads from the tensors, each a host/device synchronisation on CUDA, are skipped."""
    N, H = hidden.shape
    V = params.vocab_size
    if params.weight.shape[1] != H:
        raise LogprobeError("hidden", f"width {H} does not match the LM head's {params.weight.shape[1]}")
    if targets.shape != (N,):
        raise LogprobeError("targets", f"shape {tuple(targets.shape)} does not match hidden rows {N}")
    if N and not checked and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise LogprobeError("targets", f"ids must be in [0, {V})")
    if top_k < 0 or top_k > V:
        raise LogprobeError("top_k", f"must be in [0, {V}], got {top_k}")
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).expand(N).contiguous()
    if N and not checked and not bool(torch.isfinite(temp).all() and (temp > 0).all()):
        raise LogprobeError("temperature", "must be finite and > 0")
    if backend not in ("auto", "torch", "triton"):
        raise LogprobeError("backend", f"must be auto, torch or triton, got {backend!r}")
    inv_t = 1.0 / temp
    params = _resident_head(params, hidden, top_k, backend)
    kernel = backend == "triton" or (backend == "auto" and _kernel_applies(hidden, params, top_k, deterministic))
    if kernel:
        _check(hidden, params.weight, params.bias, targets, inv_t, top_k)
    parts = None
    split = _split_width(params, N, top_k, deterministic, hidden.device) if kernel else None
    if kernel:
        zy = _target_logits(hidden, params, targets, inv_t, token_chunk, True, deterministic)
        if params.comm is not None:
            params.comm.all_reduce_max(zy)  # one rank owns each target: a max of one finite value and -inf
        try:
            parts = _kernel_partials(hidden, params, targets, zy, inv_t, top_k, entropy, split)
        except LAUNCH_ERRORS as e:
            if backend == "triton" or top_k <= ALWAYS_LAUNCHES_TOP_K:
                raise
            _warn_wide_fallback(e)  # wide top-k's sorts do not fit this GPU: the PyTorch head, exact too
    if parts is None:
        zy = _target_logits(hidden, params, targets, inv_t, token_chunk, False, deterministic)
        if params.comm is not None:
            params.comm.all_reduce_max(zy)
        parts = _torch_partials(hidden, params, targets, zy, inv_t, top_k, entropy, token_chunk, vocab_chunk,
                                deterministic)
    parts = _gather_partials(parts, params, _split_counts(params, split, top_k, deterministic))

    return HeadOutput(*combine_head_partials(zy, *parts, top_k=top_k, deterministic=deterministic))


_warned: list[str] = []


def _warn_wide_fallback(error: BaseException) -> None:
    if not _warned:
        _warned.append(type(error).__name__)
        warnings.warn(f"the fused head's wide top-k did not launch on this GPU ({type(error).__name__}); "
                      "the chunked PyTorch head computes it instead (same numbers, slower)", RuntimeWarning,
                      stacklevel=3)


def _resident_head(params: HeadParams, hidden: torch.Tensor, top_k: int, backend: str) -> HeadParams:
    """A packed LM head (``layers.quant_linear.PackedRows``) on CUDA, where the fused kernel would
    run, as its resident dense copy: the same weight in the same dtype, expanded once instead of
    chunk by chunk in every batch (the chunked head took 7.6x the bare matmul on an H200)."""
    resident = getattr(params.weight, "resident", None)
    if resident is None or backend == "torch" or not hidden.is_cuda or top_k > MAX_TOP_K:
        return params
    weight = resident()
    return params if weight is None else replace(params, weight=weight)


def _local_targets(params: HeadParams, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets in the shard's row numbering, clamped to a valid row, and whether the shard owns them."""
    local = targets - params.vocab_start
    owned = (local >= 0) & (local < params.weight.shape[0])
    return local.clamp(0, params.weight.shape[0] - 1), owned


def _target_logits(hidden, params: HeadParams, targets, inv_t, token_chunk: int, kernel: bool,
                   deterministic: bool = False) -> torch.Tensor:
    """z_{i,y_i} / T_i [N] float32 from the target's own row of W; -inf where another rank owns it.
    ``deterministic``: the PyTorch loop sums zero-padded chunks of ``token_chunk`` rows
    (its row sums are a reduction whose CUDA layout follows the number of rows)."""
    rows, owned = _local_targets(params, targets)
    if kernel:
        zy = fused_target_logits(hidden, params.weight, rows, inv_t, bias=params.bias, scale=params.scale,
                                 softcap=params.softcap)
    else:
        zy = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        bias = params.bias.float() if params.bias is not None else None
        for r0 in range(0, hidden.shape[0], token_chunk):
            r1 = min(r0 + token_chunk, hidden.shape[0])
            y, h = rows[r0:r1], hidden[r0:r1].float()
            prod = h * params.weight[y].float()  # [t, H]
            if deterministic and r1 - r0 < token_chunk:
                prod = F.pad(prod, (0, 0, 0, token_chunk - (r1 - r0)))  # [token_chunk, H]
            z = prod.sum(-1)[: r1 - r0]  # [t]
            zy[r0:r1] = _transform(z, bias[y] if bias is not None else None, params) * inv_t[r0:r1]
    return zy.masked_fill_(~owned, float("-inf"))


def _kernel_partials(hidden, params: HeadParams, targets, zy, inv_t, top_k, entropy, split: int | None):
    local = targets - params.vocab_start  # may fall outside the shard: only compared with columns
    return fused_head_partials(hidden, params.weight, local, zy, inv_t, bias=params.bias, scale=params.scale,
                               softcap=params.softcap, top_k=top_k, entropy=entropy, split=split,
                               vocab_start=params.vocab_start)


def _shard_widths(params: HeadParams) -> list[int]:
    """Every rank's vocabulary rows, in rank order."""
    size = params.comm.size
    return [b - a for a, b in (vocab_shard(params.vocab_size, params.grid_width, r, size) for r in range(size))]


def _split_width(params: HeadParams, N: int, top_k: int, deterministic: bool, device: torch.device) -> int | None:
    """The fused kernel's columns per split: the grid chunk in deterministic mode; one width for
    every rank of a vocabulary-parallel head (sized for the widest shard and the group's smallest
    GPU), so each rank's split count is known to all; None (the kernel fills this GPU) alone."""
    if deterministic:
        return params.grid_width
    if params.comm is None or params.comm.size == 1:
        return None
    return filling_split(max(_shard_widths(params)), N, top_k, params.comm.smallest_sms(device))


def _split_counts(params: HeadParams, split: int | None, top_k: int, deterministic: bool) -> list[int] | None:
    """How many partials each rank's head makes, known on the host: a split of ``split`` columns
    each on the kernel's path (``cdiv(rows, split)``), one on the PyTorch loop in default mode
    (one per grid chunk in deterministic mode); None where only the rank knows (a wide top-k's
    kernel may fall back to the PyTorch loop on one rank): the counts are then exchanged.

    Worked example, V = 300 over 2 ranks in grid chunks of 100 (rows 200 | 100), split 128:
    the kernel makes 2 and 1 partials; the PyTorch loop in default mode 1 and 1."""
    comm = params.comm
    if comm is None or comm.size == 1:
        return None
    width = params.grid_width if deterministic else split
    if width is None:  # the PyTorch loop in default mode: one fold per rank
        return [1] * comm.size
    if not deterministic and top_k > ALWAYS_LAUNCHES_TOP_K:
        return None
    return [-(-w // width) for w in _shard_widths(params)]


def _gather_partials(parts, params: HeadParams, counts: list[int] | None):
    """Every rank's partials, in rank order (= vocabulary order), on every rank: [P_total, N(, K)].
    Ranks may hold different numbers of partials (``counts``, ``_split_counts``): each pads to
    the most, and the padding partials are dropped after the gather. Counts not known on the host
    (None) are exchanged first, which waits for the GPU."""
    comm = params.comm
    if comm is None or comm.size == 1:
        return parts
    if counts is None:
        mine = torch.tensor([parts[0].shape[0]], dtype=torch.int64, device=parts[0].device)
        counts = comm.all_gather(mine).flatten().tolist()  # [size]
    most = max(counts)
    out = []
    for t in parts:
        if t is None:
            out.append(None)
            continue
        if t.shape[0] < most:
            t = torch.cat([t, t.new_zeros((most - t.shape[0], *t.shape[1:]))])
        g = comm.all_gather(t)  # [size, most, N(, K)]
        out.append(torch.cat([g[r, :counts[r]] for r in range(comm.size)]))
    return tuple(out)


def _torch_partials(hidden, params: HeadParams, targets, zy, inv_t, top_k, entropy, token_chunk, vocab_chunk,
                    deterministic: bool):
    """The chunked PyTorch fold of this rank's vocabulary rows: one partial per grid chunk
    (deterministic mode) or one for the whole shard (online max / sum-exp over ``vocab_chunk`` columns)."""
    N, H = hidden.shape
    Vl = params.weight.shape[0]
    step = params.grid_width if deterministic else vocab_chunk
    spans = [(v0, min(v0 + step, Vl)) for v0 in range(0, Vl, step)]
    P = len(spans) if deterministic else 1
    dev = hidden.device
    m = torch.empty(P, N, dtype=torch.float32, device=dev)
    s, a = torch.empty_like(m), (torch.empty_like(m) if entropy else None)
    c = torch.empty(P, N, dtype=torch.int64, device=dev)
    tv = torch.empty(P, N, top_k, dtype=torch.float32, device=dev) if top_k else None
    ti = torch.empty(P, N, top_k, dtype=torch.int64, device=dev) if top_k else None
    bias = params.bias.float() if params.bias is not None else None
    for r0 in range(0, N, token_chunk):
        r1 = min(r0 + token_chunk, N)
        h = hidden[r0:r1]  # [t, H]
        it, yz, yt = inv_t[r0:r1], zy[r0:r1], targets[r0:r1]
        if deterministic and r1 - r0 < token_chunk:
            # every fold runs on token_chunk rows (its reductions over [t, v] are PyTorch's, whose
            # layout follows the shape): padding rows are zeros with T = 1 and no target
            pad = token_chunk - (r1 - r0)
            h = F.pad(h, (0, 0, 0, pad))  # [token_chunk, H]
            it, yz = F.pad(it, (0, pad), value=1.0), F.pad(yz, (0, pad))
            yt = F.pad(yt, (0, pad), value=params.vocab_start - 1)  # a column of no chunk
        fold = _Fold(h.shape[0], top_k, entropy, dev)
        for p, (v0, v1) in enumerate(spans):
            z = _transform(_dots(h, params.weight[v0:v1]), bias[v0:v1] if bias is not None else None, params)
            fold.add(z * it[:, None], yz, yt - params.vocab_start - v0, params.vocab_start + v0)
            if deterministic:
                fold.write(p, r0, r1, m, s, a, c, tv, ti)
                fold = _Fold(h.shape[0], top_k, entropy, dev)
        if not deterministic:
            fold.write(0, r0, r1, m, s, a, c, tv, ti)
    return m, s, a, c, tv, ti


def _dots(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h [t, H] @ w [v, H]^T`` in float32. 16-bit inputs on CUDA stay 16-bit into the tensor
    cores with float32 accumulation and output (a product of two bf16/fp16 numbers is exact in
    float32, as in the fused kernel); a float32 GEMM there runs at a tenth of the speed. Elsewhere
    the inputs are widened to float32 first."""
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and w.dtype == h.dtype:
        try:
            return torch.mm(h, w.T, out_dtype=torch.float32)
        except torch.OutOfMemoryError:  # the engine's to split and retry
            raise
        except (TypeError, RuntimeError):  # a torch without mm's out_dtype
            pass
    return h.float() @ w.float().T


def chunk_topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row of z [t, v] and their columns, larger first and equal
    values by smaller column (at a tie on the k-th value the smaller columns are kept), without
    sorting the chunk: ``topk`` finds the k-th value, the ties at it are taken in column order.

    >>> chunk_topk(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), 2)
    (tensor([[2., 2.]]), tensor([[1, 2]]))
    """
    kth = z.topk(k, dim=1).values[:, -1:]  # [t, 1]
    above, tie = z > kth, z == kth  # [t, v]
    sel = above | (tie & (tie.cumsum(1) <= k - above.sum(1, keepdim=True)))
    if int(sel.sum()) != z.shape[0] * k:  # only NaN logits make the count differ
        raise LogprobeError("hidden", "the logits hold NaN: top-k is undefined", "check the model's weights")
    cols = sel.nonzero()[:, 1].view(z.shape[0], k)  # [t, k] ascending columns
    vals, order = z.gather(1, cols).sort(dim=1, descending=True, stable=True)
    return vals, cols.gather(1, order)


class _Fold:
    """Running (max, sum-exp, sum-exp*z, count above target, top-k) of some rows over vocabulary chunks."""

    def __init__(self, t: int, top_k: int, entropy: bool, dev) -> None:
        self.m = torch.full((t,), -torch.inf, device=dev)
        self.s = torch.zeros(t, device=dev)
        self.a = torch.zeros(t, device=dev) if entropy else None
        self.c = torch.zeros(t, dtype=torch.int64, device=dev)
        self.top_k = top_k
        self.best_z = self.best_id = None

    def add(self, z: torch.Tensor, zy: torch.Tensor, y_col: torch.Tensor, first_id: int) -> None:
        """z [t, v] logits of vocabulary ids first_id.. ; y_col: each row's target column in z (any int)."""
        m_new = torch.maximum(self.m, z.max(dim=1).values)
        alpha = torch.exp(self.m - m_new)  # rescales what was summed under the old max
        e = torch.exp(z - m_new[:, None])  # [t, v]
        self.s = self.s * alpha + e.sum(dim=1)
        if self.a is not None:
            self.a = self.a * alpha + (e * z).sum(dim=1)
        self.m = m_new
        above = z > zy[:, None]  # [t, v]
        # the target never outranks itself: its column cleared where it lies in this chunk, by a
        # scatter over every row (a nonzero() of the rows would synchronise with the GPU per chunk)
        inside = (y_col >= 0) & (y_col < z.shape[1])  # [t]
        col = y_col.clamp(0, z.shape[1] - 1)[:, None]  # [t, 1]
        above.scatter_(1, col, above.gather(1, col) & ~inside[:, None])
        self.c += above.sum(dim=1)
        if self.top_k:
            cz, ci = chunk_topk(z, min(self.top_k, z.shape[1]))  # [t, k]
            ci = ci + first_id
            if self.best_z is not None:  # earlier chunks hold smaller ids: a stable sort keeps the tie order
                cz, sel = torch.cat([self.best_z, cz], 1).sort(dim=1, descending=True, stable=True)
                ci = torch.cat([self.best_id, ci], 1).gather(1, sel[:, :self.top_k])
                cz = cz[:, :self.top_k]
            self.best_z, self.best_id = cz, ci

    def write(self, p: int, r0: int, r1: int, m, s, a, c, tv, ti) -> None:
        """Rows r0:r1 of partial p from this fold's first r1 - r0 rows (the rest are padding)."""
        n = r1 - r0
        m[p, r0:r1], s[p, r0:r1], c[p, r0:r1] = self.m[:n], self.s[:n], self.c[:n]
        if a is not None:
            a[p, r0:r1] = self.a[:n]
        if tv is not None:
            k = self.best_z.shape[1]
            tv[p, r0:r1, :k], ti[p, r0:r1, :k] = self.best_z[:n], self.best_id[:n]
            tv[p, r0:r1, k:], ti[p, r0:r1, k:] = -torch.inf, 0  # a chunk narrower than k

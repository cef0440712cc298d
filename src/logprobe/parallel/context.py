"""A rank's view of its tensor-parallel group: who it is, and the collectives the parallel layers
call in their ``forward``. With ``size == 1`` every collective is the identity, so a model built
for one rank runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Pending:
    """A collective started without waiting (``ParallelContext.all_gather_start``,
    ``reduce_scatter_start``): ``wait()`` -> its result. On NCCL the caller's stream then waits on
    the communicator's; the host does not, so kernels launched between the start and the wait run
    beside the transfer."""

    __slots__ = ("out", "work")

    def __init__(self, out: torch.Tensor, work=None) -> None:
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def tree_positions(size: int) -> list[int]:
    """Which rank's row block sits at each block position of a ``tree_reduce_scatter_start`` input:
    the bit-reversed order, so that every halving step swaps one contiguous half.

    >>> tree_positions(1), tree_positions(2), tree_positions(4), tree_positions(8)
    ([0], [0, 1], [0, 2, 1, 3], [0, 4, 2, 6, 1, 5, 3, 7])
    """
    bits = size.bit_length() - 1
    return [int(format(p, f"0{bits}b")[::-1], 2) if bits else 0 for p in range(size)]


class TreePending:
    """A started ``tree_reduce_scatter_start``: its first halving step is under way; ``wait()`` ->
    this rank's block. On CUDA every later step (wait for the swap, add, swap again) is launched at
    once on a side stream (``ParallelContext.side_stream``), so the steps run beside the compute
    stream's next kernels and ``wait()`` only makes the compute stream wait for the last add; on
    CPU they run in ``wait()``."""

    __slots__ = ("pending", "ctx", "held", "out", "step", "work", "recv", "side")

    def __init__(self, pending: Pending | None, ctx=None, x: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> None:
        self.pending, self.ctx, self.held, self.out, self.step, self.side = pending, ctx, x, out, 0, None
        if pending is None:
            self._swap()
            if x.is_cuda:
                self.side = ctx.side_stream(x.device)
                for t in (x, self.recv) + (() if out is None else (out,)):
                    t.record_stream(self.side)  # read or written there: not reused before it has
                self.side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(self.side):
                    self._finish()

    def _swap(self) -> None:
        """Send the half of ``held`` the partner keeps, receive the partner's copy of ours."""
        import torch.distributed as dist

        ctx, half = self.ctx, self.held.shape[0] // 2
        partner = ctx.rank ^ (1 << self.step)
        mine = (ctx.rank >> self.step) & 1  # 0: this rank keeps the first half
        keep, give = (self.held[:half], self.held[half:]) if mine == 0 else (self.held[half:], self.held[:half])
        self.recv = torch.empty_like(keep)
        peer = dist.get_global_rank(ctx.group, partner) if ctx.group is not None else partner
        ops = [dist.P2POp(dist.isend, give.contiguous(), peer, ctx.group),
               dist.P2POp(dist.irecv, self.recv, peer, ctx.group)]
        self.work, self.held = dist.batch_isend_irecv(ops), keep

    def _finish(self) -> None:
        """Every remaining step: wait for the swap, add (partner's subtree and ours: the same bits
        on both, a + b = b + a), swap again; the last sum into ``out`` if given."""
        while True:
            for w in self.work:
                w.wait()
            self.step += 1
            last = (1 << self.step) >= self.ctx.size
            if last and self.out is not None:
                self.held = torch.add(self.held, self.recv, out=self.out)
                return
            self.held = self.held + self.recv
            if last:
                return
            self._swap()

    def wait(self) -> torch.Tensor:
        if self.pending is not None:
            return self.pending.wait()
        if self.side is None:  # CPU: the steps run now
            self._finish()
        else:
            compute = torch.cuda.current_stream(self.held.device)
            compute.wait_stream(self.side)
            self.held.record_stream(compute)
        return self.held


@dataclass(slots=True)
class ParallelContext:
    """rank/size within the tensor-parallel group; ``group`` is a torch.distributed process group
    (None with one rank). ``blocks``: deterministic mode's column block count (``S``,
    ``shard.num_blocks``): a layer's output columns are computed in S blocks of one width.
    ``experts``: the expert-parallel size M (``layers.moe``): rank r holds the experts of group
    ``r // (size / M)`` and, within it, share ``r % (size / M)`` of each of their rows.
    ``attention``: how attention, norms and dense MLPs split over the group: ``"tensor"`` (by
    heads and columns, every row on every rank) or ``"data"`` (whole on every rank, each rank
    running its share of the batch's sequences: ``parallel.rows``; mixtures of experts with whole
    experts per rank). ``placement``: replicas of hot experts on other ranks (``parallel.placement``).

    >>> ParallelContext(3, 4, experts=2).expert_group, ParallelContext(3, 4, experts=2).expert_share
    (1, (1, 2))
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    blocks: int = 1
    experts: int = 1  # expert parallelism: the experts in this many groups over the ranks (divides size)
    attention: str | None = None  # "tensor" or "data" (see above); None: the model's default, which
    # ``loading.loader.parallel_context`` resolves (a context built without it splits by heads)
    placement: object | None = None  # ``parallel.placement.Placement``: redundant copies of hot experts
    # (whole experts per rank), the same on every rank; None: each expert on its owner alone
    sms: int = 0  # the group's fewest multiprocessors per GPU once asked (``smallest_sms``); 0: not yet
    streams: dict = field(default_factory=dict, repr=False, compare=False)  # ``side_stream`` per device

    @property
    def data_attention(self) -> bool:
        """Attention and dense layers whole on every rank, each rank on its share of the rows."""
        return self.attention == "data" and self.size > 1

    @property
    def attention_ctx(self) -> ParallelContext:
        """The context attention, norms, dense MLPs and shared experts are built with: this one, or
        under data-parallel attention one rank with this model's column blocks (whole layers whose
        deterministic products keep one process's shapes)."""
        return ParallelContext(blocks=self.blocks) if self.data_attention else self

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def expert_group(self) -> int:
        """Which of the ``experts`` groups of experts this rank holds (ranks in order, ``size /
        experts`` consecutive ranks per group)."""
        return self.rank // (self.size // self.experts)

    @property
    def expert_share(self) -> tuple[int, int]:
        """(p, P): within its expert group this rank holds share p of P of each expert's rows
        (tensor parallelism of experts; P = size / experts, 1 under pure expert parallelism)."""
        per = self.size // self.experts
        return self.rank % per, per

    def side_stream(self, device: torch.device):
        """A CUDA stream of this rank's, beside the compute stream, for the steps of a collective
        built from several (``tree_reduce_scatter_start``); one per device, made on first use."""
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def smallest_sms(self, device: torch.device) -> int:
        """The fewest multiprocessors of any rank's GPU (4 on CPU), asked of the group once (a
        collective: every rank calls it at the same point) and kept: what the vocabulary-parallel
        head sizes its splits by, so that every rank knows every rank's split count."""
        if self.sms == 0:
            mine = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
            if self.size > 1:
                mine = int(self.all_gather(torch.tensor([mine], device=device)).min())
            self.sms = mine
        return self.sms

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """In place across ranks, order left to the backend: exact only where at most one rank
        adds a non-zero (the vocabulary-parallel embedding, ``layers.embedding``)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def sum_rows(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float32 partials [T, H], one per rank -> their sum [T, H] rounded once to ``dtype``, the
        same bits on every rank: a reduce-scatter of row blocks in float32 (rank r sums rows block
        r; T padded to a multiple of the size here unless the caller made it one, which saves the
        copy), each rank rounds its block, then an all-gather in
        ``dtype``. Traffic per rank (N ranks): (N-1)/N of T·H float32 plus (N-1)/N of T·H in
        ``dtype``, against (N-1)/N · 2 of T·H float32 for an all-reduce, and with one rounding.
        The order of the float32 sum is the backend's: default mode only."""
        if self.size == 1:
            return partial.to(dtype)
        T, H = partial.shape
        per = -(-T // self.size)  # rows per rank's block
        if per * self.size != T:
            partial = torch.cat([partial, partial.new_zeros(per * self.size - T, H)])  # [size * per, H]
        block = self.reduce_scatter_sum(partial)  # [per, H] float32: this rank's rows, summed
        return self.all_gather(block.to(dtype)).view(per * self.size, H)[:T]  # [T, H]

    def reduce_scatter_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x [size * n, *] on every rank -> block ``rank`` [n, *] of their sum (order: the backend's)."""
        return self.reduce_scatter_start(x).wait()

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Exact in any order (a max never rounds)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [*] on every rank -> [size, *] in rank order."""
        return self.all_gather_start(x).wait()

    def all_gather_start(self, x: torch.Tensor) -> Pending:
        """``all_gather`` started: ``wait()`` -> [size, *] in rank order."""
        if self.size == 1:
            return Pending(x.unsqueeze(0))
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # ranks concatenated along dim 0
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return Pending(out.view(self.size, *x.shape), gather(out, x, group=self.group, async_op=True))

    def reduce_scatter_start(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        """``reduce_scatter_sum`` started: ``wait()`` -> block ``rank`` of the sum (written to
        ``out``, a contiguous tensor of the block's shape, if given)."""
        if self.size == 1:
            return Pending(x if out is None else out.copy_(x))
        import torch.distributed as dist

        block = x.new_empty((x.shape[0] // self.size, *x.shape[1:])) if out is None else out
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # the newer name
        return Pending(block, scatter(block, x.contiguous(), op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def tree_reduce_scatter_start(self, x: torch.Tensor, out: torch.Tensor | None = None) -> TreePending:
        """Deterministic mode's reduce-scatter: x [size * n, *] float32, row blocks in the order of
        ``tree_positions(size)`` (block position p holds rank ``tree_positions(size)[p]``'s rows) ->
        rank r's block of the sum over ranks, added as a fixed tree of ranks, neighbours first
        (``((x0 + x1) + (x2 + x3)) + ...``): the order ``kernels.moe.combine_leaves`` adds its
        leaves in, so that ranks holding consecutive leaves finish the one-process tree. Recursive
        halving: at step s each rank swaps half of what it holds with rank ``r ^ 2**s`` and adds
        (a + b = b + a: both get the same bits). Traffic per rank: (size - 1) / size of x, as a
        ring's. ``size`` a power of two."""
        if self.size & (self.size - 1):
            raise ValueError(f"a tree reduce-scatter needs a power-of-two group, got {self.size}")
        if self.size <= 2:  # one addition per element: any order is the tree's
            return TreePending(self.reduce_scatter_start(x, out))
        return TreePending(None, self, x.contiguous(), out)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """x [sum(send), *], its first send[0] rows for rank 0, the next send[1] for rank 1, ... ->
        [sum(recv), *]: recv[q] rows from rank q, in rank order (copies: exact). Every rank must
        know what it receives (``recv``) without asking."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, n], this rank's columns -> [T, size * n], the ranks' columns side by side in rank
        order (an exact copy: no arithmetic, hence the same bits at every TP size)."""
        if self.size == 1:
            return x
        g = self.all_gather(x)  # [size, T, n]
        return g.permute(1, 0, 2).reshape(x.shape[0], -1)  # [T, size * n]

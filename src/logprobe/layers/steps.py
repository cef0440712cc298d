"""Layers as generators that yield where a transfer they started runs (two-batch overlap).

Under data-parallel attention a mixture-of-experts layer gathers every rank's rows, runs its
experts and reduce-scatters their sums (``layers.moe.Experts.split_steps``). Written as a
generator, the layer yields right after starting each transfer; ``interleave`` runs two
micro-batches' generators in turn, so that while one micro-batch's rows travel the other's
attention or experts are launched on the compute stream: the transfers run beside compute
instead of before it. One micro-batch alone (``drive``) launches the same kernels in the same
order as the plain forward. Every rank interleaves in the same order, so the collectives match.

    A: attn, gather start | B: attn, gather start | A: experts, sum start | B: experts, sum start
    | A: wait sum, next block's attn, gather start | ...
"""

from __future__ import annotations

from collections.abc import Generator


def drive(steps: Generator):
    """Run a generator of steps to its end -> its return value.

    >>> def g():
    ...     yield
    ...     return 3
    >>> drive(g())
    3
    """
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def interleave(*chains: Generator) -> list:
    """Run generators one step each in turn until all have returned -> their return values.

    >>> def g(name, n, log):
    ...     for i in range(n):
    ...         log.append(f"{name}{i}")
    ...         yield
    ...     return name
    >>> log = []
    >>> interleave(g("a", 2, log), g("b", 3, log)), log
    (['a', 'b'], ['a0', 'b0', 'a1', 'b1', 'b2'])
    """
    out, live = [None] * len(chains), list(range(len(chains)))
    while live:
        for i in list(live):
            try:
                next(chains[i])
            except StopIteration as done:
                out[i] = done.value
                live.remove(i)
    return out

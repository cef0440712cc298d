"""Planning batches: requests under a token budget, shared-prefix trees, chunks of long requests.

Pure functions of the token ids and the budget (pinned by gold tables in the tests)."""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.rows import balanced_order, pair_count, row_cost


def plan_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group request indices into batches whose summed lengths fit ``max_batch_tokens``.

    Longest first (first-fit decreasing into the current batch): long requests meet the budget
    alone, short ones fill the rest. A request longer than the budget gets a batch of its own.
    Ties keep input order, so the plan is a deterministic function of the lengths.

    >>> plan_batches([3, 9, 4, 2, 5], 10)
    [[1], [4, 2], [0, 3]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > max_batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


# -- shared prefixes and chunks ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tree:
    """Requests ``members`` (indices, ascending) whose first ``shared`` input tokens are equal.

    Those ``shared`` rows run once (the prefix segment); each member's remaining inputs form its
    branch, which sees the prefix in full and itself causally, at positions continuing from it.
    ``shared == 0``: no prefix segment (a lone request, or requests packed side by side).
    """

    members: tuple[int, ...]
    shared: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """Input rows ``begin:end`` of request ``request``, whose inputs exceed the batch budget.

    Chunks of a request run in order, each alone in its batch; rows before ``begin`` are seen
    through the KV cache that the earlier chunks filled.
    """

    request: int
    begin: int
    end: int


def common_prefix(a: list[int], b: list[int], block: int = 256) -> int:
    """How many leading tokens a and b share: whole blocks compared as slices (in C), then the
    first differing block token by token (the planner calls this for every pair of neighbours).

    >>> common_prefix([1, 2, 3, 4], [1, 2, 5], block=2), common_prefix([1, 2], [1, 2, 3]), common_prefix([], [1])
    (2, 2, 0)
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + block] == b[i:i + block]:
        i += block
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def share_prefixes(inputs: list[list[int]], min_shared: int) -> list[Tree]:
    """Group requests (their input token ids) into one-level prefix trees, in first-member order.

    Requests are sorted by their ids, so those with long common prefixes are neighbours; walking
    that order, a request joins the current group when the group keeps at least ``min_shared``
    common tokens and the tokens saved do not drop (``n * new >= (n - 1) * old`` for a group of
    ``n``), otherwise it starts a new group. Deterministic in the ids (ties keep input order).

    >>> share_prefixes([[1, 2, 3, 4], [9, 9], [1, 2, 3, 5, 6]], 2)
    [Tree(members=(0, 2), shared=3), Tree(members=(1,), shared=0)]
    """
    order = sorted(range(len(inputs)), key=lambda i: (inputs[i], i))
    groups: list[tuple[list[int], int]] = []
    current: list[int] = []
    shared = 0
    for i in order:
        if current:
            new = min(common_prefix(inputs[current[-1]], inputs[i]), shared if len(current) > 1 else len(inputs[i]))
            if new >= min_shared and len(current) * new >= (len(current) - 1) * shared:
                current.append(i)
                shared = new
                continue
            groups.append((current, shared))
        current, shared = [i], 0
    if current:
        groups.append((current, shared))
    trees = [Tree(tuple(sorted(m)), s if len(m) > 1 else 0) for m, s in groups]
    return sorted(trees, key=lambda t: t.members[0])


def tree_cost(tree: Tree, lengths: list[int]) -> int:
    """Rows the tree feeds: the prefix once, then each member's own inputs."""
    return tree.shared + sum(lengths[m] - tree.shared for m in tree.members)


def tree_pairs(tree: Tree, lengths: list[int]) -> int:
    """(query, key) pairs the tree's rows read (``parallel.rows.pair_count``): the prefix's own,
    then each member's rows over the prefix and themselves (4 rows: 10; 6 - 4 rows over them: 11; 5 - 4: 5).

    >>> tree_pairs(Tree((0, 1), 4), [6, 5]), tree_pairs(Tree((2,)), [6, 5, 3])
    (26, 6)
    """
    p = tree.shared
    return pair_count(p, 0) + sum(pair_count(lengths[m] - p, p) for m in tree.members)


def aligned_trees(trees: list[Tree], align: int, min_shared: int) -> list[Tree]:
    """Trees whose prefix ends at a multiple of ``align`` rows: each prefix is cut down to one, and
    a tree whose prefix falls below ``max(min_shared, 1)`` rows so becomes lone requests.

    >>> aligned_trees([Tree((0, 1), 150), Tree((2, 3), 40), Tree((4,))], 64, 16)
    [Tree(members=(0, 1), shared=128), Tree(members=(2,), shared=0), Tree(members=(3,), shared=0), Tree(members=(4,), shared=0)]
    """
    out: list[Tree] = []
    for t in trees:
        shared = t.shared - t.shared % align
        if len(t.members) > 1 and shared >= max(min_shared, 1):
            out.append(Tree(t.members, shared))
        else:
            out.extend(Tree((m,)) for m in t.members)
    return out


def chunk_bounds(length: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """Rows ``[begin, end)`` of a long request's chunks: ``size`` rows each (cut down to a multiple
    of ``align``, at least ``align``), the last one shorter, so every cut falls on a multiple of
    ``align`` from the sequence start.

    >>> chunk_bounds(300, 100, 64)
    [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    >>> chunk_bounds(7, 6)
    [(0, 6), (6, 7)]
    """
    step = max(align, size - size % align)
    return [(b, min(b + step, length)) for b in range(0, length, step)]


def plan_work(inputs: list[list[int]], max_batch_tokens: int, share: bool = True, min_shared: int = 16,
              chunk: bool = True, unshared: set[int] | frozenset[int] = frozenset(),
              align: int = 1, ranks: int = 1, pair_weight: int = 0) -> list[list[Tree | Chunk]]:
    """The engine's plan: batches of prefix trees (each under ``max_batch_tokens`` rows), then the
    chunks of requests whose inputs exceed it, one chunk per batch. Requests in ``unshared``
    (steered ones) join no tree.

    A tree over the budget is split into sub-trees that fit (members in order, each repeating
    the prefix); a member that does not fit even with the prefix alone runs unshared. With
    ``chunk=False`` (models without KV-cache support) a long request runs whole, alone.

    ``align``: the model's cut granularity (``ModelCaps.state_align``; 64 for the chunked linear
    attention of the hybrid families): shared prefixes and chunk boundaries fall on multiples of
    it from the sequence start, so a cut changes no bit (``layers.linear_state``).

    ``ranks``: the ranks of data-parallel attention (``parallel.rows``), each running a share of a
    batch's rows cut between its trees: each batch's trees in ``balanced_order`` of their rows
    (the same trees in another order: deterministic mode keeps its bits; the busiest rank's
    share is smaller), and a tree or a chunk holds at most ``max_batch_tokens // ranks`` rows (a
    tree is never cut between ranks and a chunk runs whole on every rank: neither may hold more
    rows than a rank's share). ``pair_weight``: the order balances rows and attention pairs
    (``parallel.rows.row_cost``, the model's ``attention_pair_weight``; 0: rows alone).

    >>> plan_work([[1, 2, 3], [1, 2, 4], [5] * 7], 6, min_shared=2)
    [[Tree(members=(0, 1), shared=2)], [Chunk(request=2, begin=0, end=6)], [Chunk(request=2, begin=6, end=7)]]
    >>> plan_work([[1, 2, 3], [1, 2, 4], [5] * 7], 6, min_shared=2, align=4)
    [[Tree(members=(0,), shared=0), Tree(members=(1,), shared=0)], [Chunk(request=2, begin=0, end=4)], [Chunk(request=2, begin=4, end=7)]]
    """
    lengths = [len(x) for x in inputs]
    if share:
        sharable = [i for i in range(len(inputs)) if i not in unshared]
        trees = [Tree(tuple(sharable[m] for m in t.members), t.shared)
                 for t in share_prefixes([inputs[i] for i in sharable], min_shared)]
        if align > 1:
            trees = aligned_trees(trees, align, min_shared)
        trees = sorted(trees + [Tree((i,)) for i in sorted(unshared)], key=lambda t: t.members[0])
    else:
        trees = [Tree((i,)) for i in range(len(inputs))]
    limit = max(1, max_batch_tokens // ranks)  # a tree's rows or a chunk: at most a rank's share
    units, long = fitted_units(trees, lengths, limit, chunk)
    costs = [tree_cost(u, lengths) for u in units]
    batches: list[list[Tree | Chunk]] = []
    work = [row_cost(c, tree_pairs(u, lengths), pair_weight) for u, c in zip(units, costs)] if pair_weight else costs
    for b in plan_batches(costs, max_batch_tokens):
        batches.append([units[b[j]] for j in balanced_order([work[i] for i in b], ranks)])
    for m in sorted(long):
        batches.extend([Chunk(m, b, e)] for b, e in chunk_bounds(lengths[m], limit, align))
    return batches


def fitted_units(trees: list[Tree], lengths: list[int], limit: int, chunk: bool) -> tuple[list[Tree], list[int]]:
    """(units of at most ``limit`` rows, requests to run in chunks): a tree over the limit split
    into sub-trees that fit (members in order, each repeating the prefix); a member that does not
    fit even with the prefix alone runs unshared, or in chunks (``chunk``) if it exceeds the limit.

    >>> fitted_units([Tree((0, 1, 2), 4), Tree((3,))], [9, 8, 7, 20], 14, True)
    ([Tree(members=(0, 1), shared=4), Tree(members=(2,), shared=0)], [3])
    """
    units: list[Tree] = []
    long: list[int] = []
    for t in trees:
        if tree_cost(t, lengths) <= limit:
            units.append(t)
            continue
        group: list[int] = []
        for m in t.members:
            if t.shared == 0 or lengths[m] > limit:  # does not fit even with the prefix alone
                if lengths[m] > limit and chunk:
                    long.append(m)
                else:
                    units.append(Tree((m,)))
                continue
            if group and tree_cost(Tree(tuple(group + [m]), t.shared), lengths) > limit:
                units.append(Tree(tuple(group), t.shared) if len(group) > 1 else Tree((group[0],)))
                group = []
            group.append(m)
        if group:
            units.append(Tree(tuple(group), t.shared) if len(group) > 1 else Tree((group[0],)))
    return units, long

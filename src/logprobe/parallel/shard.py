"""Index arithmetic of tensor parallelism: which rows, heads, slices and vocabulary chunks a rank
owns. Pure functions of integers, pinned by gold tables in ``tests/test_parallel_shard.py``.

Worked example: a model with 4 query heads, 2 kv heads, head_dim 16, intermediate 128 and a
vocabulary of 300, at TP = 2 (``S`` = 4 slices, see ``num_slices``):

    rank            :        0              1
    q heads         :      0, 1           2, 3          (column-parallel q_proj rows 0:32 | 32:64)
    kv heads        :       0              1            (group size 2: q heads 0,1 read kv head 0)
    o_proj inputs   :   slices 0, 1     slices 2, 3      (16 columns each = one head)
    gate/up rows    :     0:64           64:128
    down inputs     :   slices 0, 1     slices 2, 3      (32 columns each)
    vocab chunks    :    0, 1, 2, 3      4, 5, 6          (48 ids each; chunk 6 is 12 ids: 288:300)
    vocab rows      :      0:192         192:300

At TP = 4 with 2 kv heads, ranks 0 and 1 both hold kv head 0 (replicated), ranks 2 and 3 kv head 1.
"""

from __future__ import annotations

from ..errors import LogprobeError

MAX_SLICES = 8  # deterministic mode is TP-invariant for every TP size dividing the model's slice count


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Balanced contiguous split of ``n`` items: the first ``n % size`` ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def check_tp(num_heads: int, num_kv_heads: int, vocab_chunks: int, size: int) -> None:
    """A TP size the model can be split by: it divides the query heads, divides the kv heads or is
    a multiple of them (then kv heads are replicated), and leaves every rank a vocabulary chunk."""
    if size < 1:
        raise LogprobeError("tensor_parallel_size", f"must be >= 1, got {size}")
    if num_heads % size:
        raise LogprobeError("tensor_parallel_size", f"{size} does not divide the {num_heads} attention heads",
                            f"use a size dividing {num_heads}")
    if num_kv_heads % size and size % num_kv_heads:
        raise LogprobeError("tensor_parallel_size", f"{size} neither divides nor is a multiple of the "
                            f"{num_kv_heads} key/value heads", "use a size that divides them or a multiple of them")
    if vocab_chunks < size:
        raise LogprobeError("tensor_parallel_size", f"{size} ranks exceed the {vocab_chunks} vocabulary chunks "
                            "of the log-prob head", "use fewer ranks")


def q_heads(num_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The query heads of a rank: [start, end)."""
    per = num_heads // size
    return rank * per, (rank + 1) * per


def kv_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The kv heads a rank's query heads read: [start, end). Replicated when size > num_kv_heads."""
    group = num_heads // num_kv_heads  # query heads per kv head
    q0, q1 = q_heads(num_heads, rank, size)
    return q0 // group, (q1 - 1) // group + 1


def num_slices(*widths: int) -> int:
    """Deterministic mode's inner-dimension slice count ``S``: the largest power of two <= 8 that
    divides every width given (query heads and intermediate size). A row-parallel product is the
    sum of ``S`` slice products combined by ``tree_order``, whatever the TP size (TP must divide S)."""
    s = MAX_SLICES
    while s > 1 and any(w % s for w in widths):
        s //= 2
    return s


def vocab_chunk_width(vocab: int, max_chunk: int = 8192, min_chunks: int = 8, align: int = 16) -> int:
    """Width of the head's fixed vocabulary grid (a function of the model only, never of the TP
    size): at most ``max_chunk``, small enough for ``min_chunks`` chunks, a multiple of ``align``."""
    want = -(-vocab // min_chunks)
    return min(max_chunk, -(-want // align) * align)


def vocab_shard(vocab: int, chunk: int, rank: int, size: int) -> tuple[int, int]:
    """The vocabulary ids [start, end) of a rank: whole chunks of the fixed grid, balanced."""
    chunks = -(-vocab // chunk)
    c0, c1 = shard_range(chunks, rank, size)
    return min(vocab, c0 * chunk), min(vocab, c1 * chunk)


def tree_order(n: int) -> list[tuple[int, int]]:
    """Pairwise summation of ``n`` (a power of two) partials as a list of (into, from) steps:
    level by level, ``p[i] += p[i + step]``. A rank holding a power-of-two run of consecutive
    leaves computes a whole subtree, so TP ranks reduce locally and combine the rank totals
    with the top of the same tree: the same additions in the same order at every TP size.

        n = 4:  (0, 1), (2, 3), (0, 2)   i.e. (p0 + p1) + (p2 + p3)
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"tree_order needs a power of two, got {n}")
    steps = []
    step = 1
    while step < n:
        steps.extend((i, i + step) for i in range(0, n, 2 * step))
        step *= 2
    return steps

"""Index arithmetic of tensor parallelism: which rows, heads, blocks and vocabulary chunks a rank
owns. Pure functions of integers, pinned by gold tables in ``tests/test_parallel_shard.py``.

Worked example: a model with hidden size 64, 4 query heads, 2 kv heads, head_dim 16,
intermediate 128 and a vocabulary of 300, at TP = 2 (``S`` = 4 column blocks, see ``num_blocks``):

    rank            :        0              1
    q heads         :      0, 1           2, 3          (column-parallel q_proj rows 0:32 | 32:64)
    kv heads        :       0              1            (group size 2: q heads 0,1 read kv head 0)
    gate/up rows    :     0:64           64:128         (blocks of 32 rows: 0, 1 | 2, 3)
    o_proj / down   :     0:32           32:64          (rows of the output: every rank gathers
                                                         the whole input, each computes its outputs)
    vocab chunks    :    0, 1, 2, 3      4, 5, 6        (48 ids each; chunk 6 is 12 ids: 288:300)
    vocab rows      :      0:192         192:300

At TP = 4 with 2 kv heads, ranks 0 and 1 both hold kv head 0 (replicated), ranks 2 and 3 kv head 1.
"""

from __future__ import annotations

from ..errors import LogprobeError

MAX_BLOCKS = 8  # deterministic mode is TP-invariant for every TP size dividing the model's block count


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


def num_blocks(*widths: int) -> int:
    """Deterministic mode's column block count ``S``: the largest power of two <= 8 that divides
    every width given (query heads, hidden and intermediate sizes). A layer's output columns are
    computed in blocks of width / S, each a product of one shape, so a column's bits do not
    depend on how many columns its rank holds (TP must divide S)."""
    s = MAX_BLOCKS
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


def check_experts(num_experts: int, intermediate: int, hidden: int, size: int, experts: int) -> None:
    """An expert-parallel size ``experts`` (M) for ``size`` ranks: M divides the ranks and the
    experts; the ``size / M`` ranks of a group split each expert's intermediate and hidden rows,
    so that share must divide both.

    >>> check_experts(8, 32, 64, 4, 3)
    Traceback (most recent call last):
    ...
    logprobe.errors.LogprobeError: expert_parallel_size: 3 does not divide the 4 ranks (tensor_parallel_size); use a divisor of 4
    """
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise LogprobeError("expert_parallel_size", f"must be a positive integer, got {experts!r}")
    if size % experts:
        raise LogprobeError("expert_parallel_size", f"{experts} does not divide the {size} ranks (tensor_parallel_size)",
                            f"use a divisor of {size}")
    if num_experts % experts:
        raise LogprobeError("expert_parallel_size", f"{experts} does not divide the {num_experts} experts",
                            f"use a divisor of both {num_experts} and {size}")
    per = size // experts
    for what, n in (("expert intermediate size", intermediate), ("hidden size", hidden)):
        if n % per:
            raise LogprobeError("expert_parallel_size", f"{size} ranks in {experts} expert groups split each expert "
                                f"{per} ways, which does not divide the {what} {n}",
                                "use expert_parallel_size = tensor_parallel_size (whole experts per rank)")


def expert_range(num_experts: int, group: int, groups: int) -> tuple[int, int]:
    """The experts [start, end) of expert group ``group`` of ``groups``.

    >>> expert_range(8, 1, 4)
    (2, 4)
    """
    per = num_experts // groups
    return group * per, (group + 1) * per

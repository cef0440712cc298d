"""Index arithmetic of tensor parallelism (``logprobe.parallel.shard``) against literal gold tables,
and the replica assignment of data parallelism."""

import pytest

from logprobe.errors import LogprobeError
from logprobe.parallel.engine import assign_replicas
from logprobe.parallel.shard import (
    check_tp,
    kv_heads,
    num_slices,
    q_heads,
    shard_range,
    tree_order,
    vocab_chunk_width,
    vocab_shard,
)


def test_shard_range_gold():
    assert [shard_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [shard_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_heads_gold():
    # 4 query heads, 2 kv heads (group 2)
    assert [q_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_heads(4, 2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    # TP 4 > 2 kv heads: each kv head replicated on two ranks
    assert [kv_heads(4, 2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Llama-3-8B: 32 q heads, 8 kv heads
    assert [kv_heads(32, 8, r, 8) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [kv_heads(32, 8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    assert kv_heads(32, 32, 1, 4) == (8, 16)


def test_slices_and_vocab_grid_gold():
    assert num_slices(4, 128) == 4
    assert num_slices(32, 14336) == 8
    assert num_slices(9, 1536) == 1  # SmolLM2-135M: 9 heads
    assert num_slices(12, 4864) == 4
    assert vocab_chunk_width(300) == 48
    assert vocab_chunk_width(128256) == 8192
    assert vocab_chunk_width(49152) == 6144
    assert [vocab_shard(300, 48, r, 2) for r in range(2)] == [(0, 192), (192, 300)]
    assert [vocab_shard(300, 48, r, 4) for r in range(4)] == [(0, 96), (96, 192), (192, 288), (288, 300)]
    assert [vocab_shard(128256, 8192, r, 2) for r in range(2)] == [(0, 65536), (65536, 128256)]


def test_tree_order_gold():
    assert tree_order(1) == []
    assert tree_order(2) == [(0, 1)]
    assert tree_order(4) == [(0, 1), (2, 3), (0, 2)]
    assert tree_order(8) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (4, 6), (0, 4)]
    with pytest.raises(ValueError):
        tree_order(3)


def test_tree_sum_is_the_same_additions_at_every_size():
    """Rank-local subtrees + the top of the tree == the whole tree on one rank, bitwise."""
    import torch

    from logprobe.parallel.context import ParallelContext

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(5, 7, generator=g) * 10 ** i for i in range(8)]
    whole = ParallelContext(slices=8).tree_sum(leaves)
    # what TP = 2 computes: each half locally, then the two subtotals
    half = [ParallelContext(slices=8).tree_sum(leaves[:4]), ParallelContext(slices=8).tree_sum(leaves[4:])]
    assert torch.equal(whole, half[0] + half[1])
    left_to_right = leaves[0]
    for x in leaves[1:]:
        left_to_right = left_to_right + x
    assert not torch.equal(whole, left_to_right)  # the order matters: the tree is what makes it fixed


def test_check_tp_errors():
    check_tp(4, 2, 7, 4)
    with pytest.raises(LogprobeError, match="does not divide the 9 attention heads"):
        check_tp(9, 3, 8, 2)
    with pytest.raises(LogprobeError, match="key/value heads"):
        check_tp(12, 3, 8, 2)
    with pytest.raises(LogprobeError, match="vocabulary chunks"):
        check_tp(8, 8, 2, 4)


def test_assign_replicas_gold():
    # requests 0 and 1 share their first 16 ids (one group of 40 tokens); 2 (30) and 3 (5) alone
    inputs = [[1] * 16 + [5] * 4, [1] * 16 + [6] * 4, [3] * 30, [4] * 5]
    assert assign_replicas(inputs, 2) == [[0, 1], [2, 3]]
    assert assign_replicas(inputs, 3) == [[0, 1], [2], [3]]
    assert assign_replicas(inputs, 1) == [[0, 1, 2, 3]]
    assert assign_replicas([[1, 2]] * 3, 3) == [[0], [1], [2]]  # short inputs never group

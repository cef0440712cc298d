"""Index arithmetic of tensor parallelism (``logprobe.parallel.shard``) against literal gold tables,
and the replica assignment of data parallelism."""

import pytest

from logprobe.errors import LogprobeError
from logprobe.executor.engine import assign_replicas
from logprobe.parallel.shard import (
    check_tp,
    kv_heads,
    num_blocks,
    q_heads,
    shard_range,
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


def test_blocks_and_vocab_grid_gold():
    assert num_blocks(4, 64, 128) == 4
    assert num_blocks(32, 4096, 14336) == 8  # Llama-3-8B
    assert num_blocks(9, 576, 1536) == 1  # SmolLM2-135M: 9 heads
    assert num_blocks(12, 1536, 4864) == 4
    assert num_blocks(8, 1000, 4096) == 8 and num_blocks(8, 1004, 4096) == 4  # the hidden size counts
    assert vocab_chunk_width(300) == 48
    assert vocab_chunk_width(128256) == 8192
    assert vocab_chunk_width(49152) == 6144
    assert [vocab_shard(300, 48, r, 2) for r in range(2)] == [(0, 192), (192, 300)]
    assert [vocab_shard(300, 48, r, 4) for r in range(4)] == [(0, 96), (96, 192), (192, 288), (288, 300)]
    assert [vocab_shard(128256, 8192, r, 2) for r in range(2)] == [(0, 65536), (65536, 128256)]


def test_held_rows_gold():
    """The module docstring's worked example: every cut is rows of the native parameter, as each
    rank's layers state them (``RowShard.tp_rows``, read off a meta-device model)."""
    from logprobe.layers.parallel_linear import held_rows
    from logprobe.loading.sharding import rank_model
    from logprobe.models.llama import LlamaConfig
    from logprobe.parallel.context import ParallelContext

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    gold = {0: [(0, 32), (0, 16), (0, 16), (0, 32), (0, 64), (0, 64), (0, 32)],
            1: [(32, 64), (16, 32), (16, 32), (32, 64), (64, 128), (64, 128), (32, 64)]}
    for rank in (0, 1):
        model = rank_model(cfg, ParallelContext(rank, 2, None, 4))
        mod = lambda n: "self_attn" if n in names[:4] else "mlp"  # noqa: E731
        got = [held_rows(model, f"layers.0.{mod(n)}.{n}.weight") for n in names]
        assert got == gold[rank]
        assert held_rows(model, "lm_head.weight") == [(0, 192), (192, 300)][rank]
        assert held_rows(model, "embed_tokens.weight") == [(0, 192), (192, 300)][rank]
        assert held_rows(model, "layers.0.input_layernorm.weight") is None
        assert held_rows(model, "norm.weight") is None and held_rows(model, "no.such.weight") is None
        # deterministic mode's column blocks, derived by each layer from its width and S = 4
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        # k_proj: one kv head of 16 here, one block (stated, so a fused q|k|v keeps block-wide products)
        assert attn.q_proj.col_blocks == [16, 16] and attn.k_proj.col_blocks == [16]
        assert mlp.gate_proj.col_blocks == [32, 32] and mlp.down_proj.col_blocks == [16, 16]


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

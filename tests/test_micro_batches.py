"""Two micro-batches under data-parallel attention (``ScoringModel.overlapped``, ``layers.steps``):
each rank's rows cut near their middle run through the blocks in turn, one's expert transfers
beside the other's work. Two gloo ranks, a Qwen3-MoE with a dense block and a DeepSeek-V3 (MLA, a
dense first block, a shared expert), tiny random checkpoints:

* the interleaved schedule ran (every rank, every batch whose halves are big enough);
* deterministic mode: bitwise one process, and bitwise the same ranks without micro-batches;
* default mode: within 1e-5 of one process and of the ranks without micro-batches.

The cut itself (``parallel.rows.micro_cuts``, ``micro_splits``) is pinned by doctests.
"""

from __future__ import annotations

import pytest
import torch
from test_data_attention import _batches, dirs, gloo_rank_counting_interleaves  # noqa: F401 - dirs: the fixture

from logprobe.config import EngineConfig, numerics_for
from logprobe.layers.attention import AttentionMeta
from logprobe.loading.loader import load_model, load_shard
from logprobe.parallel.context import ParallelContext
from logprobe.parallel.rows import micro_cuts

transformers = pytest.importorskip("transformers")


def _run(model, det: bool, micro: int, size: int):
    model.set_numerics(numerics_for(EngineConfig(deterministic=det, micro_batch_rows=micro, progress=False), "cpu",
                                    tp_size=size, tp_blocks=model.ctx.blocks))
    outs = []
    for tok, meta, pos, _ in _batches()[:5]:  # no hooks: the batches that split by sequences
        meta = AttentionMeta(meta.segments, kv_block=model.numerics.attention_block if det else None)
        with torch.no_grad():
            outs.append(model(torch.tensor(tok), torch.tensor(pos), meta))
    return outs


def _worker(rank: int, size: int, paths: dict, rdv: str, out: str) -> None:
    import torch.distributed as dist

    calls = gloo_rank_counting_interleaves(rank, size, rdv)
    got = {}
    for kind, path in paths.items():
        model = load_shard(path, ParallelContext(rank, size, dist.group.WORLD, experts=size), "cpu", "float32").model
        for det in (True, False):
            calls.clear()
            got[kind, det, "micro"] = (_run(model, det, 2, size), list(calls))
            got[kind, det, "one"] = (_run(model, det, 0, size), None)
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


def test_micro_batches_equal_one_batch_and_one_process(dirs, tmp_path):  # noqa: F811 - the imported fixture
    import torch.multiprocessing as mp

    paths = {k: str(v) for k, v in dirs.items()}
    out = tmp_path / "got.pt"
    mp.spawn(_worker, args=(2, paths, str(tmp_path / "rdv"), str(out)), nprocs=2)
    got = torch.load(out)
    # batch 0 ((0, 17, 36): 5 + 9 + 3 | 12 + 7 rows) cuts into halves of 2+ rows on both ranks; the
    # others hold a rank with one uncuttable unit (one sequence, or a prefix with its branches)
    assert micro_cuts([[0, 5, 14, 17], [0, 12, 19]], 2) == (5, 12)
    for kind, path in paths.items():
        one = load_model(path, "cpu", "float32").model
        for det in (True, False):
            micro, calls = got[kind, det, "micro"]
            plain, _ = got[kind, det, "one"]
            assert calls == [2], (kind, det, calls)  # batch 0, two chains
            want = _run(one, det, 2, 1)
            for i, (h, p, w) in enumerate(zip(micro, plain, want)):
                if det:
                    assert torch.equal(h, w) and torch.equal(h, p), (kind, i)
                    continue
                d_one, d_plain = (h - w).abs().max().item(), (h - p).abs().max().item()
                assert d_one <= 1e-5 and d_plain <= 1e-5, (kind, i, d_one, d_plain)

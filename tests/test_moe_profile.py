"""The per-rank profile of a mixture of experts over ranks (``executor.profile``, the ``Profile``
message): two gloo workers of a tiny Qwen3-MoE under data-parallel attention each send back a
summary whose counts are checked against numbers computed here from the request lengths alone
(rows, attention pairs), whose collectives are the ones the MoE layer calls (all-gather, then a
reduce-scatter: of default mode's partials, or of deterministic mode's subtrees), matched call by call
across the ranks; the profiled run's results are the plain run's. One process (the 1-GPU
baseline of ``bench/gpu_moe_parallel.py --profile``) profiles the same way in the fast tier."""

from __future__ import annotations

import pytest
import torch
from test_moe import make_moe_dir

from logprobe import LogprobeError
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import Engine
from logprobe.executor.profile import RankProfile, kernel_family, profile_run, waits
from logprobe.loading.loader import load_model

pytest.importorskip("transformers")

LENGTHS = [31, 20, 26, 12, 17]  # tokens per request: inputs of 30, 19, 25, 11, 16 rows


def _requests() -> list[ScoreRequest]:
    gen = torch.Generator().manual_seed(3)
    return [ScoreRequest(torch.randint(3, 250, (n,), generator=gen).tolist(), 1) for n in LENGTHS]


def _totals() -> tuple[int, int]:
    """Rows and causal (query, key) pairs of the requests, none sharing a prefix: L and L(L+1)/2."""
    rows = [n - 1 for n in LENGTHS]
    return sum(rows), sum(r * (r + 1) // 2 for r in rows)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-profile")
    make_moe_dir(path, "qwen3_moe")
    return path


def test_one_process_profile(moe_dir):
    """In process (the one-GPU baseline): every row on the one rank, products and attention
    present, no collective, the results the plain run's."""
    model = load_model(str(moe_dir), "cpu", "float32").model
    engine = Engine(model, EngineConfig(progress=False, max_batch_tokens=64), torch.device("cpu"))
    reqs = _requests()
    want = engine.run(reqs, progress=False)
    got = []
    prof = profile_run(engine, reqs, EngineConfig(progress=False, max_batch_tokens=64),
                       on_result=lambda i, r: got.append((i, r)))
    assert (prof.rows, prof.pairs) == _totals()
    assert prof.wall_s > 0 and prof.collectives == () and 0 < prof.busy_s <= prof.wall_s * 1.05 + 0.01
    fam = prof.families()
    assert fam["gemm"] > 0 and fam["attention"] > 0, fam
    assert not set(fam) & {"all-gather", "reduce-scatter", "all-to-all", "all-reduce"}, fam
    assert sorted(i for i, _ in got) == list(range(len(reqs)))
    for i, r in got:
        assert torch.equal(r.logprobs, want[i].logprobs)


def test_waits_match_calls_across_ranks():
    a = RankProfile(0, 1.0, (("x", 1, 3.0),), (("all-gather", 5.0), ("reduce-scatter", 2.0)))
    b = RankProfile(1, 1.0, (("x", 1, 3.0),), (("all-gather", 1.0), ("reduce-scatter", 4.0)))
    assert waits([a, b]) == (4.0, 2.0)
    assert waits([a, RankProfile(1, 1.0, (), (("all-gather", 1.0),))]) is None  # calls not matched
    assert kernel_family("ncclDevKernel_AllGather_RING_LL") == "all-gather"
    assert kernel_family("gloo:all_to_all") == "all-to-all"


@pytest.mark.slow  # two gloo worker processes (~20 s on 2 shared cores)
def test_two_ranks_profile(moe_dir):
    """TP = EP = 2 (data-parallel attention): both ranks answer; their rows and pairs add up to the
    batch's; the MoE layer's collectives are there (all-gather and reduce-scatter in both modes: at
    two ranks deterministic mode's tree is one reduce-scatter), in the same order on both ranks; the results
    equal the plain run's (deterministic: bitwise)."""
    from logprobe import Scorer

    reqs = _requests()
    rows, pairs = _totals()
    with Scorer(str(moe_dir), device="cpu", dtype="float32", progress=False, tensor_parallel_size=2) as s:
        assert s.attention_parallel == "data"
        for det in (False, True):
            s.config = EngineConfig(progress=False, deterministic=det)
            want = s.engine.run(reqs)
            results, ranks = s.engine.profile(reqs)
            assert [p.rank for p in ranks] == [0, 1]
            for got, ref in zip(results, want):
                assert torch.allclose(got.logprobs, ref.logprobs, atol=1e-6, rtol=0)
                assert not det or torch.equal(got.logprobs, ref.logprobs)
            assert sum(p.rows for p in ranks) == rows and sum(p.pairs for p in ranks) == pairs
            assert all(0 < p.rows < rows for p in ranks)  # each rank its share of the sequences
            for p in ranks:
                fam = p.families()
                # deterministic attention runs in PyTorch products (gemm, elementwise), not an attention op
                assert p.wall_s > 0 and fam["gemm"] > 0 and (det or fam["attention"] > 0), fam
                assert 0 < p.busy_s <= p.wall_s * 1.05 + 0.01, (p.busy_s, p.wall_s)
                assert fam["all-gather"] > 0 and fam["reduce-scatter"] > 0, fam
                kinds = {k for k, _ in p.collectives}
                assert "all-gather" in kinds and "all-to-all" not in kinds, kinds
            w = waits(ranks)
            assert w is not None and all(x >= 0 for x in w), w
            print(f"deterministic={det}", [(p.rank, p.rows, p.pairs, round(p.wall_s, 3),
                                            {k: round(v) for k, v in list(p.families().items())[:6]}) for p in ranks],
                  "waits us", w)
    with pytest.raises(LogprobeError) as e:
        with Scorer(str(moe_dir), device="cpu", dtype="float32", progress=False, tensor_parallel_size=1,
                    data_parallel_size=2) as s:
            s.engine.profile(reqs)
    assert e.value.field == "data_parallel_size"

"""Redundant copies of hot experts under expert parallelism (``parallel.placement``): the placement's
gold table, the checks naming their field, a rank reading its replicas' weights, and one MoE block
over gloo ranks with replicas (tensor- and data-parallel attention) against one process and
against expert parallelism without replicas: deterministic mode bitwise, default mode to 1e-5, and
the hot expert's slots computed on the rank holding its replica.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_parallel import LAYER, _layer_weights, _numerics, dirs  # noqa: F401 - dirs: a fixture

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.layers.moe import Experts
from logprobe.loading.loader import describe_model
from logprobe.loading.sharding import expert_placement
from logprobe.parallel.context import ParallelContext
from logprobe.parallel.placement import place_experts, rank_tokens

SKEWED = [400, 20, 10, 10, 60, 10, 5, 5]  # expert 0 hot, expert 4 warm


def test_placement_gold_table():
    """Literal tables: who holds what, and each expert's holders (owner first)."""
    p = place_experts([100, 10, 10, 10, 10, 10, 10, 10], 2, 1)  # the module's worked example
    assert p.held == ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))
    assert p.replicas == ((0, 1), (0,), (0,), (0,), (1, 0), (1,), (1,), (1,))
    # rank loads 420, 20, 70, 10 -> e0 to rank 3, then 1, then 2 (100 per holder), e4 to rank 0: 150, 120, 140, 110
    p = place_experts(SKEWED, 4, 1)
    assert p.held == ((0, 1, 4), (2, 3, 0), (4, 5, 0), (6, 7, 0))
    assert p.replicas == ((0, 3, 1, 2), (0,), (1,), (1,), (2, 0), (2,), (3,), (3,))
    p = place_experts(SKEWED, 4, 2)
    assert p.held == ((0, 1, 4, 2), (2, 3, 0, 1), (4, 5, 0, 1), (6, 7, 0, 4))
    assert p.replicas == ((0, 3, 1, 2), (0, 1, 2), (1, 0), (1,), (2, 3, 0), (2,), (3,), (3,))
    assert place_experts([0] * 8, 2, 3).held == ((0, 1, 2, 3), (4, 5, 6, 7))  # no load: no copy
    assert place_experts(SKEWED, 2, 0).replicas == tuple((e // 4,) for e in range(8))


def test_placement_evens_the_ranks_tokens():
    """Expert 0 in every row: its owner computes half the slots alone; with replicas the rule (row
    t to holder t mod n) splits them."""
    ids = torch.stack([torch.zeros(16, dtype=torch.long), torch.arange(16) % 8], 1)  # [16, 2]
    assert rank_tokens(ids, 8, 4) == [20, 4, 4, 4]
    assert rank_tokens(ids, 8, 4, place_experts(SKEWED, 4, 1)) == [8, 8, 8, 8]


def test_each_slot_computed_once():
    """Every rank's share of a batch's slots (``Experts.my_slots``, what each computes): together
    each slot exactly once, expert 0's split between its holders by row, and each slot's expert
    numbered among its rank's held experts (the replica after its own four)."""
    placement = place_experts([100, 10, 10, 10, 10, 10, 10, 10], 2, 1)
    ranks = [Experts(8, 16, 8, ParallelContext(r, 2, experts=2, placement=placement)) for r in (0, 1)]
    ids = torch.tensor([[0, 5], [0, 1], [0, 4], [6, 0], [-1, -1]])  # the last: a pad row
    shares = [x.my_slots(ids) for x in ranks]
    slots = torch.cat([sl for sl, _ in shares])
    assert sorted(slots.tolist()) == list(range(8))  # each real slot once, the pad row's none
    # row t's slot of expert 0 to holder (0, 1)[t % 2], of expert 4 to (1, 0)[t % 2]
    assert [sl.tolist() for sl, _ in shares] == [[0, 3, 4], [1, 2, 5, 6, 7]]
    assert [lid.tolist() for _, lid in shares] == [[0, 1, 0], [1, 4, 0, 2, 4]]
    assert [ranks[r].expert_ids for r in (0, 1)] == [(0, 1, 2, 3, 4), (4, 5, 6, 7, 0)]
    assert ranks[1].computing_rank(ids, 0).tolist() == [[0, 1], [1, 0], [0, 1], [1, 1], [-1, -1]]


def test_checks_name_their_field(dirs):  # noqa: F811 - the fixture
    cfg = describe_model(str(dirs["qwen3_moe"]), "cpu").model.config
    assert expert_placement(cfg, 2, 2, 0, None) is None
    cases = [((2, 2, -1, SKEWED), "redundant_experts", "non-negative"),
             ((2, 2, 1, SKEWED[:4]), "expert_loads", "4 loads for 8 experts"),
             ((2, 2, 1, [1, 2, 3, "x", 1, 1, 1, 1]), "expert_loads", "list of numbers"),
             ((2, 2, 1, [1, -2, 3, 1, 1, 1, 1, 1]), "expert_loads", ">= 0"),
             ((2, 2, 1, None), "expert_loads", "needs each expert's load"),
             ((2, 1, 1, SKEWED), "redundant_experts", "whole experts per rank"),
             ((4, 2, 1, SKEWED), "redundant_experts", "whole experts per rank")]
    for args, field, text in cases:
        with pytest.raises(LogprobeError, match=text) as e:
            expert_placement(cfg, *args)
        assert e.value.field == field, args
    with pytest.raises(LogprobeError) as e:  # one process: refused before anything loads
        Scorer(str(dirs["qwen3_moe"]), device="cpu", dtype="float32", redundant_experts=1, expert_loads=SKEWED)
    assert e.value.field == "redundant_experts"
    with pytest.raises(LogprobeError) as e:  # a layer built under another split
        Experts(8, 64, 32, ParallelContext(0, 2, experts=1, placement=place_experts(SKEWED, 2, 1)))
    assert e.value.field == "redundant_experts"


def test_rank_reads_its_replicas(dirs):  # noqa: F811 - the fixture
    """Rank 1 of 4 with one replica holds experts 2, 3 and expert 0's copy, read from the
    checkpoint as its own (stacked in that order)."""
    from logprobe.loading.hf import hf_tensors, native_config, read_config
    from logprobe.loading.sharding import hf_shard_tensors

    path = dirs["qwen3_moe"]
    cfg, _ = native_config(read_config(path))
    whole = dict(hf_tensors(path, cfg))
    ctx = ParallelContext(1, 4, None, experts=4, placement=place_experts(SKEWED, 4, 1))
    got = dict(hf_shard_tensors(path, cfg, ctx))
    e = "layers.1.mlp.experts."
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(got[e + name], whole[e + name][[2, 3, 0]]), name


def test_cache_keys_by_replicas(dirs):  # noqa: F811 - the fixture
    """Default mode's sums over ranks follow which rank computes each slot: results stored without
    replicas are not answered for a scorer with them (nor for another placement)."""
    from logprobe.executor.cached import ModelIdentity

    loaded = describe_model(str(dirs["qwen3_moe"]), "cpu")
    keys = {ModelIdentity(loaded, False, lambda: 0, 2, 2, "data", p).key(EngineConfig())[0]
            for p in (None, place_experts(SKEWED, 2, 1), place_experts(SKEWED, 2, 2))}
    assert len(keys) == 3


# ---- one MoE block over gloo ranks, with and without replicas ----

def _block(ctx: ParallelContext):
    from logprobe.layers.moe import MoeBlock, MoeSpec

    w = _layer_weights()
    w["x"] += 0.5  # a shared direction in every row, which expert 0's router row favours: expert 0
    w["router"][0] += 0.5  # hot, as a trained router's (in most rows' top-k)
    block = MoeBlock(MoeSpec(LAYER["E"], LAYER["k"], LAYER["I"], norm_topk_prob=True), LAYER["H"], "r", ctx=ctx)
    ids = list(block.experts.expert_ids)  # own experts, then replicas
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            _, (r0, r1) = block.experts.held(name)
            getattr(block.experts, name).copy_(w[name][ids, r0:r1])
    return block, w["x"]


def _measured_loads() -> list[int]:
    """The tokens routed to each expert on one process (a warm-up pass's count)."""
    block, x = _block(ParallelContext(blocks=8))
    _, _, ids = block.route_tokens(x)
    return torch.bincount(ids.reshape(-1), minlength=LAYER["E"]).tolist()


def _worker(rank: int, size: int, loads: list, rdv: str, out: str) -> None:
    import torch.distributed as dist

    from logprobe.parallel.rows import RowSplit

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    counted = {"rows": 0, "replica": 0}
    local = Experts.local
    def noted(self, x, ids, *a):  # noqa: E306 - the rows each rank computes, and those of replicas
        counted["rows"] += ids.numel()
        counted["replica"] += int((ids >= self.own_experts).sum())
        return local(self, x, ids, *a)
    Experts.local = noted
    got = {}
    rows = RowSplit((0, 21, LAYER["T"]) if size == 2 else (0, 9, 18, 28, LAYER["T"]), rank)
    for attention in ("tensor", "data"):
        for placed in (False, True):
            ctx = ParallelContext(rank, size, None, blocks=8, experts=size, attention=attention,
                                  placement=place_experts(loads, size, 1) if placed else None)
            block, x = _block(ctx)
            for det in (False, True):
                block.set_numerics(_numerics(det, size))
                counted.update(rows=0, replica=0)
                a, b = rows.own
                y = block(x[a:b], rows=rows) if attention == "data" else block(x)
                got[attention, placed, det] = (y, dict(counted))
    torch.save(got, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # 2 or 4 gloo workers (~10-15 s)
@pytest.mark.parametrize("size,interpret", [(2, False), (4, False), (2, True)])
def test_block_with_replicas_equals_one_process(size, interpret, tmp_path, monkeypatch):
    """Expert 0 made hot (a router row favouring every row), the placement from the loads counted
    on one process: its replicas' ranks compute some of its slots (counted), the owner fewer than
    without replicas (deterministic mode under data-parallel attention: none, every slot at its
    owner, for the combine tree's subtree sums); deterministic mode's bits are one process's (and
    those of EP without replicas) under tensor- and data-parallel attention; default mode within
    1e-5. ``interpret``:
    the workers run Triton's CPU interpreter, so that default mode under data-parallel attention
    takes the fused kernel as on CUDA (``owned_partial``: the slots another rank computes get no
    tile; its rows are not counted)."""
    import torch.multiprocessing as mp

    if interpret:
        from helpers import skip_old_interpreter

        pytest.importorskip("triton")
        skip_old_interpreter()
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned workers at import

    from logprobe.layers.moe import MoeBlock, MoeSpec  # noqa: F401 - the worker's, imported before spawn

    out = tmp_path / "got"
    loads = _measured_loads()
    assert loads[0] == max(loads) > 1.5 * LAYER["T"] * LAYER["k"] / LAYER["E"]  # hot: 1.5x a fair share
    mp.spawn(_worker, args=(size, loads, str(tmp_path / "rdv"), str(out)), nprocs=size)
    got = [torch.load(f"{out}.{r}") for r in range(size)]
    one, x = _block(ParallelContext(blocks=8))
    want = {}
    for det in (False, True):
        one.set_numerics(_numerics(det, 1))
        want[det] = one(x)
    for attention in ("tensor", "data"):
        for det in (False, True):
            for placed in (False, True):
                ys = [g[attention, placed, det][0] for g in got]
                y = torch.cat(ys) if attention == "data" else ys[0]
                if det:
                    assert torch.equal(y, want[True]), (attention, placed)
                else:
                    assert (y - want[False]).abs().max().item() <= 1e-5, (attention, placed)
            plain = [g[attention, False, det][1] for g in got]
            placed = [g[attention, True, det][1] for g in got]
            print(attention, det, "rows per rank without replicas", [c["rows"] for c in plain],
                  "with", [c["rows"] for c in placed], "replica rows", [c["replica"] for c in placed])
            if interpret and attention == "data" and not det:
                continue  # the fused kernel, not ``local``: nothing counted
            if attention == "data" and det:  # the tree's subtree sums: every slot at its owner
                assert [c["rows"] for c in placed] == [c["rows"] for c in plain]
                assert all(c["replica"] == 0 for c in placed)
                continue
            assert sum(c["replica"] for c in placed) > 0 and all(c["replica"] == 0 for c in plain)
            assert sum(c["rows"] for c in placed) == sum(c["rows"] for c in plain)  # each slot once
            assert placed[0]["rows"] < plain[0]["rows"]  # the hot expert's owner computes fewer


@pytest.mark.slow  # two gloo workers load and score (~10 s)
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_scorer_with_replicas_equals_one_process(kind, dirs):  # noqa: F811 - the fixture
    """TP = EP = 2 with one replica per rank placed for a skewed load (a Qwen3-MoE; a DeepSeek-V3:
    latent attention, grouped sigmoid routing, a dense first block, a shared expert): deterministic
    mode's bits equal one process's, default mode within 1e-5."""
    from test_moe_parallel import OPTS, _bits_equal, _seqs

    path = str(dirs[kind])
    seqs = _seqs()
    one = Scorer(path, device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det, progress=False)
        want[det] = one.logprobs(seqs, **OPTS)
    with Scorer(path, device="cpu", dtype="float32", progress=False, tensor_parallel_size=2,
                expert_parallel_size=2, redundant_experts=1, expert_loads=SKEWED) as s:
        assert s.engine.placement.held == ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))
        for det in (True, False):
            s.config = EngineConfig(deterministic=det, progress=False)
            got = s.logprobs(seqs, **OPTS)
            if det:
                assert _bits_equal(got, want[True])
            else:
                worst = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(got, want[False]))
                assert worst <= 1e-5, worst

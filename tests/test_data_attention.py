"""Data-parallel attention for mixtures of experts over several ranks (``parallel.rows``,
``ScoringModel.forward``, ``Experts.split_forward``).

With whole experts per rank (expert_parallel_size = tensor_parallel_size) attention, norms, dense
MLP blocks and shared experts are whole on every rank and each rank runs them on its share of the
batch's sequences; the experts gather every rank's rows. Checked on two gloo processes against
one process on the same checkpoint: a Qwen3-MoE with a dense block (``mlp_only_layers``) and a
DeepSeek-V3 (latent attention, a dense first block, a shared expert), on batches of several
sequences, of one sequence (one rank owns no rows), of a shared prefix with its branches (never
cut apart), and with hooks (run whole on every rank, as tensor-parallel attention does):

* deterministic mode: the final hidden rows bitwise one process's;
* default mode: within 1e-5 of one float32 process and 1e-4 of the float64 model.

``ranks_equal_one_process`` runs the same batches for the other families' checkpoints (gpt-oss in
``test_tp_families``, the hybrids in ``test_moe_parallel``), with two micro-batches and without.
"""

from __future__ import annotations

import pytest
import torch
from helpers import byte_tokenizer

from logprobe import LogprobeError
from logprobe.config import EngineConfig, numerics_for
from logprobe.engine.budget import CPU_BUDGET, budget_for, row_ranks
from logprobe.engine.scheduler import Chunk, Tree, plan_work
from logprobe.layers.attention import AttentionMeta, Segment
from logprobe.layers.hooks import CaptureTable, Hooks
from logprobe.loading.loader import attention_layout, describe_model, load_model, load_shard, parallel_context
from logprobe.parallel.context import ParallelContext
from logprobe.parallel.rows import (
    COST_SCALE,
    RowSplit,
    assign_rows,
    balanced_order,
    cut_costs,
    max_share,
    pair_count,
    row_cost,
)

transformers = pytest.importorskip("transformers")


# ---- the assignment: a literal gold table ----

def test_assign_rows_gold():
    # (cuts, size) -> bounds: the cut nearest each ideal r * total / size, ties to the smaller
    gold = {
        ((0, 5, 8, 14, 16), 2): (0, 8, 16),
        ((0, 5, 8, 14, 16), 4): (0, 5, 8, 14, 16),
        ((0, 5, 8, 14, 16), 3): (0, 5, 8, 16),
        ((0, 60, 100, 160), 2): (0, 60, 160),
        ((0, 1, 101), 2): (0, 1, 101),
        ((0, 10), 2): (0, 0, 10),
        ((0, 3), 4): (0, 0, 0, 3, 3),
        ((0, 2, 4, 6, 8), 1): (0, 8),
        ((0, 1, 2, 3, 40), 4): (0, 3, 3, 40, 40),
    }
    for (cuts, size), want in gold.items():
        assert assign_rows(list(cuts), size) == want, (cuts, size)
    assert RowSplit((0, 0, 10), rank=0).own == (0, 0) and RowSplit((0, 0, 10), rank=1).counts == (0, 10)
    for bad in ([], [1, 4], [0, 4, 4]):
        with pytest.raises(LogprobeError):
            assign_rows(bad, 2)


def test_cost_balance_gold():
    """Cuts by cost (rows and attention pairs, ``parallel.rows``): literal gold tables."""
    assert [pair_count(r, c) for r, c in ((1, 0), (4, 0), (2, 4), (3, 10))] == [1, 10, 11, 36]
    assert row_cost(3, 6, COST_SCALE // 2) == 6 * COST_SCALE and row_cost(5, 99, 0) == 5 * COST_SCALE
    # (cuts, costs in rows, size) -> bounds
    gold = {
        ((0, 1, 2, 3, 5), (0, 1.5, 3, 4.5, 8), 2): (0, 3, 5),  # by rows (0, 2, 5)
        ((0, 60, 100, 160), (0, 40, 70, 130), 2): (0, 100, 160),  # by rows (0, 60, 160)
        ((0, 60, 100, 160), (0, 60, 100, 160), 2): (0, 60, 160),  # costs = rows: as by rows
        ((0, 4, 8, 12, 16), (0, 10, 12, 14, 40), 2): (0, 12, 16),  # by rows (0, 8, 16)
        ((0, 4, 8, 12, 16), (0, 10, 12, 14, 40), 4): (0, 4, 12, 16, 16),
    }
    for (cuts, costs, size), want in gold.items():
        got = assign_rows(list(cuts), size, [int(c * COST_SCALE) for c in costs])
        assert got == want, (cuts, costs, size, got)
    with pytest.raises(LogprobeError):
        assign_rows([0, 2, 4], 2, [0, 5, 3])  # costs must ascend
    segs = [Segment(0, 4), Segment(4, 6, ((0, 4),)), Segment(6, 9)]
    assert cut_costs(segs, [0, 6, 9], COST_SCALE) == [0, 27 * COST_SCALE, 36 * COST_SCALE]
    assert cut_costs(segs, [0, 6, 9], 0) == [0, 6 * COST_SCALE, 9 * COST_SCALE]


def test_pair_weights_of_the_bench_shapes():
    """``attention_pair_weight``: one pair's attention FLOPs against one row's dense FLOPs on its
    rank, in COST_SCALE units, pinned for the MoE bench's shapes (Qwen3-30B-A3B: 4 * 32 * 128 a
    pair a block against 2 * 19.1M a row a block; the MLA shape: latent heads, a dense block and
    shared experts); a dense Llama's weight is its own."""
    import json

    from logprobe.engine.scheduler import Tree, plan_work, tree_pairs
    from logprobe.models.base import attention_pair_weight

    def weight(cls, layers, **kw):
        d = tmp / f"{cls}-{layers}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(getattr(transformers, cls)(**kw, num_hidden_layers=layers).to_dict()))
        return attention_pair_weight(describe_model(str(d), "cpu", tokenizer=False).model)

    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    qwen3 = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    mla = dict(vocab_size=102400, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
               n_shared_experts=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert weight("Qwen3MoeConfig", 16, **qwen3) == 28 and weight("Qwen3MoeConfig", 48, **qwen3) == 28
    assert weight("DeepseekV3Config", 12, **mla) == 9
    # the plan's order by cost: sequences of 50, 50, 50, 100 and 100 rows over 2 ranks. By rows
    # one rank takes both 100s (200 rows, 10,100 pairs: 300.9 rows' worth at a pair weight of
    # 1/100 row) and the other the 50s (150 rows, 188.2); by cost 213.2 | 276.0
    assert tree_pairs(Tree((0, 1), 4), [6, 5]) == 26
    inputs = [list(range(3, 3 + n)) for n in (50, 50, 50, 100, 100)]
    by_rows = plan_work(inputs, 8192, share=False, ranks=2)
    by_cost = plan_work(inputs, 8192, share=False, ranks=2, pair_weight=COST_SCALE // 100)
    assert [t.members for t in by_rows[0]] == [(3,), (4,), (0,), (1,), (2,)]
    assert [t.members for t in by_cost[0]] == [(3,), (0,), (2,), (4,), (1,)]


def test_model_row_split_balances_cost(dirs):
    """A rank's model cuts a batch by cost (``ScoringModel.row_split``): sequences of 40, 70, 10
    and 100 rows over 2 ranks, cut at 110 by rows (120 | 100: the 100-row sequence's pairs make the
    second rank's share the dearer) and at 120 by cost at this model's pair weight."""
    from logprobe.loading.sharding import rank_model

    cfg = describe_model(str(dirs["qwen3_moe"]), "cpu", tokenizer=False).model.config
    model = rank_model(cfg, parallel_context(cfg, 0, 2, None, 2, "data"))
    assert model.ctx.data_attention and model.pair_weight == 503
    starts = [0, 40, 110, 120, 220]
    meta = AttentionMeta([Segment(a, b) for a, b in zip(starts, starts[1:])])
    assert assign_rows(meta.cuts(), 2) == (0, 110, 220)
    assert model.row_split(meta, None).bounds == (0, 120, 220)


def test_cuts_keep_a_prefix_with_its_branches_and_share_rebases():
    meta = AttentionMeta([Segment(0, 3), Segment(3, 13), Segment(13, 17, ((3, 13),)), Segment(17, 19, ((3, 13),)),
                          Segment(19, 25)], kv_block=4)
    assert meta.cuts() == [0, 3, 19, 25]
    split = RowSplit(assign_rows(meta.cuts(), 2), rank=1)
    assert split.bounds == (0, 19, 25)
    assert RowSplit(split.bounds, 0).own == (0, 19)
    share = meta.share(RowSplit(split.bounds, 0))
    assert [(s.start, s.end, s.context) for s in share.segments] == [(0, 3, ()), (3, 13, ()), (13, 17, ((3, 13),)),
                                                                      (17, 19, ((3, 13),))]
    assert share.kv_block == 4 and share.rows.rank == 0
    three = meta.share(RowSplit((0, 3, 19, 25), 2))
    assert [(s.start, s.end) for s in three.segments] == [(0, 6)] and three.num_rows == 6
    assert AttentionMeta([]).cuts() == [0]


def test_balanced_order_gold():
    # (unit rows, ranks) -> the order the engine lays a batch out in, and its busiest rank's rows
    gold = {
        ((9000, 7000, 6000, 5000), 2): ([0, 3, 1, 2], 14000),  # given: 16000 | 11000
        ((10, 10, 10, 10), 2): ([0, 1, 2, 3], 20),  # already even: kept
        ((20, 9, 8, 3), 2): ([0, 1, 2, 3], 20),  # the largest alone: even already, kept
        ((7, 6, 2, 2, 1), 2): ([0, 3, 1, 2, 4], 9),  # given: cut at 7 (nearest 9): 7 | 11; greedy 7 + 2 | 6 + 2 + 1
        ((6, 5, 4, 3, 2), 2): ([1, 3, 4, 0, 2], 10),  # given 11 | 9; greedy 6 + 3 + 2 | 5 + 4 (11 | 9),
        # refined: 6 and 5 swapped, 5 + 3 + 2 | 6 + 4
        ((30, 26, 23, 21, 19, 14, 29, 29, 22, 20, 20), 2): ([0, 1, 6, 3, 10, 2, 7, 8, 9, 4, 5], 127),  # W1's
        # first pass at two GPUs, in thousands of cost units (given: 133): greedy 120 | 133, refined 126 | 127
        ((8, 7, 6, 5, 4, 3), 3): ([0, 5, 1, 4, 2, 3], 11),
        ((5, 4), 1): ([0, 1], 9),
        ((7,), 2): ([0], 7),
        ((5, 0, 5), 2): ([0, 1, 2], 5),  # an empty unit (no cut of its own)
    }
    for (sizes, n), (order, busiest) in gold.items():
        got = balanced_order(list(sizes), n)
        assert got == order, (sizes, n, got)
        assert sorted(got) == list(range(len(sizes)))
        assert max_share([sizes[i] for i in got], n) == busiest <= max_share(list(sizes), n), (sizes, n)


def test_plan_lays_trees_out_for_the_ranks():
    """``plan_work(ranks=N)``: the same batches of the same trees, each batch in ``balanced_order``;
    ranks=1 keeps the planner's order (longest first)."""
    inputs = [[1] * 9, [2] * 7, [3] * 6, [4, 4, 4, 5, 5], [4, 4, 4, 6]]
    one = plan_work(inputs, 100, min_shared=2)
    assert one == [[Tree((0,)), Tree((1,)), Tree((2,)), Tree((3, 4), 3)]]  # 9, 7, 6, 6 rows (the tree: 3 + 2 + 1)
    two = plan_work(inputs, 100, min_shared=2, ranks=2)
    assert two == [[Tree((0,)), Tree((3, 4), 3), Tree((1,)), Tree((2,))]]  # 9 + 6 | 7 + 6 (given: 16 | 12)
    assert plan_work(inputs, 20, min_shared=2, ranks=2) == plan_work(inputs, 20, min_shared=2) == [
        [Tree((0,)), Tree((1,))], [Tree((2,)), Tree((3, 4), 3)]]  # 9 | 7 and 6 | 6: kept
    # a tree or a request over a rank's share (16 // 2): the tree split, the request in chunks of
    # 8 rows (a tree is never cut between ranks; a chunk runs whole on every rank)
    assert plan_work(inputs, 16, min_shared=2) == [[Tree((0,)), Tree((1,))], [Tree((2,)), Tree((3, 4), 3)]]
    assert plan_work(inputs, 16, min_shared=2, ranks=2) == [
        [Tree((1,)), Tree((2,))], [Tree((3, 4), 3)], [Chunk(0, 0, 8)], [Chunk(0, 8, 9)]]
    group = [[4] * 3 + [5] * 4, [4] * 3 + [6] * 4, [4] * 3 + [7] * 4]  # 3 + 3 x 4 = 15 rows shared
    assert plan_work(group, 20, min_shared=2) == [[Tree((0, 1, 2), 3)]]
    assert plan_work(group, 20, min_shared=2, ranks=2) == [[Tree((0,)), Tree((1,))], [Tree((2,))]]  # 11 > 10


def test_default_budget_counts_every_rank():
    """Under data-parallel attention the default budget of a pass is the ranks' rows together:
    N x the one-rank budget on CPU (the CUDA rule: ``engine.budget.ranks_budget``, its doctest and
    tests/test_budget.py); heads split or one rank: the one-rank budget."""
    from types import SimpleNamespace

    cpu = torch.device("cpu")
    for ctx, n in ((ParallelContext(0, 2, experts=2, attention="data"), 2),
                   (ParallelContext(1, 4, experts=4, attention="data"), 4),
                   (ParallelContext(0, 2, experts=2, attention="tensor"), 1), (ParallelContext(), 1), (None, 1)):
        model = SimpleNamespace(ctx=ctx)
        assert row_ranks(model) == n and budget_for(model, cpu) == n * CPU_BUDGET, ctx


class _Stop(Exception):
    pass


def test_passes_run_whole_hold_a_rank_share(dirs):
    """Under data-parallel attention (budget 64 over 2 ranks) a pass that runs whole on every rank
    holds at most a rank's share, 32 rows: a long request's chunks, a batch with hooks (routing
    read here); a batch without hooks fills the budget (its rows are split). The rows of each
    engine's first pass, read by ``fault_hook`` before any collective would run."""
    from logprobe.engine.request import ScoreRequest
    from logprobe.engine.runner import Engine

    model = load_model(str(dirs["qwen3_moe"]), "cpu", "float32").model
    model.ctx = ParallelContext(0, 2, experts=2, attention="data")
    engine = Engine(model, EngineConfig(max_batch_tokens=64, progress=False), torch.device("cpu"))
    assert engine.budget == 64 and engine.whole_budget == 32

    def first_pass(reqs):
        seen = []

        def hook(rows, tokens):
            seen.append(rows)
            raise _Stop

        engine.fault_hook = hook
        with pytest.raises(_Stop):
            engine.run(reqs)
        return seen[0]

    three = [list(range(5 + i, 26 + i)) for i in range(3)]  # 3 x 20 inputs, no shared prefix
    assert first_pass([ScoreRequest(list(range(3, 104)), 1)]) == 32  # 100 inputs: chunks of the share
    assert first_pass([ScoreRequest(t, 1) for t in three]) == 60
    assert first_pass([ScoreRequest(t, 1, route=i == 0) for i, t in enumerate(three)]) <= 32  # one at a time
    one = Engine(load_model(str(dirs["qwen3_moe"]), "cpu", "float32").model,
                 EngineConfig(max_batch_tokens=64, progress=False), torch.device("cpu"))
    assert one.whole_budget == 64


# ---- the option ----

def _qwen3_moe_config(dense_layers: bool = True):
    from test_moe import moe_config

    cfg = moe_config("qwen3_moe")
    if dense_layers:
        cfg.num_hidden_layers, cfg.mlp_only_layers = 3, [1]
    return cfg


def _save(model, path, seed: int):
    from test_moe_parallel import _randomise

    model = model.float().eval()
    _randomise(model, seed)
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from test_deepseek import make_model

    out = {}
    torch.manual_seed(0)
    out["qwen3_moe"] = tmp_path_factory.mktemp("qwen3_moe_dense")
    _save(transformers.AutoModelForCausalLM.from_config(_qwen3_moe_config(), attn_implementation="eager",
                                                        experts_implementation="eager"), out["qwen3_moe"], 400)
    torch.manual_seed(1)
    out["deepseek_v3"] = tmp_path_factory.mktemp("deepseek_v3")
    _save(make_model("qlora"), out["deepseek_v3"], 401)
    return out


def test_layout_default_and_refusals(dirs):
    cfg = describe_model(str(dirs["qwen3_moe"]), "cpu").model.config
    assert cfg.moe.dense_layers == (1,)
    assert parallel_context(cfg, 0, 2, None, 2).attention == "data"  # whole experts per rank: the default
    assert parallel_context(cfg, 0, 2, None, 1).attention == "tensor"  # experts split by rows
    assert parallel_context(cfg, 0, 2, None, 2, "tensor").attention == "tensor"
    assert parallel_context(cfg, 0, 1).data_attention is False
    ds = describe_model(str(dirs["deepseek_v3"]), "cpu").model.config
    assert parallel_context(ds, 1, 2, None, 2).attention == "data"
    for args, text in (((cfg, 2, 1, "data"), "whole experts per rank"), ((cfg, 2, 2, "rows"), "not a layout")):
        with pytest.raises(LogprobeError, match=text) as e:
            attention_layout(*args)
        assert e.value.field == "attention_parallel"
    import dataclasses

    dense = dataclasses.replace(cfg, moe=None)
    with pytest.raises(LogprobeError, match="split by heads only") as e:
        parallel_context(dense, 0, 2, None, 1, "data")
    assert e.value.field == "attention_parallel"
    assert parallel_context(dense, 0, 2).attention == "tensor"


def test_rank_reads_whole_attention_and_dense_layers(dirs):
    """Under data-parallel attention a rank's model holds attention, the dense block and the norms
    whole (the loader reads them whole), its experts only (whole), the vocabulary split."""
    from logprobe.loading.hf import hf_tensors, native_config, read_config
    from logprobe.loading.sharding import hf_shard_tensors, rank_model

    path = dirs["qwen3_moe"]
    cfg, _ = native_config(read_config(path))
    whole = dict(hf_tensors(path, cfg))
    ctx = parallel_context(cfg, 1, 2, None, 2)
    got = dict(hf_shard_tensors(path, cfg, ctx))
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight",
                 "layers.1.mlp.down_proj.weight", "layers.2.self_attn.k_norm.weight"):
        assert torch.equal(got[name], whole[name]), name
    assert torch.equal(got["layers.0.mlp.experts.down_proj"], whole["layers.0.mlp.experts.down_proj"][4:8])
    model = rank_model(cfg, ctx)
    assert model.layers[0].self_attn.num_heads == cfg.num_heads and not model.layers[0].self_attn.ctx.parallel
    assert model.layers[0].mlp.experts.ctx is model.ctx and model.ctx.data_attention


# ---- two gloo ranks against one process ----

def _batches() -> list[tuple[list[int], AttentionMeta, list[int], bool]]:
    """(token ids, meta, positions, with hooks) of each batch."""
    g = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(3, 250, (n,), generator=g).tolist()

    out = []
    for lengths in ([5, 9, 3, 12, 7], [23], [1, 2], [16, 4, 4]):
        tok = ids(sum(lengths))
        pos = [p for n in lengths for p in range(n)]
        out.append((tok, AttentionMeta.packed(lengths), pos, False))
    # a 10-row prefix and two branches, then a lone sequence: the prefix stays with its branches
    segs = [Segment(0, 10), Segment(10, 14, ((0, 10),)), Segment(14, 17, ((0, 10),)), Segment(17, 30)]
    out.append((ids(30), AttentionMeta(segs), list(range(10)) + list(range(10, 14)) + list(range(10, 13))
                + list(range(13)), False))
    out.append((ids(20), AttentionMeta.packed([8, 12]), list(range(8)) + list(range(12)), True))  # hooks: whole
    return out


def _run(model, batches, det: bool, size: int):
    model.set_numerics(numerics_for(EngineConfig(deterministic=det, progress=False), "cpu", tp_size=size,
                                    tp_blocks=model.ctx.blocks))
    outs = []
    for tok, meta, pos, hooked in batches:
        meta = AttentionMeta(meta.segments, kv_block=model.numerics.attention_block if det else None)
        hooks = None
        if hooked:
            table = CaptureTable("rows", torch.arange(len(tok)))
            hooks = Hooks(capture={"blocks.0.mlp_out": [table]})
        split = model.row_split(meta, hooks)
        with torch.no_grad():
            h = model(torch.tensor(tok), torch.tensor(pos), meta, hooks)
        outs.append((h, None if split is None else split.bounds, None if hooks is None else table.out))
    return outs


def _worker(rank: int, size: int, paths: dict, rdv: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    got = {}
    for kind, path in paths.items():
        model = load_shard(path, ParallelContext(rank, size, dist.group.WORLD, experts=size), "cpu", "float32").model
        assert model.ctx.data_attention
        got[kind] = {det: _run(model, _batches(), det, size) for det in (True, False)}
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # slow tier: two gloo processes loading two models (~15 s)
def test_two_ranks_equal_one_process(dirs, tmp_path):
    import torch.multiprocessing as mp

    paths = {k: str(v) for k, v in dirs.items()}
    out = tmp_path / "got.pt"
    mp.spawn(_worker, args=(2, paths, str(tmp_path / "rdv"), str(out)), nprocs=2)
    got = torch.load(out)
    for kind, path in paths.items():
        one = load_model(path, "cpu", "float32").model
        ref64 = load_model(path, "cpu", "float32").model.double()  # the same code in float64
        ref64.set_numerics(numerics_for(EngineConfig(progress=False), "cpu"))
        splits = [s for _, s, _ in got[kind][True]]
        assert splits == [(0, 17, 36), (0, 0, 23), (0, 1, 3), (0, 16, 24), (0, 17, 30), None], splits
        for det in (True, False):
            want = _run(one, _batches(), det, 1)
            for i, ((h, _, cap), (w, _, wcap), (tok, meta, pos, _)) in enumerate(zip(got[kind][det], want,
                                                                                    _batches())):
                assert h.shape == w.shape
                if det:
                    assert torch.equal(h, w), (kind, i)
                    assert cap is None or torch.equal(cap, wcap), (kind, i)
                    continue
                with torch.no_grad():
                    h64 = ref64(torch.tensor(tok), torch.tensor(pos), AttentionMeta(meta.segments))
                d_one, d_64 = (h - w).abs().max().item(), (h.double() - h64).abs().max().item()
                print(f"{kind} batch {i} default mode: vs one process {d_one:.2e}, vs float64 {d_64:.2e}")
                assert d_one <= 1e-5 and d_64 <= 1e-4, (kind, i, d_one, d_64)


def run_batches(model, det: bool, micro: int, size: int) -> list[torch.Tensor]:
    """Final hidden rows of ``_batches`` (the last with a capture: run whole), micro-batches of at
    least ``micro`` rows (0: one batch)."""
    model.set_numerics(numerics_for(EngineConfig(deterministic=det, micro_batch_rows=micro, progress=False), "cpu",
                                    tp_size=size, tp_blocks=model.ctx.blocks))
    outs = []
    for tok, meta, pos, hooked in _batches():
        meta = AttentionMeta(meta.segments, kv_block=model.numerics.attention_block if det else None)
        hooks = Hooks(capture={"blocks.0.mlp_out": [CaptureTable("rows", torch.arange(len(tok)))]}) if hooked else None
        with torch.no_grad():
            outs.append(model(torch.tensor(tok), torch.tensor(pos), meta, hooks))
    return outs


def gloo_rank_counting_interleaves(rank: int, size: int, rdv: str) -> list[int]:
    """In a spawned worker: join the gloo group as ``rank`` of ``size`` and count the interleaved
    schedules that run (``models.base.interleave`` wrapped) -> the list each one appends its
    number of chains to."""
    import torch.distributed as dist

    import logprobe.models.base as base

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    calls = []
    plain = base.interleave

    def counted(*chains):
        calls.append(len(chains))
        return plain(*chains)

    base.interleave = counted
    return calls


def _layout_worker(rank: int, size: int, path: str, rdv: str, out: str) -> None:
    import torch.distributed as dist

    calls = gloo_rank_counting_interleaves(rank, size, rdv)
    model = load_shard(path, ParallelContext(rank, size, dist.group.WORLD, experts=size), "cpu", "float32").model
    assert model.ctx.data_attention
    got = {}
    for det in (True, False):
        for micro in (2, 0):
            calls.clear()
            got[det, micro] = (run_batches(model, det, micro, size), list(calls))
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


def ranks_equal_one_process(path: str, tmp_path, size: int = 2) -> None:
    """A mixture of experts of another family (gpt-oss, the hybrids) under data-parallel attention
    on ``size`` gloo ranks (whole experts a rank), with two micro-batches (where the batch cuts)
    and without, on ``_batches`` (several sequences, one sequence: a rank with no rows, a prefix
    with its branches, a capture: run whole on every rank): the interleaved schedule ran at two
    ranks; deterministic mode bitwise one process, default mode within 1e-5."""
    import torch.multiprocessing as mp

    out = tmp_path / "got.pt"
    mp.spawn(_layout_worker, args=(size, path, str(tmp_path / "rdv"), str(out)), nprocs=size)
    got = torch.load(out)
    one = load_model(path, "cpu", "float32").model
    for det in (True, False):
        want = run_batches(one, det, 2, 1)
        # two ranks cut batch 0 into micro-batches; four leave no rank two sequences of 2+ rows
        assert (set(got[det, 2][1]) == {2} if size == 2 else not got[det, 2][1]) and got[det, 0][1] == []
        for micro in (2, 0):
            for i, (h, w) in enumerate(zip(got[det, micro][0], want)):
                if det:
                    assert torch.equal(h, w), (det, micro, i)
                else:
                    assert (h - w).abs().max().item() <= 1e-5, (det, micro, i)


def test_cli_and_scorer_take_the_option(dirs):
    import argparse

    from logprobe import Scorer
    from logprobe.cli.common import ScorerOptions, model_parser

    parser = argparse.ArgumentParser(parents=[model_parser()])
    assert ScorerOptions.from_args(parser.parse_args(["--tp", "2", "--attention-parallel", "tensor"])
                                   ).attention_parallel == "tensor"
    assert parser.parse_args([]).attention_parallel is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-parallel", "rows"])
    with pytest.raises(LogprobeError) as e:  # before any process starts
        Scorer(str(dirs["qwen3_moe"]), device="cpu", dtype="float32", progress=False, tensor_parallel_size=2,
               expert_parallel_size=1, attention_parallel="data")
    assert e.value.field == "attention_parallel"


@pytest.mark.slow  # slow tier: two Scorers of two gloo workers each
def test_scorer_layouts_equal_one_process(dirs):
    """Through the Scorer: left out, TP = 2 runs data-parallel attention (whole experts per rank)
    under the default budget of both ranks' rows, its batches laid out for the ranks
    (``plan_work(ranks=2)``); "tensor" asks for heads split; deterministic mode gives one
    process's bits in both."""
    from test_moe_parallel import OPTS, _bits_equal, _seqs

    from logprobe import Scorer

    path = str(dirs["qwen3_moe"])
    seqs = _seqs() + [{"prompt_token_ids": list(range(200, 220)), "completion_token_ids": list(range(220, 241))}]
    cfg = EngineConfig(deterministic=True, progress=False)
    want = Scorer(path, device="cpu", dtype="float32", config=cfg).logprobs(seqs, **OPTS)
    held = {}
    inputs = [(q["prompt_token_ids"] + q["completion_token_ids"])[:-1] for q in seqs]
    # the ranks' layout moves trees here (rows 73, 40, 31, 19, 18, 7: 113 | 75 -> 97 | 91)
    assert plan_work(inputs, 10**6, ranks=2) != plan_work(inputs, 10**6)
    for layout in (None, "tensor"):
        with Scorer(path, device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2,
                    attention_parallel=layout) as s:
            assert s.attention_parallel == (layout or "data")
            assert s.config.max_batch_tokens == (2 if layout is None else 1) * CPU_BUDGET  # both ranks' rows
            assert _bits_equal(s.logprobs(seqs, **OPTS), want), layout
            held[layout] = s.engine.param_bytes[0][0]
    assert held[None] > held["tensor"]  # the workers hold attention whole under "data"


# ---- one MoE block over two gloo ranks, rows split: its collectives and its numbers ----

def _block_worker(rank: int, size: int, rdv: str, out: str) -> None:
    import torch.distributed as dist
    from test_moe_parallel import _layer_block, _numerics, _Recording

    class Recording(_Recording):
        def reduce_scatter_sum(self, x):
            self.calls.append(("reduce_scatter_sum", tuple(x.shape)))
            return super().reduce_scatter_sum(x)

        def all_to_all(self, x, send, recv):
            self.calls.append(("all_to_all", tuple(x.shape), sum(recv)))
            return super().all_to_all(x, send, recv)

        def all_gather(self, x):  # recorded once, by its start
            return self.all_gather_start(x).wait()

        def all_gather_start(self, x):
            self.calls.append(("all_gather", tuple(x.shape)))
            return super().all_gather_start(x)

        def tree_reduce_scatter_start(self, x, out=None):
            self.calls.append(("tree_reduce_scatter", tuple(x.shape)))
            return super().tree_reduce_scatter_start(x, out)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    ctx = Recording(rank, size, None, blocks=8, experts=size, attention="data")
    block, x = _layer_block(ctx, torch.float32)
    got = {}
    for bounds in ((0, 20, 37), (0, 0, 37)):
        split = RowSplit(bounds, rank)
        a, b = split.own
        for det in (False, True):
            block.set_numerics(_numerics(det, size))
            ctx.calls = []
            y = block(x[a:b], None, split)
            got[bounds, det] = (split.gather(ctx, y), ctx.calls[:-1])  # the last call: this gather
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


def test_block_rows_split_collectives_and_numbers(tmp_path):
    """One MoE block (8 experts, top-4, T = 37) over 2 gloo ranks owning rows 0:20 | 20:37 and 0:0 |
    0:37. Each rank all-gathers x [m, H] and the routing [m, 2k]; default mode reduce-scatters one
    float32 [2m, H] (within 1e-5 of one process and of float64); deterministic mode reduce-scatters
    its subtree of the combine tree, also one float32 [2m, H], and is one process's bits."""
    import torch.multiprocessing as mp
    from test_moe_parallel import LAYER, _layer_block, _numerics

    out = tmp_path / "got.pt"
    mp.spawn(_block_worker, args=(2, str(tmp_path / "rdv"), str(out)), nprocs=2)
    got = torch.load(out)
    H, k = LAYER["H"], LAYER["k"]
    one, x = _layer_block(ParallelContext(blocks=8), torch.float32)
    ref64, x64 = _layer_block(ParallelContext(blocks=8), torch.float64)
    want64 = ref64(x64)
    for bounds, m in (((0, 20, 37), 20), ((0, 0, 37), 37)):
        for det in (False, True):
            one.set_numerics(_numerics(det, 1))
            want = one(x)
            y, calls = got[bounds, det]
            assert calls[:2] == [("all_gather", (m, H)), ("all_gather", (m, 2 * k))], calls
            if det:
                assert torch.equal(y, want), bounds
                assert calls[2:] == [("tree_reduce_scatter", (2 * m, H))], calls
                continue
            assert calls[2:] == [("reduce_scatter_sum", (2 * m, H))], calls
            d_one, d_64 = (y - want).abs().max().item(), (y.double() - want64).abs().max().item()
            print(f"rows {bounds} default mode: vs one process {d_one:.2e}, vs float64 {d_64:.2e}")
            assert d_one <= 1e-5 and 0 < d_64 <= 1e-5, (bounds, d_one, d_64)

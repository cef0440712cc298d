"""Deterministic mode's MoE combine as a fixed tree of expert leaves (``layers.moe.combine_tree``)
and the reduce-scatter that finishes it over ranks (``ParallelContext.tree_reduce_scatter_start``).

A rank holding leaves ``r * G / P .. (r + 1) * G / P - 1`` computes one subtree; recursive halving
adds the subtrees in the same tree, so every expert-parallel size gives one process's bits:

* the Triton kernel (``kernels.moe.combine_leaves``, under the interpreter) is bitwise the PyTorch
  definition, garbage in the slots it must not read included;
* the subtrees of 2, 4 and 8 "ranks" added as the tree adds them are bitwise the whole tree;
* the reduce-scatter over 4 and 8 gloo processes is bitwise that tree, each rank's block its own;
* the tree and the position order are pinned by gold tables.
"""

from __future__ import annotations

import pytest
import torch

from logprobe.kernels.moe import tree_leaves
from logprobe.layers.moe import combine_tree
from logprobe.parallel.context import tree_positions


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _case(T=24, k=4, H=40, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, k, H, generator=g)
    w = torch.rand(T, k, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k], distinct per token
    return y, w, ids


def test_tree_order_gold():
    """The tree adds neighbours first: leaves (a, b, c, d) -> (a + b) + (c + d). Chosen so that
    another order rounds differently: 1e8 + 1 - 1e8 in float32."""
    y = torch.tensor([[[1e8], [1.0], [-1e8], [1.0]]])  # one token, four slots, one per leaf
    w = torch.ones(1, 4)
    leaf = torch.tensor([[0, 1, 2, 3]])
    # (1e8 + 1) + (-1e8 + 1) = 1e8 + (-1e8) = 0 in float32 (each pair rounds its 1 away)
    assert combine_tree(y, w, leaf, 4).item() == 0.0
    # slot order would give ((1e8 + 1) - 1e8) + 1 = 1
    assert combine_tree(y, w, torch.tensor([[0, 0, 0, 0]]), 4).item() == 1.0
    assert [tree_leaves(e) for e in (128, 256, 160, 60, 32, 8, 6, 7)] == [8, 8, 8, 4, 8, 8, 2, 1]
    assert tree_positions(4) == [0, 2, 1, 3] and tree_positions(8) == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_subtrees_finish_the_whole_tree(ranks):
    """Rank r's partial over its leaves, the partials added pairwise (neighbours first), is bitwise
    the one-process tree: what ``tree_reduce_scatter_start`` does over processes."""
    y, w, ids = _case()
    E, G = 16, tree_leaves(16)
    whole = combine_tree(y, w, ids // (E // G), G)
    per = E // ranks
    parts = []
    for r in range(ranks):
        local = ids - r * per
        own = (local >= 0) & (local < per)
        parts.append(combine_tree(y, w, torch.where(own, local // (E // G), -1), G // ranks))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    assert torch.equal(_bits(parts[0]), _bits(whole))
    slot_order = (y * w[..., None]).sum(1)  # another order: differs somewhere (the test can fail)
    assert not torch.equal(_bits(slot_order), _bits(whole))


KERNEL_CHECK = """
import torch
from test_moe_tree import _bits, _case
from logprobe.kernels import moe as kmoe
from logprobe.layers.moe import combine_tree, combine_tree_to
for leaves in (1, 2, 4, 8):
    y, w, ids = _case(T=16, k=4, H=40, E=16, seed=leaves)
    leaf = ids // 2 - 2  # leaves -2 .. 5: some slots not here
    y[(leaf < 0) | (leaf >= leaves)] = float("nan")
    want = combine_tree(y, w, leaf, leaves)
    got = kmoe.combine_leaves(y.reshape(-1, 40), w, leaf, leaves)
    assert not want.isnan().any() and torch.equal(_bits(got), _bits(want)), leaves
    pos = torch.tensor([0, 2, 1, 3])
    placed = kmoe.combine_leaves(y.reshape(-1, 40), w, leaf, leaves, torch.float32, pos)
    assert torch.equal(_bits(placed.view(4, 4, 40)[pos]), _bits(want.view(4, 4, 40))), leaves
    assert torch.equal(_bits(combine_tree_to(y, w, leaf, leaves, torch.float32, [0, 2, 1, 3])), _bits(placed))
    half = kmoe.combine_leaves(y.reshape(-1, 40).bfloat16(), w, leaf, leaves)  # bf16 rows (the interpreter's
    assert torch.equal(_bits(half), _bits(combine_tree(y.bfloat16(), w, leaf, leaves))), leaves  # own bf16 rounding differs)
print("ok")
"""


def test_kernel_bitwise_the_definition():
    """``combine_leaves`` under Triton's interpreter, 1, 2, 4 and 8 leaves: bitwise ``combine_tree``
    (float32 and bf16 rows; the bf16 output's rounding is checked on CUDA), the slots outside this rank's leaves holding NaN (never read), rows
    placed by block positions."""
    from helpers import run_interpreted

    pytest.importorskip("triton")
    r = run_interpreted(KERNEL_CHECK)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _rs_worker(rank: int, size: int, rdv: str, out: str) -> None:
    import torch.distributed as dist

    from logprobe.parallel.context import ParallelContext

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    ctx = ParallelContext(rank, size, dist.group.WORLD)
    x = _partial(rank, size)  # [size * n, H], block of rank b at position tree_positions(size).index(b)
    block = ctx.tree_reduce_scatter_start(x).wait()
    torch.save(block, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _partial(rank: int, size: int, n: int = 3, H: int = 8) -> torch.Tensor:
    """Rank ``rank``'s partial, rows by block in rank order (values with wide exponents, so that
    another order of the sum rounds differently)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size * n, H, generator=g) * torch.logspace(-3, 8, H)


@pytest.mark.slow
@pytest.mark.parametrize("size", [4, 8])
def test_tree_reduce_scatter_over_gloo(size, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "block"
    # each rank's input in the tree's position order
    order = tree_positions(size)
    mp.spawn(_rs_worker, args=(size, str(tmp_path / "rdv"), str(out)), nprocs=size)
    n = 3
    for r in range(size):
        got = torch.load(f"{out}.{r}")
        # rank r's block position, each rank's value of it, added as the tree adds them
        p = order.index(r)
        sums = [_partial(q, size)[p * n:(p + 1) * n] for q in range(size)]
        while len(sums) > 1:
            sums = [sums[i] + sums[i + 1] for i in range(0, len(sums), 2)]
        assert torch.equal(_bits(got), _bits(sums[0])), r
        ring = sum(_partial(q, size)[p * n:(p + 1) * n] for q in reversed(range(size)))
        assert not torch.equal(_bits(ring), _bits(sums[0]))  # another order rounds otherwise


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_deterministic_expert_layer_over_ranks_is_one_process(size, tmp_path):
    """One MoE block (8 experts, top-4: 8 leaves) under data-parallel attention over ``size`` gloo
    ranks in deterministic mode: each rank's rows, sent whole or in two parts (the transfers beside
    the experts), are bitwise one process's rows (``combine_tree`` there, subtrees summed by
    ``tree_reduce_scatter_start`` here); uneven shares pad a rank's rows. At 8 ranks (one expert
    and one leaf a rank, the eight-GPU layout) a rank owns no row at all (its gathers send pad only)."""
    import torch.multiprocessing as mp
    from test_moe_parallel import LAYER, _layer_block, _numerics, _parts_worker

    from logprobe.parallel.context import ParallelContext

    T = LAYER["T"]
    bounds = {2: (0, 21, T), 4: (0, 9, 21, 30, T), 8: (0, 5, 9, 9, 16, 21, 28, 30, T)}[size]
    out = tmp_path / "got"
    mp.spawn(_parts_worker, args=(size, str(tmp_path / "rdv"), str(out), True, bounds), nprocs=size)
    one, x = _layer_block(ParallelContext(blocks=8), torch.float32)
    one.set_numerics(_numerics(True, 1))
    want = one(x)
    for name in ("whole", "parts"):
        got = torch.cat([torch.load(f"{out}.{r}")[name] for r in range(size)])
        assert torch.equal(_bits(got), _bits(want)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_bitwise_the_definition(dtype):
    """On CUDA, ``combine_leaves`` (rounded to float32 or bf16) is bitwise ``combine_tree`` computed
    by PyTorch's CUDA elementwise ops, at a model's width and 8 leaves."""
    from logprobe.kernels.moe import combine_leaves

    y, w, ids = _case(T=300, k=8, H=2048, E=128, seed=3)
    y, w, ids = y.cuda().to(dtype), w.cuda(), ids.cuda()
    for leaves, leaf in ((8, ids // 16), (4, ids // 16 - 4), (1, ids // 128)):
        want = combine_tree(y, w, leaf, leaves).to(dtype)
        got = combine_leaves(y.reshape(-1, 2048), w, leaf, leaves, dtype)
        assert torch.equal(got, want), leaves

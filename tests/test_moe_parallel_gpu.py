"""One MoE block over two GPUs (NCCL): skipped unless CUDA sees at least two devices.

Each rank builds the block of its (TP, EP) = (2, 2) (eight whole experts a GPU) or (2, 1) (every
expert split in two: the fused kernel's halves and the gather of the intermediate) from the same
whole bf16 weights and input, and runs it in default mode (each rank combines its slots, one
float32 [T, H] sum over the GPUs) and in deterministic mode (the -0.0 buffer of [T*k, H], (2, 2)
only: split experts are refused there on CUDA). Compared with the same block on one GPU and with
a float64 forward on the same routing: default mode within bf16 rounding (no further from float64
than one GPU is, plus one bf16 ulp; within two ulps of one GPU), deterministic mode bitwise one GPU.

The same block with rows split between the GPUs (data-parallel attention: each GPU routes its
own rows, gathers every GPU's, returns each row's output to its GPU) against one GPU too.

    pytest -m gpu tests/test_moe_parallel_gpu.py -s        # prints the measured distances"""

from __future__ import annotations

import pytest
import torch

from logprobe.config import EngineConfig, numerics_for
from logprobe.kernels.moe import moe_reference
from logprobe.layers.moe import MoeBlock, MoeSpec, route
from logprobe.parallel.context import ParallelContext

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]
E, K, H, INTER, T = 16, 4, 512, 256, 3001  # T odd: the padded row blocks of the sum


def _block(ctx: ParallelContext, device: str, dtype: torch.dtype):
    """The block of ``ctx``'s rank (its experts and rows of the whole weights) and the input x [T, H]."""
    g = torch.Generator().manual_seed(7)
    w = {"router": torch.randn(E, H, generator=g) / H**0.5, "x": torch.randn(T, H, generator=g)}
    for name, shape in (("gate_proj", (E, INTER, H)), ("up_proj", (E, INTER, H)), ("down_proj", (E, H, INTER))):
        w[name] = torch.randn(*shape, generator=g) / shape[-1]**0.5
    block = MoeBlock(MoeSpec(E, K, INTER, norm_topk_prob=True), H, "r", ctx=ctx)
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            (e0, e1), (r0, r1) = block.experts.held(name)
            getattr(block.experts, name).copy_(w[name][e0:e1, r0:r1])
    return block.to(device, dtype), w["x"].to(device, dtype)


def _numerics(det: bool, size: int):
    return numerics_for(EngineConfig(deterministic=det, progress=False), "cuda", tp_size=size, tp_blocks=8)


def _worker(rank: int, experts: int, rdv: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rdv}", rank=rank, world_size=2)
    block, x = _block(ParallelContext(rank, 2, None, blocks=8, experts=experts), f"cuda:{rank}", torch.bfloat16)
    got = {}
    for det in (False, True) if experts == 2 else (False,):
        block.set_numerics(_numerics(det, 2))
        with torch.no_grad():
            got[det] = block(x).cpu()
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("experts", [2, 1])
def test_block_on_two_gpus(experts, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "got.pt"
    mp.spawn(_worker, args=(experts, str(tmp_path / "rdv"), str(out)), nprocs=2)
    got = torch.load(out)
    one, x = _block(ParallelContext(blocks=8), "cuda:0", torch.bfloat16)
    one.set_numerics(_numerics(False, 1))
    with torch.no_grad():
        want = one(x).cpu().float()
        _, weights, ids = route(one.gate(x), K, True)  # the routing every rank and one GPU compute
        ex = one.experts
        y = moe_reference(x.double(), ids, ex.gate_proj.double(), ex.up_proj.double(), ex.down_proj.double())
        exact = (y.view(T, K, H) * weights.double()[..., None]).sum(1).cpu()  # [T, H] float64, same routing
    default = got[False].float()
    ulp = want.abs().max().item() * 2.0**-7  # at least one bf16 ulp of every element
    d_one = (default - want).abs().max().item()
    e_two, e_one = (default - exact).abs().max().item(), (want - exact).abs().max().item()
    print(f"TP=2 EP={experts}: default vs one GPU {d_one:.3e}, vs float64 {e_two:.3e} (one GPU {e_one:.3e})")
    assert e_two <= e_one + ulp, (e_two, e_one)
    assert d_one <= 2 * ulp
    if experts == 2:
        one.set_numerics(_numerics(True, 1))
        with torch.no_grad():
            assert torch.equal(got[True], one(x).cpu())


def _rows_worker(rank: int, size: int, bounds: tuple[int, ...], overlap_rows: int, rdv: str, out: str) -> None:
    """Data-parallel attention's MoE layer: rank r holds rows bounds[r]:bounds[r + 1] of x; a layer's
    rows go in parts from ``overlap_rows`` own rows on (``Experts.OVERLAP_ROWS``)."""
    import torch.distributed as dist

    from logprobe.layers.moe import Experts
    from logprobe.parallel.rows import RowSplit

    torch.cuda.set_device(rank)
    Experts.OVERLAP_ROWS = overlap_rows
    dist.init_process_group("nccl", init_method=f"file://{rdv}", rank=rank, world_size=size)
    ctx = ParallelContext(rank, size, None, blocks=8, experts=size, attention="data")
    block, x = _block(ctx, f"cuda:{rank}", torch.bfloat16)
    split = RowSplit(bounds, rank)
    a, b = split.own
    got = {}
    for det in (False, True):
        block.set_numerics(_numerics(det, size))
        with torch.no_grad():
            got[det] = split.gather(ctx, block(x[a:b], None, split)).cpu()
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("bounds,overlap_rows", [((0, 1400, T), 2048), ((0, 0, T), 2048), ((0, 1400, T), 256),
                                                 ((0, 700, 1500, 2300, T), 2048), ((0, 700, 1500, 2300, T), 256)])
def test_block_rows_split_on_gpus(bounds, overlap_rows, tmp_path):
    """Each GPU owns its rows (``bounds``; one GPU none), 2 or 4 GPUs, the layer whole or in parts:
    default mode within two bf16 ulps of one GPU, deterministic mode (each rank's subtree of the
    combine tree, summed over the GPUs by recursive halving) bitwise one GPU."""
    import torch.multiprocessing as mp

    size = len(bounds) - 1
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    out = tmp_path / "got.pt"
    mp.spawn(_rows_worker, args=(size, bounds, overlap_rows, str(tmp_path / "rdv"), str(out)), nprocs=size)
    got = torch.load(out)
    one, x = _block(ParallelContext(blocks=8), "cuda:0", torch.bfloat16)
    with torch.no_grad():
        one.set_numerics(_numerics(False, 1))
        want = one(x).cpu().float()
        one.set_numerics(_numerics(True, 1))
        det = one(x).cpu()
    ulp = want.abs().max().item() * 2.0**-7
    d_one = (got[False].float() - want).abs().max().item()
    print(f"rows {bounds}, parts from {overlap_rows}: default vs one GPU {d_one:.3e}")
    assert d_one <= 2 * ulp
    assert torch.equal(got[True], det)

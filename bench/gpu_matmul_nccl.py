"""Do the dense products slow down beside NCCL's collectives across two GPUs?

Deterministic mode computes its products with the fixed-tile Triton matmul
(``logprobe.kernels.matmul``), a persistent grid of one program per SM. Across GPUs the
collectives of expert and tensor parallelism run beside it on their own blocks. This script times
a mixture-of-experts layer's two attention products (Qwen3-30B-A3B: qkv [M, 2048] x [5120, 2048],
o [M, 4096] x [2048, 4096], M = 65,536 rows) on each of two GPUs, alone and beside a stream of the
layer's traffic (an all-gather of bf16 rows, a reduce-scatter of float32 partials). It compares
cuBLAS, the matmul with a program on every SM, with ``free_sms`` SMs left free (what the workers
run across GPUs: ``config.COLLECTIVE_SMS``), and with one program per tile. It also checks each
variant's bits against the default's. ``--nccl-env NCCL_MAX_CTAS=16`` caps NCCL's blocks, as
the workers do by default.

    python bench/gpu_matmul_nccl.py
    python bench/gpu_matmul_nccl.py --free 8,16,32 --nccl-env NCCL_MAX_CTAS=16,NCCL_MIN_CTAS=1

Prints one markdown table (rank 0's times: ms a product, alone and beside the traffic).
"""

from __future__ import annotations

import argparse
import os
import time

PORT = 29517


def timed(fn, reps: int = 10, sync: bool = True) -> float:
    """ms per call of ``fn`` on the current stream. ``sync``: wait for the whole device after the
    warm-up call first (False beside traffic: the collectives keep running on their stream)."""
    import torch

    fn()
    if sync:
        torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def variants(free: list[int]) -> dict:
    from logprobe.kernels.matmul import DEFAULT_CONFIG, MatmulConfig

    out = {"persistent, every SM": DEFAULT_CONFIG}
    out.update({f"persistent, {n} SMs free": MatmulConfig(free_sms=n) for n in free})
    out["one program per tile"] = MatmulConfig(persistent=False)
    return out


def product_rows(rank: int, free: list[int], rows: int) -> list[tuple]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from logprobe.kernels.matmul import invariant_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    ag_in = torch.randn(rows // 2, 2048, device="cuda", dtype=torch.bfloat16)  # half the rows: this rank's
    ag_out = torch.empty(rows, 2048, device="cuda", dtype=torch.bfloat16)
    rs_in = torch.randn(rows, 2048, device="cuda")  # float32 partials of every rank's rows
    rs_out = torch.empty(rows // 2, 2048, device="cuda")

    def traffic(n: int) -> None:
        for _ in range(n):
            dist.all_gather_into_tensor(ag_out, ag_in, async_op=True)
            dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True)

    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    traffic(10)
    torch.cuda.synchronize()
    pair_ms = (time.perf_counter() - t0) * 100
    out = []
    for name, (N, K) in {"qkv": (5120, 2048), "o": (2048, 4096)}.items():
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        ref = invariant_linear(x, w)
        fns = {"cuBLAS": (lambda x=x, w=w: F.linear(x, w), "-")}
        for vname, c in variants(free).items():
            same = torch.equal(invariant_linear(x, w, config=c), ref)
            fns[vname] = ((lambda x=x, w=w, c=c: invariant_linear(x, w, config=c)), same)
        for vname, (fn, same) in fns.items():
            alone = timed(fn)
            n = torch.tensor([int(alone * 10 * 1.5 / pair_ms) + 4], device="cuda")
            dist.all_reduce(n, op=dist.ReduceOp.MAX)  # the same collectives on both ranks
            dist.barrier()
            torch.cuda.synchronize()
            traffic(int(n.item()))
            beside = timed(fn, sync=False)
            torch.cuda.synchronize()
            out.append((name, vname, alone, beside, same))
    return out


def worker(rank: int, free: list[int], rows: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    out = product_rows(rank, free, rows)
    if rank == 0:
        print(f"| product (M = {rows}) | kernel | alone ms | beside NCCL ms | beside / alone | bits = default |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for name, vname, a, b, same in out:
            print(f"| {name} | {vname} | {a:.3f} | {b:.3f} | {b / a:.2f} | {same} |", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--free", default="16", help="comma-separated SM counts the persistent grid leaves free")
    ap.add_argument("--rows", type=int, default=65536, help="rows of each product (a micro-batch's)")
    ap.add_argument("--nccl-env", default="", help="KEY=VALUE,... for NCCL, set before the two processes start")
    args = ap.parse_args()
    for item in filter(None, args.nccl_env.split(",")):
        key, _, value = item.partition("=")
        if not key.startswith("NCCL_") or not value:
            ap.error(f"--nccl-env: {item!r} is not NCCL_NAME=value")
        os.environ[key] = value
    free = [int(n) for n in args.free.split(",") if n]
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(free, args.rows), nprocs=2)


if __name__ == "__main__":
    main()

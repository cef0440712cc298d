"""The MoE layer's two transfers over NCCL and over the GPUs' copy engines, alone and beside compute.

Under data-parallel attention a mixture-of-experts layer at P ranks gathers every rank's rows (bf16,
[P*m, H]) and reduce-scatters the float32 partial sums of its experts ([P*m, H] -> [m, H]). This
script times both, per layer-sized call, in three ways:

* ``nccl``: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (NCCL's kernels, on its stream);
* ``ce``: PyTorch's symmetric-memory ``_low_contention_all_gather`` / ``_reduce_scatter`` (peer
  copies by the copy engines, no multiprocessor for the transfer; the reduction a small kernel);

each alone, then beside a stream of bf16 matrix products (the stand-in for the expert kernels):
how long the products take with the transfer running beside them, and how long both take together.
It checks that both ways give the same bits (two ranks: a + b in either order).

    python3 bench/gpu_transfers.py --rows 61440 --hidden 2048 --reps 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_ops(group):
    def gather(x):
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    def scatter(p):
        out = p.new_empty(p.shape[0] // dist.get_world_size(group), *p.shape[1:])
        dist.reduce_scatter_tensor(out, p, group=group)
        return out
    return gather, scatter


def ce_ops(group):
    import torch.distributed._symmetric_memory  # noqa: F401 - registers the symm_mem ops

    name = group.group_name

    def gather(x):
        out = torch.ops.symm_mem._low_contention_all_gather(x, name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def scatter(p):
        out = torch.ops.symm_mem._low_contention_reduce_scatter(p, "sum", name)
        return torch.ops._c10d_functional.wait_tensor(out)
    return gather, scatter


def timed(fn, reps: int) -> float:
    """ms per call, the ranks started together."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def worker(rank: int, size: int, port: int, args, out_q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=dev)
    group = dist.group.WORLD
    g = torch.Generator(device=dev).manual_seed(rank)
    m, H = args.rows, args.hidden
    x = torch.randn(m, H, device=dev, dtype=torch.bfloat16, generator=g)
    p = torch.randn(size * m, H, device=dev, dtype=torch.float32, generator=g)
    a = torch.randn(args.gemm, args.gemm, device=dev, dtype=torch.bfloat16, generator=g)
    rows = {"peer_access": all(torch.cuda.can_device_access_peer(rank, q) for q in range(size) if q != rank)}
    ways = {"nccl": nccl_ops(group)}
    try:
        ways["ce"] = ce_ops(group)
        ways["ce"][0](x)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        rows["ce_error"] = f"{type(e).__name__}: {e}"[:300]
        ways.pop("ce")
    got = {w: (gather(x), scatter(p)) for w, (gather, scatter) in ways.items()}
    if "ce" in got:
        rows["same_gather"] = torch.equal(got["ce"][0], got["nccl"][0])
        rows["same_scatter"] = torch.equal(got["ce"][1], got["nccl"][1])
    gemm = lambda: [a @ a for _ in range(args.gemms)]  # noqa: E731
    rows["gemm_ms"] = timed(gemm, args.reps)
    side = torch.cuda.Stream(device=dev)
    for w, (gather, scatter) in ways.items():
        for what, fn, arg in (("gather", gather, x), ("scatter", scatter, p)):
            rows[f"{w}_{what}_ms"] = timed(lambda fn=fn, arg=arg: fn(arg), args.reps)

            def both(fn=fn, arg=arg):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn(arg)
                gemm()
                torch.cuda.current_stream().wait_stream(side)
            rows[f"{w}_{what}_beside_total_ms"] = timed(both, args.reps)
    if rank == 0:
        out_q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=61440, help="own rows per rank (m)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--gemm", type=int, default=4096, help="the compute stand-in: [n, n] @ [n, n] bf16")
    ap.add_argument("--gemms", type=int, default=16, help="products per call")
    ap.add_argument("--reps", type=int, default=16)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, q))
             for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=600)
    for pr in procs:
        pr.join()
    m, H, P = args.rows, args.hidden, args.ranks
    gather_gb = (P - 1) * m * H * 2 / 1e9  # sent per rank
    scatter_gb = (P - 1) * m * H * 4 / 1e9
    print(json.dumps({"args": vars(args), **rows}))
    print("| way | gather ms (GB/s) | reduce-scatter ms (GB/s) | products alone ms | products + gather ms | "
          "products + reduce-scatter ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for w in ("nccl", "ce"):
        if f"{w}_gather_ms" not in rows:
            continue
        g, s = rows[f"{w}_gather_ms"], rows[f"{w}_scatter_ms"]
        print(f"| {w} | {g:.2f} ({gather_gb / g * 1e3:.0f}) | {s:.2f} ({scatter_gb / s * 1e3:.0f}) | "
              f"{rows['gemm_ms']:.2f} | {rows[f'{w}_gather_beside_total_ms']:.2f} | "
              f"{rows[f'{w}_scatter_beside_total_ms']:.2f} |")


if __name__ == "__main__":
    main()

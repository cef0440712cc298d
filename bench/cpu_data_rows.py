"""Data-parallel attention's row balance on W1, on CPU (no model): the engine's batches (its planner
``plan_work`` and its packing ``pack``, shared prefixes on) at each budget, each cut over the ranks
as the model cuts it (``assign_rows(meta.cuts(), N)``: never inside a prefix tree). Printed per
budget and layout (``given``: the trees in the planner's order; ``balanced``: as the engine lays
them out under data-parallel attention, ``plan_work(ranks=N)``): the batches, their rows, the
busiest rank's rows over the even share per batch (max / (T / N): 1.00 is perfect), and over the
whole run (sum of max / sum of T / N); the bound on the speed-up of the attention and dense
layers from the cuts alone is the rows of the one-rank plan over the busiest ranks' rows summed
(laid out for the ranks, a tree over a rank's share is split and repeats its prefix: more rows).

    python bench/cpu_data_rows.py
    python bench/cpu_data_rows.py --budgets 32768,65536,131072 --ranks 2,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import workload  # noqa: E402

from logprobe.engine.runner import pack  # noqa: E402
from logprobe.engine.scheduler import plan_work  # noqa: E402
from logprobe.parallel.rows import assign_rows  # noqa: E402


def balance(reqs, budget: int, ranks: int, balanced: bool) -> dict:
    """One plan of ``reqs`` at ``budget``: per batch (rows, trees, busiest / even share) and the totals."""
    plan = plan_work([r.inputs for r in reqs], budget, ranks=ranks if balanced else 1)
    one = sum(pack(b, reqs, torch.device("cpu")).meta.num_rows for b in plan_work([r.inputs for r in reqs], budget))
    batches, rows, busiest = [], 0, 0
    for batch in plan:
        meta = pack(batch, reqs, torch.device("cpu")).meta
        bounds = assign_rows(meta.cuts(), ranks)
        top = max(b - a for a, b in zip(bounds, bounds[1:]))
        batches.append((meta.num_rows, len(batch), round(top * ranks / meta.num_rows, 2)))
        rows, busiest = rows + meta.num_rows, busiest + top
    return dict(budget=budget, ranks=ranks, layout="balanced" if balanced else "given", batches=len(plan),
                rows=rows, imbalance=round(busiest * ranks / rows, 3), bound=round(one / busiest, 2),
                per_batch=batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="32768,65536,131072", help="max_batch_tokens of a pass (all ranks)")
    ap.add_argument("--ranks", default="2", help="data-parallel attention sizes, comma-separated")
    ap.add_argument("--workload", default="W1", choices=["W1", "W2", "W3"])
    args = ap.parse_args()
    reqs = workload(args.workload, 151936)
    print(f"{args.workload}: {len(reqs)} requests, {sum(r.num_inputs for r in reqs)} input tokens")
    print("| ranks | budget | layout | batches | rows | busiest / share | bound | per batch (rows, trees, busiest / share) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for n in map(int, args.ranks.split(",")):
        for budget in map(int, args.budgets.split(",")):
            for balanced in (False, True):
                r = balance(reqs, budget, n, balanced)
                print(f"| {n} | {budget} | {r['layout']} | {r['batches']} | {r['rows']} | {r['imbalance']:.3f} | "
                      f"{r['bound']:.2f}x | {r['per_batch']} |", flush=True)


if __name__ == "__main__":
    main()

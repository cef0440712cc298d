"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention) on the GPU: the per-sequence float32
reference, the batched PyTorch rule and fla-core's Triton rule, and the short conv.

One CUDA GPU, Qwen3.5-9B-like layer shapes (Hk = 16, Hv = 32, Dk = Dv = 128, bf16 q/k/v/beta,
float32 g; conv over C = 2 Hk Dk + Hv Dv = 8192 channels, K = 4) over W1's 256 sequences
(prompt + completion lengths, ~0.5M tokens) packed into layer calls of at most ``--budget`` tokens
(the engine's CUDA budget). Per kernel: ms per layer call (best of ``--passes`` over all the
calls), million tokens/s, max |Δ| of the outputs and final states against the float32 reference on
the first call's sequences (the same bf16 inputs, upcast), and batch invariance: the first call's
sequences packed with random initial states, then its longest and shortest sequences alone (same
initial state): ``alone = packed`` when outputs and final states are bit-identical; ``rerun`` when
a second packed run repeats the first bit for bit. No timed assertions: it prints one table.

    python bench/gpu_gated_delta.py
    python bench/gpu_gated_delta.py --budget 16384 --passes 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_of, free, gpu_banner, log, workload  # noqa: E402

from logprobe.kernels.gated_delta import (  # noqa: E402
    causal_conv1d_batched,
    chunk_gated_delta_batched,
    chunk_gated_delta_fla,
    fla_available,
)
from logprobe.layers.gated_delta import causal_conv1d, gated_delta_rule_chunked  # noqa: E402

HK, HV, DK, DV, K = 16, 32, 128, 128, 4
CONV_C = 2 * HK * DK + HV * DV


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequences in calls of at most ``budget`` tokens (a longer one alone)."""
    calls, cur, used = [], [], 0
    for n in lengths:
        if cur and used + n > budget:
            calls.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += n
    return calls + ([cur] if cur else [])


def cu_of(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def rule_inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(T, HK, DK, device="cuda", generator=g).to(bf)
    k = torch.randn(T, HK, DK, device="cuda", generator=g).to(bf)
    v = torch.randn(T, HV, DV, device="cuda", generator=g).to(bf)
    # weak decays (exp(g) mostly 0.9..1): the state remembers far back, as in the layer tests
    gate = F.logsigmoid(2 * torch.randn(T, HV, device="cuda", generator=g) + 4)
    beta = torch.rand(T, HV, device="cuda", generator=g).to(bf)
    return q, k, v, gate, beta


def max_delta(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - ref.float()).abs().max().item()
    return d, d / max(ref.float().abs().max().item(), 1e-30)


def invariance(fn, xs, cu: list[int], s0: torch.Tensor, picks: list[int]) -> tuple[bool, bool]:
    """``(alone = packed, rerun identical)`` for ``fn(*xs, cu, s0)``, sequences ``picks``."""
    o, s = fn(*xs, cu, s0)
    o2, s2 = fn(*xs, cu, s0)
    rerun = torch.equal(o, o2) and torch.equal(s, s2)
    same = True
    for i in picks:
        a, b = cu[i], cu[i + 1]
        o1, s1 = fn(*(x[a:b] for x in xs), [0, b - a], s0[i:i + 1])
        same &= torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[i])
    return same, rerun


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=32768, help="tokens per layer call (the engine's CUDA budget)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over all calls (best kept)")
    ap.add_argument("--reference-passes", type=int, default=1, help="passes for the slow per-sequence reference")
    args = ap.parse_args()
    gpu_banner()

    lengths = [len(r.tokens) - 1 for r in workload("W1", 1000)]  # the rows fed to the model
    calls = pack(lengths, args.budget)
    total = sum(lengths)
    log(f"\nW1: {len(lengths)} sequences, {total} tokens, {len(calls)} calls of <= {args.budget} tokens; "
        f"Hk={HK} Hv={HV} Dk={DK} Dv={DV}, bf16 inputs; fla-core {'importable' if fla_available() else 'missing'}")
    x = rule_inputs(total)
    offs = cu_of([sum(c) for c in calls])
    batches = [(tuple(t[offs[j]:offs[j + 1]] for t in x), cu_of(c)) for j, c in enumerate(calls)]

    rules = [("rule: reference (per sequence)", gated_delta_rule_chunked, args.reference_passes),
             ("rule: batched (PyTorch)", chunk_gated_delta_batched, args.passes)]
    if fla_available():
        rules.append(("rule: fla-core (Triton)", chunk_gated_delta_fla, args.passes))

    # the float32 reference on the first call (bf16 inputs upcast), with random initial states
    (q, k, v, g, beta), cu = batches[0]
    n0 = len(cu) - 1
    s0 = torch.randn(n0, HV, DK, DV, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 0.1
    up = (q.float(), k.float(), v.float(), g, beta.float())
    o_ref, s_ref = gated_delta_rule_chunked(*up, cu, s0)
    lens0 = [cu[i + 1] - cu[i] for i in range(n0)]
    picks = sorted({lens0.index(max(lens0)), lens0.index(min(lens0))})

    rows = []
    for name, fn, passes in rules:
        fn(*batches[0][0], batches[0][1])  # compile / autotune outside the timing
        _, sec = best_of(passes, lambda fn=fn: all(fn(*xs, c) is not None for xs, c in batches), name)
        o, s = fn(q, k, v, g, beta, cu, s0)
        do, dor = max_delta(o, o_ref)
        ds, dsr = max_delta(s, s_ref)
        same, rerun = invariance(fn, (q, k, v, g, beta), cu, s0, picks)
        rows.append((name, sec * 1e3 / len(calls), total / sec / 1e6, f"{do:.2e}", f"{dor:.1e}", f"{ds:.2e}",
                     f"{dsr:.1e}", same, rerun))
        free()

    # the conv, over the same calls (one [T, C] bf16 input sliced per call)
    conv_x = torch.randn(max(sum(c) for c in calls), CONV_C, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(CONV_C, K, device="cuda") * 0.5).to(torch.bfloat16)
    conv_batches = [conv_x[:sum(c)] for c in calls]
    c_state = torch.randn(n0, CONV_C, K - 1, device="cuda").to(torch.bfloat16)
    xc = conv_batches[0]
    y_ref, f_ref = causal_conv1d(xc, w, cu, c_state)
    for name, fn, passes in [("conv: reference (per sequence)", causal_conv1d, args.reference_passes),
                             ("conv: batched", causal_conv1d_batched, args.passes)]:
        fn(xc, w, cu)
        _, sec = best_of(passes, lambda fn=fn: all(fn(xb, w, cu_of(c)) is not None for xb, c in zip(conv_batches, calls)), name)
        y, f = fn(xc, w, cu, c_state)
        dy, dyr = max_delta(y, y_ref)
        df, dfr = max_delta(f, f_ref)
        same, rerun = invariance(lambda xx, cc, ss, fn=fn: fn(xx, w, cc, ss), (xc,), cu, c_state, picks)
        rows.append((name, sec * 1e3 / len(calls), total / sec / 1e6, f"{dy:.2e}", f"{dyr:.1e}", f"{df:.2e}",
                     f"{dfr:.1e}", same, rerun))

    log(f"\n## gated delta layer, W1 in {len(calls)} calls (Δ and invariance on call 0: {n0} sequences, "
        f"{cu[-1]} tokens; alone: sequences {picks})")
    log("| kernel | ms / call | M tok/s | max abs Δ out | rel | max abs Δ state | rel | alone = packed | rerun |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        log(f"| {r[0]} | {r[1]:.2f} | {r[2]:.2f} | {r[3]} | {r[4]} | {r[5]} | {r[6]} | {r[7]} | {r[8]} |")


if __name__ == "__main__":
    main()

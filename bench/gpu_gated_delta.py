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
a second packed run repeats the first bit for bit. No timed assertions: it prints tables.

The conv alone (``--conv-only`` skips all but it and fla's inputs): one layer call at the same shapes, ``--conv-tokens``
bf16 tokens in ``--conv-seqs`` sequences with random bf16 initial states, for the conv on CUDA (the
Triton kernel, ``kernels.short_conv``), the batched PyTorch conv (its fallback) and fla-core's
``causal_conv1d`` where it imports (zero initial states: its state layout is its own): median ms of
``triton.testing.do_bench``, GB/s (one read of x, one write of y), max |Δ| of y against the float32
reference (same bf16 inputs), whether y and the final states equal the batched conv's bit for bit,
and alone = packed (the longest and shortest sequences); other tiles of the Triton kernel
(``--conv-tiles``) are timed too.

fla's inputs alone (printed with the conv table): q, k, v as views of a bf16 conv output
``[--conv-tokens, C]`` turned into what fla-core takes (q, k L2-normalised, all three contiguous
bf16) by PyTorch (float32 copies, the norm, casts, the copy fla makes of the strided v) and by the
Triton kernel (``kernels.qk_norm``, the CUDA path): median ms, GB/s (one read, one write), max |Δ|
of q, k against the float64 norm and between the two, the share of elements that differ, and
alone = packed (the first and last 1000 rows alone, bit for bit).

    python bench/gpu_gated_delta.py
    python bench/gpu_gated_delta.py --budget 16384 --passes 5
    python bench/gpu_gated_delta.py --conv-only
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ms, best_of, free, gpu_banner, log, workload  # noqa: E402

from logprobe.kernels.gated_delta import (  # noqa: E402
    causal_conv1d_batched,
    causal_conv1d_fast,
    chunk_gated_delta_batched,
    chunk_gated_delta_fla,
    fla_available,
    fla_inputs,
)
from logprobe.kernels.short_conv import causal_conv1d_triton  # noqa: E402
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


def fla_conv():
    """fla-core's ``causal_conv1d`` behind our signature (y only, zero initial states), or None."""
    try:
        from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    except Exception:
        return None

    def run(x, weight, cu_seqlens=None, initial_state=None, bias=None, activation="silu"):
        if initial_state is not None:
            raise ValueError("fla's conv state is [N, C, K] (its own layout): run with zero states")
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long, device=x.device)
        host = {} if cu_seqlens is None else {"cu_seqlens_cpu": torch.tensor(cu_seqlens, dtype=torch.long)}
        out = fla_causal_conv1d(x=x[None], weight=weight, bias=bias, activation=activation, cu_seqlens=cu, **host)
        y = out[0] if isinstance(out, tuple) else out
        return y[0], None

    return run


def conv_lengths(tokens: int, seqs: int) -> list[int]:
    """``seqs`` lengths of 0.5x to 1.5x the mean, summing to ``tokens`` (fixed seed)."""
    g = torch.Generator().manual_seed(7)
    raw = 0.5 + torch.rand(seqs, generator=g)
    lengths = [max(1, int(v)) for v in (raw / raw.sum() * tokens).tolist()]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def conv_table(tokens: int, seqs: int, device: str = "cuda", time_ms=None, tiles: tuple = ()) -> list[tuple]:
    """The conv alone at Qwen3.5-9B's conv shapes (see the module docstring); rows of
    ``(name, ms, GB/s, max |Δ y| vs reference, y = batched, finals = batched, alone = packed)``.
    ``tiles``: other ``(block_t, block_c)`` of the Triton kernel to time (the tile moves no bit).
    ``time_ms(fn)`` defaults to ``bench_ms`` (CUDA); any device for a smoke run."""
    time_ms = time_ms or bench_ms
    lengths = conv_lengths(tokens, seqs)
    cu = cu_of(lengths)
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(cu[-1], CONV_C, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(CONV_C, K, device=device, generator=g) * 0.5).to(torch.bfloat16)
    s0 = torch.randn(len(lengths), CONV_C, K - 1, device=device, generator=g).to(torch.bfloat16)
    y_ref, _ = causal_conv1d(x, w, cu, s0)
    y_ref0, _ = causal_conv1d(x, w, cu)
    y_b, f_b = causal_conv1d_batched(x, w, cu, s0)
    picks = sorted({lengths.index(max(lengths)), lengths.index(min(lengths))})
    kernels = [("batched (PyTorch)", causal_conv1d_batched, True), ("Triton (the CUDA path)", causal_conv1d_fast, True)]
    for bt, bc in tiles:
        tiled = functools.partial(causal_conv1d_triton, block_t=bt, block_c=bc)
        kernels.append((f"Triton, tile {bt} x {bc}", tiled, True))
    fla = fla_conv()
    if fla is not None:
        kernels.append(("fla-core causal_conv1d (zero states)", fla, False))
    rows = []
    for name, fn, states in kernels:
        try:
            st = s0 if states else None
            ms = time_ms(lambda fn=fn, st=st: fn(x, w, cu, st))
            y, f = fn(x, w, cu, st)
        except Exception as e:  # fla's signature moves between releases: report, go on
            log(f"  {name}: {type(e).__name__}: {e}")
            continue
        dy = (y.float() - (y_ref if states else y_ref0).float()).abs().max().item()
        same_y = torch.equal(y, y_b) if states else "-"
        same_f = torch.equal(f, f_b) if states else "-"
        alone = "-"
        if states:
            alone = True
            for i in picks:
                y1, f1 = fn(x[cu[i]:cu[i + 1]], w, None, s0[i:i + 1])
                alone &= torch.equal(y1, y[cu[i]:cu[i + 1]]) and torch.equal(f1[0], f[i])
        gbs = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
        rows.append((name, ms, gbs, dy, same_y, same_f, alone))
    log(f"\n## short conv alone: {cu[-1]} bf16 tokens in {len(lengths)} sequences, C = {CONV_C}, K = {K}, "
        f"random bf16 initial states (fla: zero)")
    log("| conv | ms | GB/s (x + y) | max abs Δ y vs float32 reference | y = batched | finals = batched | alone = packed |")
    log("| --- | ---: | ---: | ---: | --- | --- | --- |")
    for r in rows:
        log(f"| {r[0]} | {r[1]:.3f} | {r[2]:.0f} | {r[3]:.2e} | {r[4]} | {r[5]} | {r[6]} |")
    return rows


def qk_table(tokens: int, device: str = "cuda", time_ms=None) -> list[tuple]:
    """fla's inputs from the conv output (see the module docstring); rows of ``(name, ms, GB/s,
    max |Δ q, k| vs float64, max |Δ| vs the PyTorch form, share differing, alone = packed)``."""
    time_ms = time_ms or bench_ms
    g = torch.Generator(device=device).manual_seed(3)
    y = torch.randn(tokens, CONV_C, device=device, generator=g).to(torch.bfloat16)  # the conv output [T, C]
    q = y[:, :HK * DK].view(tokens, HK, DK)  # strided views, as packed_gated_delta hands them
    k = y[:, HK * DK:2 * HK * DK].view(tokens, HK, DK)
    v = y[:, 2 * HK * DK:].view(tokens, HV, DV)
    truth = [t.double() / (t.double().square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k)]
    base = fla_inputs(q, k, v, True, triton=False)
    rows = []
    for name, triton in (("PyTorch (float32 norm, casts, v copied)", False), ("Triton (kernels.qk_norm)", True)):
        ms = time_ms(lambda triton=triton: fla_inputs(q, k, v, True, triton=triton))
        out = fla_inputs(q, k, v, True, triton=triton)
        d64 = max((o.double() - t).abs().max().item() for o, t in zip(out, truth))
        dbase = max((o.float() - b.float()).abs().max().item() for o, b in zip(out, base))
        share = sum((o != b).sum().item() for o, b in zip(out[:2], base[:2])) / (2 * q.numel())
        alone = all(torch.equal(a, b[rows_]) for rows_ in (slice(0, 1000), slice(tokens - 1000, tokens))
                    for a, b in zip(fla_inputs(q[rows_], k[rows_], v[rows_], True, triton=triton), out))
        gbs = 2 * y.numel() * y.element_size() / (ms * 1e-3) / 1e9
        rows.append((name, ms, gbs, d64, dbase, share, alone and torch.equal(out[2], base[2])))
    log(f"\n## fla's inputs from the conv output: {tokens} bf16 tokens, q, k {HK} x {DK}, v {HV} x {DV}")
    log("| q, k, v for fla | ms | GB/s | max abs Δ q, k vs float64 | vs PyTorch | share differing | "
        "alone = packed, v equal |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        log(f"| {r[0]} | {r[1]:.3f} | {r[2]:.0f} | {r[3]:.2e} | {r[4]:.2e} | {r[5]:.1e} | {r[6]} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=32768, help="tokens per layer call (the engine's CUDA budget)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over all calls (best kept)")
    ap.add_argument("--reference-passes", type=int, default=1, help="passes for the slow per-sequence reference")
    ap.add_argument("--conv-only", action="store_true", help="only the conv-alone and fla-input tables")
    ap.add_argument("--conv-tokens", type=int, default=16384, help="tokens of the conv-alone call")
    ap.add_argument("--conv-seqs", type=int, default=16, help="sequences of the conv-alone call")
    ap.add_argument("--conv-tiles", default="64x128,16x256,64x64,128x32",
                    help="other Triton tiles (tokens x channels) to time; the default is 32x128")
    args = ap.parse_args()
    gpu_banner()
    tiles = tuple(tuple(int(v) for v in t.split("x")) for t in args.conv_tiles.split(",") if t)
    conv_table(args.conv_tokens, args.conv_seqs, tiles=tiles)
    qk_table(args.conv_tokens)
    if args.conv_only:
        return

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
                             ("conv: batched", causal_conv1d_batched, args.passes),
                             ("conv: Triton (the CUDA path)", causal_conv1d_fast, args.passes)]:
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

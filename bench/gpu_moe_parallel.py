"""Mixtures of experts over several GPUs: (TP, EP) = (1, 1) against (2, 1), (2, 2) (and 4 / 8 where
the machine has them), on a Qwen3-30B-A3B shape, a DeepSeek-V2-Lite / Moonlight MLA shape,
GLM-4.5-Air's, the larger models' (``common.BIG_SHAPES``), gpt-oss's and the hybrid
Qwen3.5-35B-A3B's.

A random-init bf16 checkpoint is written once as a Hugging Face directory with transformers'
in-memory expert layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]);
the workers read only their experts' bytes from it. Scored through the public API (``Scorer``,
default budget: never passed here, so each size runs the budget the engine picks, printed as
``budget``; under data-parallel attention that is the rows of every rank together) on W1 (RL
groups, bench/common.py). Printed per (TP, EP) and mode: seconds (the best of ``--passes`` passes
after a warm-up one, each pass's in ``passes_s``),
input tokens/s, speed-up over (1, 1), max / mean |Δ log-prob| against (1, 1) of the same mode
and a bitwise flag, and the attention layout the row ran (``Scorer.attention_parallel``: "data",
each rank its share of the batch's sequences, the default where EP = TP; "tensor", heads split).
``--attention data,tensor`` times both layouts at each size above one GPU (``auto``, the default:
the model's). Deterministic mode on CUDA runs only where every rank holds whole experts
(EP = TP; other splits are refused there, see docs/parallel.md).

    python bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --sizes 1x1,2x1,2x2      # 2 GPUs
    python bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 --attention data,tensor
    python bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2,4x4    # 4 GPUs
    python bench/gpu_moe_parallel.py --shape mla --fp8 --sizes 1x1,2x1,2x2          # FP8 blocks, 2 GPUs
    python bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2,4x4 --skew 0.5  # skewed router
    python bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,4x4 --skew 0.5 --redundant 2  # replicas
    python bench/gpu_moe_parallel.py --shape gpt-oss-120b --sizes 1x1,2x2 --dir /dev/shm/moe  # MXFP4 experts, 61 GB
    python bench/gpu_moe_parallel.py --shape qwen35-35b-a3b --sizes 1x1,2x2 --attention data,tensor --dir /dev/shm/moe
        # the hybrid MoE (fla-core on CUDA), both attention layouts; --shape tiny-hybrid --device cpu: a trial
    python bench/gpu_moe_parallel.py --shape glm-air --fp8 --sizes 2x2 --dir /dev/shm/moe  # the largest
        # GLM-4.5-Air whole as FP8 blocks (106 GB: more than a two-GPU machine's free disk, so in memory)

Every row above one GPU under data-parallel attention also carries each rank's share of the
pass's rows (``rank_rows``) and of attention's (query, key) pairs (``rank_pairs``, about the sum of
L²/2 over its sequences) as fractions of the whole, from the engine's plan replayed here
(``plan_work(ranks=N)``, ``pack``, the model's cut ``assign_rows``): the imbalance of attention and
the dense layers, without a profiler.

``--profile`` then runs W1 once more at each size with every rank under ``torch.profiler``
(``Scorer.engine.profile``: the real worker processes, NCCL between them; one GPU: the same in
process) and prints per rank: the wall time of the pass, the time the GPU was busy (the union of
its kernels: the rest it sat idle, waiting for launches or a host synchronisation), kernel time by family (gemm,
attention, moe (the fused expert kernels), routing (top-k, sorts, scans, softmax), all-gather,
reduce-scatter, all-to-all, all-reduce, copy, elementwise, head, other), the time it waited in
collectives (each collective's duration minus the shortest rank's on the same call: the rank that
arrived last waited least), its rows, attention pairs and attention TFLOP. ``--profile-dir D``
also writes each rank's kernel list (name, calls, total us) there as JSON. Deterministic
attention runs in PyTorch products, so in ``det`` rows its time is under gemm and elementwise.

    python bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 --profile
    python bench/gpu_moe_parallel.py --shape tiny --device cpu --limit 24 --sizes 1x1,2x2 --profile  # CPU, gloo

``--fp8`` writes the same weights as an FP8 block checkpoint laid out as DeepSeek's (every
``*_proj`` matrix, experts one per expert, as float8_e4m3fn with ``weight_scale_inv`` per 128 x 128
block; norms, embeddings, routers and lm_head bf16; ``quantization_config`` quant_method "fp8"):
each rank then reads its rows of the FP8 weights and keeps them FP8 (docs/parallel.md, FP8 block
checkpoints). Its rows compare FP8 sizes against FP8 (1, 1); against the bf16 run of the same
shape they differ by the quantization, not by an error.

``--random-weights`` writes no checkpoint: config.json and the tokenizer alone, and each rank builds
its own shard at random on its GPU (``Scorer(load_format=RandomWeights(skew=...))``,
``logprobe.loading.dummy``; with ``--fp8`` as FP8 blocks), so models larger than the machine's disk
and host memory run in one command (docs/parallel.md, "Random-weight shards"). Their log-probs mean
nothing; the rows measure speed: ``tok_s_gpu`` (input tokens/s per GPU), ``active_b`` (billions of
parameters a token runs through) and ``vs_sglang_v3``, tokens/s per GPU x active parameters over
SGLang's DeepSeek-V3 prefill (52.3k input tokens/s per node of 8 H100s at 37B active: 6.5k per GPU).

    python bench/gpu_moe_parallel.py --shape qwen3-235b-a22b --fp8 --random-weights --sizes 4x4   # 4 GPUs
    python bench/gpu_moe_parallel.py --shape glm-4.5 --fp8 --random-weights --sizes 4x4           # 4 GPUs
    python bench/gpu_moe_parallel.py --shape deepseek-v3 --fp8 --random-weights --sizes 8x8       # 8 GPUs
    python bench/gpu_moe_parallel.py --shape deepseek-v3 --fp8 --random-weights --sizes 8x8 --skew 0.5
    python bench/gpu_moe_parallel.py --shape tiny-v3 --fp8 --random-weights --device cpu --limit 24 --sizes 2x2,4x4
        # CPU, gloo: the script end to end on DeepSeek-V3's shape cut down (37 s on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    FP8_CONFIG,
    MOE_SHAPES,
    byte_tokenizer,
    free,
    moe_config,
    workload,
    write_moe_checkpoint,
)

from logprobe.engine.runner import pack  # noqa: E402
from logprobe.engine.scheduler import Chunk, plan_work  # noqa: E402
from logprobe.errors import LogprobeError  # noqa: E402
from logprobe.executor.profile import (  # noqa: E402
    COLLECTIVES,
    RankProfile,
    attention_pairs,
    kernel_family,
    profile_run,
    waits,
)
from logprobe.loading.loader import describe_model  # noqa: E402
from logprobe.models.base import attention_pair_weight  # noqa: E402
from logprobe.parallel.rows import RowSplit, assign_rows, cut_costs  # noqa: E402

# SGLang's DeepSeek-V3 prefill on H100s (prefill-decode disaggregation, expert parallelism): 52.3k input
# tokens/s per node of 8 GPUs, 37B active parameters: per GPU, tokens/s x active parameters
SGLANG_V3_PREFILL = 52.3e3 / 8 * 37e9

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def write_config(shape: str, layers: int, path: Path, fp8: bool = False) -> None:
    """config.json (FP8 blocks: with ``quantization_config``) and a byte tokenizer, no weights: what
    ``--random-weights`` scores, each rank building its shard at random on its device
    (``Scorer(load_format=RandomWeights(...))``, ``logprobe.loading.dummy``). Written every run (a
    config is cheap; one left by an earlier definition of the shape would be read silently)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = moe_config(shape, layers)
    raw = cfg.to_dict()
    (path / "config.json").write_text(json.dumps({**raw, **({"quantization_config": FP8_CONFIG} if fp8 else {})},
                                                 indent=2))
    byte_tokenizer().save_pretrained(str(path))


def active_params(path: Path) -> int:
    """Parameters a token runs through: all of them, the routed experts' counted top-k / E
    (DeepSeek-V3: 37B of 671B, the multi-token-prediction layer left out)."""
    from logprobe.layers.moe import Experts

    cfg = json.loads((path / "config.json").read_text())
    model = describe_model(str(path), "cpu", tokenizer=False).model
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1
    return round(total - experts + experts * cfg.get("num_experts_per_tok", 1) / n)


def per_gpu(tok_s: float, gpus: int, active: int) -> dict:
    """Input tokens/s per GPU, and that times the active parameters against SGLang's DeepSeek-V3
    prefill (``SGLANG_V3_PREFILL``: 6.5k tokens/s per GPU at 37B active).

    >>> per_gpu(52300.0, 8, 37 * 10**9)
    {'tok_s_gpu': 6538, 'active_b': 37.0, 'vs_sglang_v3': 1.0}
    """
    return dict(tok_s_gpu=round(tok_s / gpus), active_b=round(active / 1e9, 3),
                vs_sglang_v3=round(tok_s / gpus * active / SGLANG_V3_PREFILL, 3))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(scorer, reqs, device: str = "cuda"):
    sync(device)
    t = time.perf_counter()
    out = scorer.engine.run(reqs)
    sync(device)
    return time.perf_counter() - t, torch.cat([r.logprobs.float() for r in out])


def rank_shares(reqs, config, ranks: int, pair_weight: int = 0) -> dict:
    """Each rank's share of the rows and attention pairs of a run under data-parallel attention
    (fractions of the whole, rounded): the engine's plan for ``ranks`` replayed (``plan_work``, its
    packing, each batch cut as the model cuts it, ``assign_rows`` by ``cut_costs`` at the model's
    ``pair_weight``, ``models.base.attention_pair_weight``; 0: by rows), then ``attention_pairs``
    of every rank's segments. Chunks of a request over a rank's share run whole on every rank
    (none on W1): their rows are counted in ``whole_rows``.

    >>> from logprobe.config import EngineConfig
    >>> from logprobe.engine.request import ScoreRequest
    >>> reqs = [ScoreRequest(list(range(3, 3 + n)), 1) for n in (9, 5, 5)]  # inputs of 8, 4, 4 rows
    >>> rank_shares(reqs, EngineConfig(max_batch_tokens=64, share_prefixes=False), 2)  # pairs 36 | 10 + 10
    {'rank_rows': [0.5, 0.5], 'rank_pairs': [0.643, 0.357], 'busiest_rows': 1.0, 'busiest_pairs': 1.286, 'whole_rows': 0}
    """
    rows, pairs, whole = [0] * ranks, [0] * ranks, 0
    plan = plan_work([r.inputs for r in reqs], config.max_batch_tokens, share=config.share_prefixes,
                     min_shared=config.min_shared_prefix, ranks=ranks, pair_weight=pair_weight)
    for batch in plan:
        if isinstance(batch[0], Chunk):
            whole += batch[0].end - batch[0].begin
            continue
        meta = pack(batch, reqs, torch.device("cpu")).meta
        cuts = meta.cuts()
        bounds = assign_rows(cuts, ranks, cut_costs(meta.segments, cuts, pair_weight))
        for r in range(ranks):
            own = meta.share(RowSplit(bounds, r))
            rows[r] += own.num_rows
            pairs[r] += attention_pairs(own.segments)
    frac = lambda xs: [round(x / max(sum(xs), 1), 3) for x in xs]  # noqa: E731
    return dict(rank_rows=frac(rows), rank_pairs=frac(pairs), busiest_rows=round(max(rows) * ranks / max(sum(rows), 1), 3),
                busiest_pairs=round(max(pairs) * ranks / max(sum(pairs), 1), 3), whole_rows=whole)


def attention_flop_per_pair(config: dict) -> int:
    """FLOPs of one (query, key) pair in one layer, all heads: q·k over the query-key width and
    p·v over the value width, 2 FLOPs a multiply-add (latent attention: q/k of nope + rope dims).

    >>> attention_flop_per_pair(dict(num_attention_heads=32, head_dim=128, hidden_size=2048))
    16384
    """
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    qk = (config.get("qk_nope_head_dim") or 0) + (config.get("qk_rope_head_dim") or 0) or d
    return 2 * heads * (qk + (config.get("v_head_dim") or d))


def profile_summary(ranks: list[RankProfile], flop_per_pair: int, layers: int) -> list[dict]:
    """Per rank: wall ms, rows, pairs, attention TFLOP, ms waited in collectives, ms by family.

    >>> p = RankProfile(0, 0.5, (("ncclDevKernel_AllGather_RING_LL", 4, 1500.0), ("nvjet_x", 9, 2000.0)),
    ...                 (("all-gather", 1000.0), ("all-gather", 500.0)), rows=10, pairs=55)
    >>> profile_summary([p], 16384, 2)
    [{'rank': 0, 'wall_ms': 500.0, 'busy_ms': 0.0, 'rows': 10, 'pairs': 55, 'attn_tflop': 0.0, 'wait_ms': 0.0, 'wait_ms_by': {'all-gather': 0.0}, 'ms': {'gemm': 2.0, 'all-gather': 1.5}}]
    """
    wait = waits(ranks) or [None] * len(ranks)
    kinds = sorted({k for p in ranks for k, _ in p.collectives})
    by_kind = {k: waits(ranks, k) or [None] * len(ranks) for k in kinds}
    return [dict(rank=p.rank, wall_ms=round(p.wall_s * 1e3, 1), busy_ms=round(p.busy_s * 1e3, 1), rows=p.rows,
                 pairs=p.pairs,
                 attn_tflop=round(p.pairs * flop_per_pair * layers / 1e12, 3),
                 wait_ms=None if w is None else round(w / 1e3, 1),
                 wait_ms_by=({k: None if v[i] is None else round(v[i] / 1e3, 1) for k, v in by_kind.items()}),
                 ms={k: round(v / 1e3, 1) for k, v in p.families().items()}) for i, (p, w) in enumerate(zip(ranks, wait))]


def print_profile(rows: list[dict], ranks: list[RankProfile], out: Path | None, tag: str) -> None:
    """A table of ``profile_summary`` (families as columns, collectives first), the largest kernels
    of families other (nothing hides) and copy, and each rank's whole kernel list to ``out`` if given."""
    fams = sorted({f for r in rows for f in r["ms"]}, key=lambda f: (f not in COLLECTIVES, f))
    log("| rank | wall ms | busy ms | wait ms | rows | pairs | attn TFLOP | " + " | ".join(fams) + " |")
    for r in rows:
        log(f"| {r['rank']} | {r['wall_ms']} | {r['busy_ms']} | {r['wait_ms']} | {r['rows']} | {r['pairs']} | "
            f"{r['attn_tflop']} | "
            + " | ".join(str(r["ms"].get(f, 0.0)) for f in fams) + " |")
    for r in rows:
        if r["wait_ms_by"]:
            log(f"rank {r['rank']} waited (ms) in {r['wait_ms_by']}")
    for p in ranks:
        if p.gaps or p.small_gaps_us:  # where the GPU sat idle (ms from the first kernel, ms, before, after)
            log(f"rank {p.rank} idle: {round(p.small_gaps_us / 1e3, 1)} ms in holes < 0.5 ms; longest: "
                f"{[(round(t / 1e3, 1), round(g / 1e3, 1), a, b) for t, g, a, b in p.gaps]}")
        if p.host_waits:  # where the host stopped for the GPU (the run's closing sync included)
            log(f"rank {p.rank} host waits (call, calls, ms): "
                f"{[(n, c, round(us / 1e3, 1)) for n, c, us in p.host_waits]}")
    for p in ranks:  # nothing hides in "other"; "copy" does not halve with the ranks; "gemm": cuBLAS or Triton
        for fam, top in (("other", 5), ("copy", 8), ("gemm", 6)):
            big = [(n[:70], c, round(us / 1e3, 1)) for n, c, us in p.kernels if kernel_family(n) == fam and us >= 100]
            if big[:top]:
                log(f"rank {p.rank} {fam} (name, calls, ms): {big[:top]}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"profile-{tag}.json"
        path.write_text(json.dumps([dict(rank=p.rank, wall_s=p.wall_s, busy_s=p.busy_s, rows=p.rows, pairs=p.pairs,
                                         kernels=p.kernels, collectives=p.collectives) for p in ranks]))
        log(f"kernels of every rank: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(MOE_SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (labelled in the output)")
    ap.add_argument("--sizes", default="1x1,2x1,2x2", help="TPxEP pairs, the first is the reference")
    ap.add_argument("--modes", default="default,det",
                    help="default, det; with ':onebatch' (e.g. default:onebatch): micro-batches off, for comparison; "
                         "with ':tokens=N' (e.g. default:tokens=262144): a budget of N rows a pass instead of the "
                         "engine's (a setting, labelled in the row); options joined by '+'")
    ap.add_argument("--attention", default="auto",
                    help="attention layouts to time above one GPU, comma-separated: data, tensor, auto (the model's)")
    ap.add_argument("--dir", default="/tmp/logprobe-moe-parallel")
    ap.add_argument("--fp8", action="store_true", help="an FP8 block checkpoint of the same weights (DeepSeek's layout)")
    ap.add_argument("--diagnose", action="store_true",
                    help="deterministic mode only: capture every block's attn_out / mlp_out / resid_post of "
                         "two texts at each size and print where the bits first leave (1, 1)'s")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one more W1 pass per size and mode with every rank under torch.profiler: "
                         "kernel time by family, time waited in collectives, rows and attention pairs per rank")
    ap.add_argument("--profile-dir", default=None, help="with --profile: write each rank's kernel list here (JSON)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="a skewed router: the first E/16 experts favoured for every token (e.g. 0.5: router rows scaled by 1.5); the rows "
                         "print hot_share, the share of routed slots they take (1/16 when even)")
    ap.add_argument("--random-weights", action="store_true",
                    help="no checkpoint: config.json alone, each rank building its shard at random on its GPU "
                         "(load_format dummy; with --fp8 as FP8 blocks); numbers mean speed only")
    ap.add_argument("--redundant", type=int, default=0,
                    help="N replicas of hot experts per rank at sizes with EP = TP > 1 (Scorer redundant_experts), "
                         "placed by the loads counted on the first size's warm-up pass (return_routed_experts); "
                         "prints the hot share and each rank's routed slots without and with them")
    ap.add_argument("--passes", type=int, default=2,
                    help="timed passes per size and mode after the warm-up one; the row is the best, "
                         "every pass's seconds printed as passes_s")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo workers (a trial run)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of W1 (a trial run)")
    ap.add_argument("--nccl-env", default="",
                    help="KEY=VALUE,... set before the workers start (e.g. NCCL_MAX_CTAS=8: the collectives on fewer "
                         "multiprocessors beside the expert kernels); printed with the results")
    args = ap.parse_args()
    for item in filter(None, args.nccl_env.split(",")):
        key, _, value = item.partition("=")
        if not key.startswith("NCCL_") or not value:
            ap.error(f"--nccl-env: {item!r} is not NCCL_NAME=value")
        os.environ[key] = value  # the worker processes inherit it; NCCL reads it when their communicator starts
    if args.nccl_env:
        log(f"NCCL environment: {args.nccl_env}")
    path = Path(args.dir) / f"{args.shape}-{args.layers or 'all'}{'-fp8' * args.fp8}{f'-skew{args.skew}' * bool(args.skew)}"
    if args.random_weights:  # config.json alone: the skew is the workers' (RandomWeights), not the files'
        path = path.with_name(path.name + "-random")
        write_config(args.shape, args.layers, path, args.fp8)
        log(f"config {path} (random weights), {active_params(path) / 1e9:.1f}B active parameters")
    else:
        write_moe_checkpoint(args.shape, args.layers, path, args.fp8, args.device, args.skew)
        log(f"checkpoint {path}")
    if args.diagnose:
        return diagnose(path, args.sizes.split(","))
    ref, base = {}, {}
    for size in args.sizes.split(","):
        tp, ep = map(int, size.split("x"))
        for layout in ["auto"] if tp == 1 else args.attention.split(","):
            if layout == "data" and ep != tp:
                log(json.dumps(dict(tp=tp, ep=ep, attention=layout, skipped="data-parallel attention needs EP = TP")))
                continue
            for redundant in [0, args.redundant] if args.redundant and ep == tp > 1 else [0]:  # without, with
                run_size(args, path, tp, ep, None if layout == "auto" else layout, ref, base, redundant)


def mode_options(mode: str) -> tuple[str, dict]:
    """A ``--modes`` item -> (default or det, EngineConfig options): "onebatch" turns micro-batches
    off, "tokens=N" sets the budget of a pass.

    >>> mode_options("det"), mode_options("default:onebatch+tokens=262144")
    (('det', {}), ('default', {'micro_batch_rows': 0, 'max_batch_tokens': 262144}))
    """
    name, _, opt = mode.partition(":")
    options: dict = {}
    for item in filter(None, opt.split("+")):
        key, _, value = item.partition("=")
        if item == "onebatch":
            options["micro_batch_rows"] = 0
        elif key == "tokens" and value.isdigit():
            options["max_batch_tokens"] = int(value)
        else:
            raise SystemExit(f"--modes: unknown option {item!r} in {mode!r} (onebatch, tokens=N)")
    return name, options


def run_size(args, path: Path, tp: int, ep: int, layout: str | None, ref: dict, base: dict,
             redundant: int = 0) -> None:
    """One (TP, EP, attention layout): each mode timed on W1; the first run of a mode is the reference.
    ``redundant``: replicas of hot experts per rank (``replicas``)."""
    from logprobe import Scorer
    from logprobe.config import EngineConfig
    from logprobe.loading.dummy import RandomWeights

    t = time.perf_counter()
    fmt = RandomWeights(skew=args.skew) if args.random_weights else "auto"
    loads = getattr(args, "expert_loads", None) if redundant else None
    s = Scorer(str(path), device=args.device, tensor_parallel_size=tp, expert_parallel_size=ep, progress=False,
               attention_parallel=layout, dtype="float32" if args.device == "cpu" else "auto", load_format=fmt,
               redundant_experts=redundant if loads else 0, expert_loads=loads)
    load = time.perf_counter() - t
    reqs = workload("W1", s.info.vocab_size)[:args.limit or None]
    if args.redundant:
        replicas(args, s, reqs, tp, path, redundant)
    for mode in args.modes.split(","):
        name, options = mode_options(mode)
        if name == "det" and ep != tp and args.device == "cuda":
            log(json.dumps(dict(tp=tp, ep=ep, mode=mode, skipped="deterministic on CUDA needs EP = TP")))
            continue
        if "micro_batch_rows" in options and tp == 1:
            continue  # one GPU has no micro-batches: its rows are the reference of both
        s.config = EngineConfig(progress=False, deterministic=name == "det", **options)
        try:
            s.engine.run(reqs)  # warm-up: every kernel specialisation compiled
        except LogprobeError as e:  # a size this shape does not take in this mode (the error names why)
            log(json.dumps(dict(tp=tp, ep=ep, mode=mode, refused=str(e))))
            continue
        runs = [timed(s, reqs, args.device) for _ in range(max(1, args.passes))]
        secs, lp = min(runs, key=lambda r: r[0])
        toks = sum(r.num_inputs for r in reqs)
        row = dict(shape=args.shape, layers=args.layers or "all", fp8=args.fp8, tp=tp, ep=ep, redundant=redundant,
                   attention=s.attention_parallel, budget=s.config.max_batch_tokens, mode=mode, s=round(secs, 3),
                   tok_s=round(toks / secs), passes_s=[round(r[0], 3) for r in runs],
                   load_s=round(load, 1))
        if args.random_weights:
            row.update(random=True, **per_gpu(toks / secs, tp, active_params(path)))
        if tp > 1 and s.attention_parallel == "data":
            weight = attention_pair_weight(describe_model(str(path), "cpu", tokenizer=False).model)
            row.update(rank_shares(reqs, s.config, tp, weight), pair_weight=weight)
        if args.skew and tp == 1 and name == "default":
            cfg = json.loads((path / "config.json").read_text())
            row["hot_share"] = hot_share(s, reqs[:16], cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"])
        if name in ref:
            d = (lp - ref[name]).abs()
            row.update(speedup=round(base[name] / secs, 2), max_d=float(d.max()), mean_d=float(d.mean()),
                       bitwise=bool(torch.equal(lp, ref[name])))
        else:
            ref[name], base[name] = lp, secs
        log(json.dumps(row))
        if args.profile:
            profiled(args, s, reqs, path, f"{args.shape}-{tp}x{ep}-{s.attention_parallel}-{mode}")
    s.close()
    # a one-GPU size's weights leave this process's GPU memory before the next size starts: its
    # workers then see what a fresh process would, and their default budget is the user's
    del s
    free()


def replicas(args, s, reqs, tp: int, path: Path, redundant: int) -> None:
    """--redundant: on the first size (no replicas), each expert's load counted on a warm-up pass of
    ``reqs[:64]``, kept for the later sizes; at a size with replicas, the hot share and each rank's
    routed slots (every layer's, the batch's rows in order) by owner and by the placement's rule."""
    from logprobe.parallel.placement import count_loads, rank_tokens

    cfg = json.loads((path / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    if getattr(args, "expert_loads", None) is None:
        seqs = [{"prompt_token_ids": list(r.inputs[:1]), "completion_token_ids": list(r.inputs[1:])} for r in reqs[:64]]
        args.routes = [x.routed_experts for x in s.logprobs(seqs, return_routed_experts=True)]
        args.expert_loads = count_loads(args.routes, experts)
    placement = getattr(s.engine, "placement", None)
    if placement is None:
        return
    loads = args.expert_loads
    routes = torch.cat([torch.as_tensor(r).long() for r in args.routes])  # [tokens, layers, k]

    def slots(p) -> list[int]:  # each rank's slots, summed over the layers
        layers = [rank_tokens(routes[:, i], experts, tp, p) for i in range(routes.shape[1])]
        return [sum(c) for c in zip(*layers)]
    hot = sorted(range(experts), key=lambda e: -loads[e])[:max(1, experts // 16)]  # the E/16 hottest
    log(json.dumps(dict(tp=tp, redundant=redundant,
                        hot_share=round(sum(loads[e] for e in hot) / sum(loads), 3),
                        rank_slots_before=slots(None), rank_slots_after=slots(placement),
                        replicas={e: list(r) for e, r in enumerate(placement.replicas) if len(r) > 1})))


def hot_share(scorer, reqs, experts: int) -> float:
    """The share of routed slots (every MoE layer, every token) that go to the first E/16 experts,
    from the routes of ``reqs`` (``return_routed_experts``)."""
    seqs = [{"prompt_token_ids": list(r.inputs[:1]), "completion_token_ids": list(r.inputs[1:])} for r in reqs]
    routes = torch.cat([torch.as_tensor(x.routed_experts).reshape(-1)
                        for x in scorer.logprobs(seqs, return_routed_experts=True)])
    return round(float((routes < max(1, experts // 16)).float().mean()), 3)


def profiled(args, s, reqs, path: Path, tag: str) -> None:
    """One more pass of ``reqs`` with every rank under the profiler (one GPU: in process), printed
    as ``print_profile``; the profiled pass's wall time is longer than the timed one's by the
    profiler's own cost."""
    if hasattr(s.engine, "profile"):  # worker processes (executor.ParallelEngine)
        _, ranks = s.engine.profile(reqs)
    else:
        ranks = [profile_run(s.engine, reqs, s.engine.config)]
    config = json.loads((path / "config.json").read_text())
    rows = profile_summary(ranks, attention_flop_per_pair(config), config["num_hidden_layers"])
    log(json.dumps(dict(profile=tag, ranks=rows)))
    print_profile(rows, ranks, Path(args.profile_dir) if args.profile_dir else None, tag)


def point_order(key: str, parts: tuple[str, ...]) -> tuple:
    """Sort key of a diagnose entry ``point#text``: embed, then each block's points in forward
    order, then the log-probs ``lp`` last (they read every block, so a difference there says
    nothing about where it began).

    >>> keys = ["lp#0", "blocks.1.attn_out#0", "blocks.0.mlp_out#0", "embed#0", "blocks.0.attn_out#0"]
    >>> sorted(keys, key=lambda k: point_order(k, ("attn_out", "mlp_out", "resid_post")))
    ['embed#0', 'blocks.0.attn_out#0', 'blocks.0.mlp_out#0', 'blocks.1.attn_out#0', 'lp#0']
    """
    name = key.split("#")[0].split(".")
    if name[0] == "blocks":
        return (int(name[1]), parts.index(name[2]), key)
    return (-1, 0, key) if name[0] == "embed" else (1 << 30, 0, key)


def rows_differing(a: torch.Tensor, b: torch.Tensor) -> str:
    """Which token rows of two captures [T, H] (or log-probs [T]) differ: a few rows (a rounding
    flip), rows from some index on (a tile or a length), or all of them (a different product).

    >>> rows_differing(torch.zeros(5, 2), torch.tensor([[0.0, 0], [0, 1], [0, 0], [2, 0], [0, 0]]))
    'rows 2 of 5: [1, 3]'
    """
    rows = (a != b).reshape(a.shape[0], -1).any(-1).nonzero().flatten().tolist()
    return f"rows {len(rows)} of {a.shape[0]}: {rows[:8]}{' ...' if len(rows) > 8 else ''}"


def diagnose(path: Path, sizes: list[str], device: str = "cuda") -> None:
    """Per hook point, max |Δ| of each size against the first, deterministic mode: the first point
    that is not bitwise names the layer part (attention, MoE) whose bits depend on the size. Texts
    of several lengths, each scored alone and twice (the second pass against the first: a size
    that is not even repeatable shows there). One GPU runs the same comparison with the ranks as
    threads (``tests/test_tp_threads.py -m gpu``), which also names the step inside attention.
    Captures run every row on every rank, so under data-parallel attention this compares the
    unsplit path (attention whole on every GPU); the timed rows compare the split one."""
    from logprobe import Scorer
    from logprobe.config import EngineConfig

    parts = ("attn_out", "mlp_out", "resid_post")
    points = [{"at": "embed", "positions": "all"}] + [{"at": f"blocks.*.{p}", "positions": "all"} for p in parts]
    base = "The quick brown fox jumps over the lazy dog; once upon a time, in a land far away, a king. "
    texts = [((base * 8)[:n], " And then it ran away.") for n in (100, 230, 250, 270, 300, 480)]

    def first_diff(a, b):
        for k in sorted(a, key=lambda k: point_order(k, parts)):
            if not torch.equal(a[k], b[k]):
                return f"{k} (max |d| {(a[k] - b[k]).abs().max().item():.2e}; {rows_differing(a[k], b[k])})"
        return None

    ref = None
    for size in sizes:
        tp, ep = map(int, size.split("x"))
        with Scorer(str(path), device=device, tensor_parallel_size=tp, expert_parallel_size=ep,
                    config=EngineConfig(progress=False, deterministic=True)) as s:
            log(f"{size}: budget {s.config.max_batch_tokens}")
            runs = []
            for _ in range(2):
                got = {}
                for i, (prompt, cont) in enumerate(texts):
                    r = s.score(prompt, [cont], capture=points)[0]
                    got[f"lp#{i}"] = torch.tensor(r.token_logprobs, dtype=torch.float64)
                    for c in r.captures:
                        got[f"{c.at}#{i}"] = c.value.double().cpu()
                runs.append(got)
        log(f"{size}: second pass vs first: first difference {first_diff(runs[0], runs[1])}")
        if ref is None:
            ref = runs[0]
            continue
        for i, (prompt, _) in enumerate(texts):
            one = {k: v for k, v in runs[0].items() if k.endswith(f"#{i}")}
            log(f"{size} text {i} ({len(prompt)} chars): first point not bitwise: "
                f"{first_diff({k: ref[k] for k in one}, one)}; log-probs max |d| "
                f"{(one[f'lp#{i}'] - ref[f'lp#{i}']).abs().max().item():.2e}")


if __name__ == "__main__":
    main()

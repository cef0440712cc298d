"""``logprobe ray {logprobs,score,perplexity}``: a table job over a dataset on a Ray cluster.

    logprobe ray logprobs --input rollouts/ --output logprobs.parquet --model org/name \\
        --ray-address auto --replicas 8 --gpus-per-replica 1 --deterministic

Input: a JSONL, CSV or Parquet file or a directory of them (local or a URI Arrow reads); output: a
directory of Parquet files, one row per input row (``index``, ``id`` for logprobs, the
``--keep-columns``, the job's result columns, ``error``). Rerun the same command to resume. How
rows are numbered, resumed and retried: ``logprobe.integrations.ray_dataset``.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import LogprobeError
from ..integrations import ray_dataset
from ..io.jsonsafe import dumps
from ..loading.loader import resolve_spec
from .common import PROG, ScorerOptions, head_options
from .rows import add_images_arg


def add_ray_parser(sub, common: argparse.ArgumentParser, head: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ray", help="score, perplexity or logprobs over a dataset on a Ray cluster (Ray Data)",
                       description="Run a table job on Ray Data: one Scorer per replica (actor), rows in batches, "
                                   "results to Parquet. Needs logprobe[ray].")
    jobs = p.add_subparsers(dest="ray_job", metavar="JOB", required=True)
    for name, what, parents in (("logprobs", "per-token log-probs of RL sequences", [common, head]),
                                ("score", "prompt + continuation(s) -> log-prob, greedy flag", [common, head]),
                                ("perplexity", "a text per row -> NLL sums; corpus perplexity", [common])):
        j = jobs.add_parser(name, parents=parents, help=what, description=f"{what}, on Ray Data.",
                            epilog="Resume: rows whose index is already in --output are skipped; rows with an error "
                                   "are done again. Exit codes: 0 ok, 1 some rows failed, 2 bad usage or input.")
        _table_args(j)
        if name == "score":
            j.add_argument("--join", default=" ", metavar="STR",
                           help="put between prompt and continuation unless either side has whitespace there")
        if name != "perplexity":
            add_images_arg(j)  # paths: relative to --input's folder, which every replica must be able to read
        if name == "perplexity":
            _window_args(j)
        j.set_defaults(func=cmd_ray)


def _table_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("dataset and cluster")
    t.add_argument("--input", required=True, metavar="PATH", help="a JSONL/CSV/Parquet file or a directory of them "
                   "(local path or URI)")
    t.add_argument("--input-format", choices=("jsonl", "csv", "parquet"), default=None)
    t.add_argument("--output", required=True, metavar="DIR", help="a directory of Parquet files (created; resumed)")
    t.add_argument("--keep-columns", type=lambda s: tuple(c for c in s.split(",") if c), default=(), metavar="A,B",
                   help="input columns copied into each output row")
    t.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the cluster (auto, ray://host:10001, host:6379); default: RAY_ADDRESS, else a local one")
    t.add_argument("--replicas", type=int, default=1, metavar="N", help="actors, each with one Scorer (default: 1)")
    t.add_argument("--gpus-per-replica", type=float, default=0, metavar="G",
                   help="GPUs per actor; G > 1 splits the model tensor-parallel over them (default: 0)")
    t.add_argument("--cpus-per-replica", type=float, default=1, metavar="C", help="CPUs per actor (default: 1)")
    t.add_argument("--batch-size", type=int, default=64, metavar="B", help="rows per batch (default: 64)")


def _window_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("windows")
    w.add_argument("--text-field", default="text", metavar="COL", help="the text column (default: %(default)s)")
    w.add_argument("--context-length", type=int, default=None, metavar="N")
    w.add_argument("--stride", type=int, default=None, metavar="S")
    w.add_argument("--policy", choices=("sliding", "rolling", "llama.cpp"), default="sliding")
    w.add_argument("--no-prefix", action="store_true", help="do not put BOS before each text")


def job_options(args: argparse.Namespace) -> dict:
    """The job's options from the command line (validated before any Ray work)."""
    if args.ray_job == "perplexity":
        return {"text_field": args.text_field, "context_length": args.context_length, "stride": args.stride,
                "policy": args.policy, "prefix": False if args.no_prefix else None}

    head_options(args).checked()
    out = {"temperature": args.temperature, "top_k": args.top_k, "entropy": args.entropy}
    if args.ray_job == "score":
        out["join"] = args.join
    if args.images_column is not None:
        out["images_column"] = args.images_column
    if args.images_column is not None or args.ray_job == "score":  # a chat row's image parts: paths too
        path = os.path.abspath(args.input)
        out["base_dir"] = path if os.path.isdir(path) else os.path.dirname(path)
    return out


def _check(args: argparse.Namespace) -> None:
    for option, value in (("--replicas", args.replicas), ("--batch-size", args.batch_size)):
        if value < 1:
            raise LogprobeError(option, f"must be a positive integer, got {value}")
    if args.gpus_per_replica < 0 or args.cpus_per_replica < 0:
        raise LogprobeError("--gpus-per-replica", "must not be negative")
    if args.tensor_parallel_size != 1 or args.data_parallel_size != 1 or args.expert_parallel_size not in (None, 1):
        raise LogprobeError("--tensor-parallel-size", "is set per replica by --gpus-per-replica here",
                            "use --gpus-per-replica G (and --replicas N for data parallelism)")
    if getattr(args, "cache", None):
        raise LogprobeError("--cache", "is not used by `logprobe ray` (its actors may run on other machines; the "
                            "cache is one SQLite file on a local disk)", "drop --cache")


def cmd_ray(args: argparse.Namespace) -> int:
    _check(args)
    options = job_options(args)
    try:
        import ray
    except ImportError:
        raise LogprobeError("ray", "is not installed", "pip install 'logprobe[ray]'") from None

    ray_dataset.input_files(args.input, args.input_format)  # a bad --input fails before the cluster starts
    if args.ray_address is None and not os.environ.get("RAY_ADDRESS"):  # a local run: the model is here too

        resolve_spec(args.model)
    if not ray.is_initialized():
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = not args.quiet
    o = ScorerOptions.from_args(args)  # the model options every command reads (tp_invariant included)
    scorer_kwargs = {"model": o.model, "device": o.device, "dtype": o.dtype, "deterministic": o.deterministic,
                     "tp_invariant": o.tp_invariant, "max_batch_tokens": o.max_batch_tokens,
                     "tensor_parallel_size": max(1, int(args.gpus_per_replica))}
    try:
        summary = ray_dataset.run_dataset(args.ray_job, args.input, args.output, scorer_kwargs, options,
                                          replicas=args.replicas, gpus_per_replica=args.gpus_per_replica,
                                          cpus_per_replica=args.cpus_per_replica, batch_size=args.batch_size,
                                          keep_columns=args.keep_columns, input_format=args.input_format)
    except LogprobeError:
        raise
    except Exception as e:  # noqa: BLE001 (Ray wraps worker errors: one line, not a traceback)
        raise LogprobeError("ray", _first_line(e), "see the Ray log above") from None
    _print_summary(args, summary)
    return 1 if summary.failed else 0


def _first_line(e: Exception) -> str:
    cause = e
    while getattr(cause, "cause", None) is not None:  # RayTaskError(...).cause
        cause = cause.cause
    text = str(cause).strip().splitlines()
    last = text[-1] if text else ""
    if "LogprobeError: " in last:  # raised in an actor (Ray re-raises it under another type)
        return last.split("LogprobeError: ", 1)[1]
    return f"{type(cause).__name__}: {last}"


def _print_summary(args: argparse.Namespace, s) -> None:
    d = {"output": args.output, "rows": s.rows, "already_done": s.already_done, "written": s.written,
         "failed": s.failed, "tokens": s.tokens, "tokens_per_s": round(s.tokens_per_s, 1),
         "elapsed_s": round(s.elapsed_s, 3)}
    if s.aggregate is not None:
        d["perplexity"] = s.aggregate
    if args.json:
        print(dumps(d, compact=False))
        return
    print(f"{s.rows} rows: {s.written} written, {s.already_done} already done, {s.failed} failed -> {args.output}")
    print(f"{s.tokens} tokens scored in {s.elapsed_s:.2f} s ({s.tokens_per_s:.0f} tokens/s)")
    a = s.aggregate
    if a and a.get("num_tokens"):
        line = f"perplexity {a['perplexity']:.4f} ± {a['perplexity_stderr']:.4f} over {a['num_tokens']} tokens"
        if a.get("word_perplexity") is not None:
            line += (f"; word {a['word_perplexity']:.6g}, byte {a['byte_perplexity']:.6g}, "
                     f"bits/byte {a['bits_per_byte']:.4f}")
        print(line)
    if s.failed:
        print(f"{PROG}: {s.failed} row{'s' * (s.failed != 1)} failed (their error column says why); rerun to retry",
              file=sys.stderr)

"""``logprobe eval``: lm-evaluation-harness tasks on a logprobe model, in process (no server).

    logprobe eval --model smollm2-135m --tasks hellaswag --limit 100
    logprobe eval --tasks my_task --include_path ./tasks --device cpu --output_path out/

logprobe's own options (model, device, dtype, budget, determinism, ``--max-length``) become lm-eval
model args of the ``logprobe`` model (``integrations.lm_eval``); every other option goes to
lm-eval's own CLI (``lm-eval run``) unchanged, after ``--tasks``. The command above runs::

    lm-eval run --model logprobe --model_args '{"model": "smollm2-135m", ...}' --device auto \
        --tasks hellaswag --limit 100
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import LogprobeError
from ..integrations import lm_eval as _registers  # noqa: F401  (--model logprobe)


def add_eval_parser(sub) -> None:
    """The ``eval`` subcommand; options it does not know are lm-eval's (``args.passthrough``)."""
    p = sub.add_parser(
        "eval", help="lm-evaluation-harness tasks in process (no server); other options go to lm-eval",
        description="Run lm-evaluation-harness (lm-eval run) with --model logprobe: log-likelihood, "
                    "multiple-choice and perplexity tasks scored in this process. Options not listed here "
                    "(--limit, --num_fewshot, --include_path, --output_path, --log_samples, ...) are passed "
                    "to lm-eval unchanged.",
        epilog="Generation tasks (generate_until) are refused: logprobe scores given text. Windows and "
               "truncation are lm-eval's hf backend's with max_length L (see docs in integrations/lm_eval.py).",
        allow_abbrev=False)
    p.add_argument("--model", default=None,
                   help="a known name (default: smollm2-135m), a .gguf file, or a Hugging Face model directory")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="token budget of one forward pass (default: from the device, as logprobe score)")
    p.add_argument("--deterministic", action="store_true", help="bitwise-identical numbers whatever shares a batch")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="logprobe's result cache (as every scoring command; beside lm-eval's own --use_cache)")
    p.add_argument("--max-length", type=int, default=None, metavar="L",
                   help="lm-eval's max_length: tokens fed per window (default: min(2048, model context - 1))")
    p.add_argument("--tasks", "-t", required=True, nargs="+", metavar="TASK",
                   help="lm-eval task names (or comma-separated lists, YAML files)")
    p.set_defaults(func=cmd_eval, passthrough=[])


def lm_eval_argv(args: argparse.Namespace) -> list[str]:
    """The ``lm-eval run`` command line for ``args``.

    >>> ns = argparse.Namespace(model=None, device="cpu", dtype="auto", max_batch_tokens=8192,
    ...                         deterministic=False, max_length=None, tasks=["hellaswag"], passthrough=["--limit", "5"])
    >>> lm_eval_argv(ns)[:4]
    ['run', '--model', 'logprobe', '--model_args']
    >>> lm_eval_argv(ns)[5:]
    ['--device', 'cpu', '--tasks', 'hellaswag', '--limit', '5']
    """
    model_args = {"model": args.model, "dtype": args.dtype, "max_batch_tokens": args.max_batch_tokens,
                  "deterministic": args.deterministic}
    if args.max_length is not None:
        model_args["max_length"] = args.max_length
    if getattr(args, "cache", None):
        model_args["cache"] = args.cache
    model_args = {k: v for k, v in model_args.items() if v is not None}
    # JSON keeps types and survives commas in paths; a later --model_args in passthrough merges over it
    return ["run", "--model", "logprobe", "--model_args", json.dumps(model_args), "--device", args.device,
            "--tasks", *args.tasks, *args.passthrough]


def cmd_eval(args: argparse.Namespace) -> int:
    """Register the ``logprobe`` model and hand the command line to lm-eval's own CLI."""
    if args.max_length is not None and args.max_length < 1:
        raise LogprobeError("--max-length", f"must be a positive integer, got {args.max_length}")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise LogprobeError("--max-batch-tokens", f"must be a positive integer, got {args.max_batch_tokens}")
    if _registers.MISSING is not None:
        raise LogprobeError("eval", f"needs lm-evaluation-harness ({_registers.MISSING})", "pip install 'lm-eval==0.4.13'")
    try:
        from lm_eval.__main__ import cli_evaluate

    except ImportError as e:
        raise LogprobeError("eval", f"needs lm-evaluation-harness ({e})", "pip install 'lm-eval==0.4.13'") from e
    saved = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv(args)]  # lm-eval's CLI reads its arguments from sys.argv
    try:
        cli_evaluate()
    except (LogprobeError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # lm-eval's own errors (unknown task, bad option value): one line, no traceback
        raise LogprobeError("lm-eval", f"{type(e).__name__}: {e}") from e
    finally:
        sys.argv = saved
    return 0

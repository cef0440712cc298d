"""``logprobe``: score continuations, measure perplexity, and stream RL log-probs from the shell.

    logprobe score "The capital of France is" Paris London Berlin
    logprobe score --input questions.csv --output scores.parquet
    logprobe perplexity --text-file wiki.txt --context-length 1024
    logprobe perplexity --dataset wikitext --dataset-config wikitext-2-raw-v1 --split test
    logprobe logprobs --input rollouts.parquet --output logprobs.parquet
    logprobe serve --port 8000

Each command lives in its own module (``score``, ``perplexity``, ``logprobs``, ``vectors``,
``serve``, ``compare``); table files go through ``logprobe.jobs`` and ``logprobe.io.tables``.

Exit codes: 0 ok; 1 some input rows failed (each reported as ``line N: ...`` / ``row N: ...``);
2 bad usage, bad input or unusable model (one line ``logprobe: error: ...``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys

import torch

from .. import __version__
from ..errors import LogprobeError
from ..jobs import join_continuation  # noqa: F401  (re-exported: the CLI's join rule)
from .cache_cmd import add_cache_parser
from .common import PROG, ScorerOptions, fail, get_scorer, head_parser, model_parser
from .compare import add_compare_parser
from .eval import add_eval_parser
from .logprobs import add_logprobs_parser
from .perplexity import add_perplexity_parser
from .ray_cmd import add_ray_parser
from .score import add_score_parser
from .serve import add_serve_parser
from .vectors import add_train_vector_parser
from .warmup_cmd import add_warmup_parser

__all__ = ["build_parser", "get_scorer", "join_continuation", "main"]


def version_text() -> str:
    """``logprobe X (torch Y, device D, triton Z)``: what a bug report needs first."""
    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    if importlib.util.find_spec("triton") is None:
        triton = "triton not installed"
    else:
        try:
            triton = f"triton {importlib.metadata.version('triton')}"
        except importlib.metadata.PackageNotFoundError:
            triton = "triton (version unknown)"
        triton += " (kernels active)" if torch.cuda.is_available() else " (installed; kernels run on CUDA only)"
    return f"{PROG} {__version__} (torch {torch.__version__}, device {device}, {triton})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version, torch, device and Triton, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    common, head = model_parser(), head_parser()
    parser = argparse.ArgumentParser(
        prog=PROG, description="Exact log-probabilities of given text under a language model.",
        epilog="Exit codes: 0 ok, 1 some input rows failed, 2 bad usage/input/model, 130 interrupted.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_score_parser(sub, common, head)
    add_perplexity_parser(sub, common)
    add_logprobs_parser(sub, common, head)
    add_train_vector_parser(sub, common)

    add_serve_parser(sub, common)
    add_warmup_parser(sub, common)

    add_compare_parser(sub, common)

    add_eval_parser(sub)

    add_cache_parser(sub)

    add_ray_parser(sub, common, head)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script passes it to sys.exit)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not hasattr(args, "passthrough"):  # only `eval` hands options on (to lm-eval)
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough = rest
    args.make_scorer = lambda a: _scorer(a)  # looked up when called (tests replace _scorer / get_scorer)
    try:
        return args.func(args)
    except LogprobeError as e:
        return _fail(str(e))
    except OSError as e:  # a file we were given could not be read or written
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")
    except torch.OutOfMemoryError:
        return _fail("out of memory; lower --max-batch-tokens (or use a smaller --dtype / another --device)")
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    return fail(message)


def _scorer(args: argparse.Namespace):
    o = ScorerOptions.from_args(args)
    o.engine_config()  # a bad option is refused before the model loads
    return get_scorer(o.model, o.device, o.dtype, o.max_batch_tokens, o.deterministic, o.tensor_parallel_size,
                      o.data_parallel_size, o.tp_invariant, o.progress, o.cache, o.prefix_cache,
                      o.expert_parallel_size, o.attention_parallel, o.cuda_graph_tokens, o.load_format)

if __name__ == "__main__":
    sys.exit(main())

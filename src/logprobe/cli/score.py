"""``logprobe score``: continuations after a prompt, from the command line or rows of a table."""

from __future__ import annotations

import argparse
import math

from ..errors import LogprobeError
from ..io.jsonsafe import dumps
from ..jobs import ScoreRows, join_continuation
from .common import head_options, hooks_parser, json_option
from .report import add_html_option, check_html, score_html
from .rows import add_images_arg, add_table_args, exit_code, images_options, run_table


def add_score_parser(sub, common: argparse.ArgumentParser, head: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "score", parents=[common, head, hooks_parser()], help="log-probability of each continuation after a prompt",
        description="Score each continuation after PROMPT and print them most likely first; or, with --input, "
                    "every row of a table (columns prompt and continuation, or continuations: a list, JSON text "
                    "in CSV) into --output.",
        epilog="Joining: unless PROMPT ends with whitespace or a continuation starts with whitespace, "
               "--join is put between them, so `score \"The capital of France is\" Paris` scores \" Paris\" "
               "(the token a model actually sees after a word). Use --join '' to score the text as given.")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="the context (may be empty)")
    p.add_argument("continuations", metavar="CONT", nargs="*",
                   help="continuations to score (--json lists them in this order, the table most likely first)")
    p.add_argument("--join", default=" ", metavar="STR",
                   help="put between PROMPT and each CONT unless either side already has whitespace there "
                        "(default: a space, so Paris is scored as ' Paris')")
    add_table_args(p, required=False)
    add_images_arg(p)
    add_html_option(p)
    p.set_defaults(func=cmd_score)


def cmd_score(args: argparse.Namespace) -> int:
    head_options(args).checked()  # fail before loading the model
    check_html(args)
    if args.input is not None:
        return _score_table(args)
    if args.images_column is not None:
        raise LogprobeError("--images-column", "names a column of --input's table", "give --input FILE")
    if args.prompt is None or not args.continuations:
        raise LogprobeError("score", "needs PROMPT and at least one CONT, or --input FILE --output FILE",
                            'e.g. logprobe score "The capital of France is" Paris London')
    scorer = args.make_scorer(args)
    conts = [join_continuation(args.prompt, c, args.join) for c in args.continuations]
    results = score_html(args, scorer, conts, json_option(args.steer, "--steer"),
                         json_option(args.capture, "--capture"))  # with --html: the page from this pass
    if args.json:
        print(dumps([r.to_dict() for r in results], compact=False))
        return 0
    _print_table(results, args)
    return 0


def _score_table(args: argparse.Namespace) -> int:
    if args.prompt is not None:
        raise LogprobeError("--input", "takes the prompts from the file", "drop PROMPT and CONT")
    if args.output is None:
        raise LogprobeError("--output", "is needed with --input", "give --output FILE.jsonl or FILE.parquet")
    if args.steer or args.capture:
        raise LogprobeError("--steer", "is not available for table files yet", "use logprobe logprobs, or the API")
    job = ScoreRows(head_options(args), args.join, args.keep_columns, **images_options(args))
    counts, _ = run_table(args, args.make_scorer(args), job)
    return exit_code(counts)


def _print_table(results, args: argparse.Namespace) -> None:
    ranked = sorted(results, key=lambda r: -r.log_prob)
    header = ["continuation", "tokens", "log_prob", "prob", "ppl", "greedy"]
    rows = [[_short(repr(r.continuation)), str(r.num_tokens), f"{r.log_prob:.4f}", f"{r.prob:.4g}",
             f"{r.perplexity:.4g}", "yes" if r.is_greedy else "no"] for r in ranked]
    if args.entropy:
        header.append("entropy")
        rows = [row + [f"{math.fsum(r.entropy) / len(r.entropy):.4f}"] for row, r in zip(rows, ranked, strict=True)]
    print(text_table(header, rows, left={0}))
    if args.top_k:
        print()
        for r in ranked:
            print(f"{_short(repr(r.continuation))} top-{args.top_k} per token:")
            for tok, lp, alts in zip(r.tokens, r.token_logprobs, r.top_k, strict=True):
                choices = ", ".join(f"{t!r} {a:.3f}" for _, t, a in alts)
                print(f"  {tok!r} {lp:.3f}  <-  {choices}")


def _short(s: str, width: int = 40) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def text_table(header: list[str], rows: list[list[str]], left: set[int]) -> str:
    """Columns padded to their widest cell; ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)

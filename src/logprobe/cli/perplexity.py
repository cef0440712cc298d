"""``logprobe perplexity``: a text file, a dataset, or the rows of a table.

Sources (one of): ``--text-file F`` (one text); ``--dataset NAME`` (a dataset split through the
``datasets`` library); ``--input FILE`` (a JSONL/CSV/Parquet table). Rows of a dataset or table
become texts by ``--join``: a separator (default for ``--dataset``: ``"\\n\\n"``, as the Hugging
Face perplexity guide joins wikitext) makes one text of them, scored like ``--text-file``;
``none`` (default for ``--input``) scores each row as its own text: one result per row (to
``--output`` when given) plus the aggregate over the rows (lm-eval's per-document style).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import LogprobeError
from ..io.datasets import dataset_rows
from ..io.jsonsafe import dumps
from ..io.tables import read_output, read_rows, table_format
from ..jobs import ListSink, PerplexityRows, aggregate
from .common import hooks_parser, json_option, read_text
from .compare import add_window_args
from .report import add_html_option, check_html, perplexity_html, window_options
from .rows import INPUT_FORMATS, add_table_args, exit_code, run_table


def add_perplexity_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "perplexity", parents=[common, hooks_parser()], help="perplexity of a text file, a dataset or table rows",
        description="Token perplexity (± standard error), word and byte perplexity and bits per byte of a text, "
                    "of a dataset split (--dataset), or of each row of a table (--input) with their aggregate.",
        epilog="Policies: 'sliding' scores every token once with up to CONTEXT - STRIDE tokens of extra context "
               "(Hugging Face guide); 'rolling' is lm-eval's loglikelihood_rolling (disjoint windows, each with a "
               "full context; lm-eval's max_length L = --context-length L-1); 'llama.cpp' scores the second half of "
               "non-overlapping chunks, like llama-perplexity. Joining: --join SEP puts SEP between rows (\\n and "
               "\\t are understood) and scores one text; --join none scores each row as its own text.")
    add_window_args(p, "window policy (default: %(default)s)",
                    "score only the first N tokens (word/byte perplexity are then not reported)", text_required=False)
    p.add_argument("--no-prefix", action="store_true",
                   help="do not put BOS before the text (by default the sliding policy does, so the first "
                        "token is scored too)")
    d = p.add_argument_group("datasets and rows")
    d.add_argument("--dataset", "--dataset-path", default=None, metavar="NAME",
                   help="a dataset: hub name (cache first), local dataset directory or data file")
    d.add_argument("--dataset-config", "--dataset-name", default=None, metavar="C", help="its config, e.g. "
                   "wikitext-2-raw-v1")
    d.add_argument("--split", default="test", help="dataset split (default: %(default)s)")
    d.add_argument("--text-field", default="text", metavar="COL", help="the text column (default: %(default)s)")
    d.add_argument("--num-samples", "--limit", type=int, default=None, metavar="N", help="only the first N rows")
    d.add_argument("--join", default=None, metavar="SEP|none",
                   help="how rows become text: SEP between rows, one text (default for --dataset: '\\n\\n'); "
                        "none: each row its own text, one result per row (default for --input)")
    add_table_args(p, required=False)
    add_html_option(p)
    p.set_defaults(func=cmd_perplexity)


def _join(args: argparse.Namespace) -> str | None:
    sep = args.join if args.join is not None else ("\n\n" if args.dataset is not None else "none")
    return None if sep == "none" else sep.replace("\\n", "\n").replace("\\t", "\t")


def _rows(args: argparse.Namespace):
    if args.dataset is not None:
        return dataset_rows(args.dataset, args.dataset_config, args.split, args.num_samples)
    rows = read_rows(args.input, table_format(args.input, args.input_format, "--input", INPUT_FORMATS))
    return (r for r in rows if args.num_samples is None or r.index < args.num_samples)


def cmd_perplexity(args: argparse.Namespace) -> int:
    sources = [o for o, v in (("--text-file", args.text_file), ("--dataset", args.dataset), ("--input", args.input))
               if v is not None]
    if len(sources) != 1:
        raise LogprobeError("perplexity", f"needs exactly one of --text-file, --dataset, --input (got "
                            f"{', '.join(sources) or 'none'})", "e.g. --text-file wiki.test.raw")
    check_html(args)
    if args.input not in (None, "-") and not os.path.isfile(args.input):  # before the model loads
        raise LogprobeError("--input", f"{args.input!r} is not a readable file", "check the path")
    if args.num_samples is not None and args.num_samples < 1:
        raise LogprobeError("--num-samples", f"must be a positive integer, got {args.num_samples}")
    if args.text_file is not None:
        text = read_text(args.text_file, "--text-file")
        where = "stdin" if args.text_file == "-" else repr(args.text_file)
        return _one_text(args, text, "--text-file", where)
    sep = _join(args)
    if sep is None:
        return _per_row(args)
    texts = [r.data.get(args.text_field) for r in _rows(args) if r.data is not None]
    if not all(isinstance(t, str) for t in texts):
        raise LogprobeError("--text-field", f"{args.text_field!r} is not a text column of every row",
                            "name the text column")
    return _one_text(args, sep.join(texts), sources[0], f"{len(texts)} rows joined")


def _one_text(args: argparse.Namespace, text: str, option: str, where: str) -> int:
    if not text.strip():
        raise LogprobeError(option, f"{where} is empty (no text to score)", "give a file with some text")
    scorer = args.make_scorer(args)
    start = time.perf_counter()
    res = perplexity_html(args, scorer, text, json_option(args.steer, "--steer"),
                          json_option(args.capture, "--capture"))  # with --html: the page from this pass
    elapsed = time.perf_counter() - start
    d = res.to_dict()
    d.pop("token_nlls", None)
    if d.get("captures") is None:
        d.pop("captures", None)
    _report(args, scorer, d, elapsed)
    return 0


def _report(args: argparse.Namespace, scorer, d: dict, elapsed: float) -> None:
    speed = d["num_tokens"] / elapsed if elapsed > 0 else float("inf")
    if args.json:
        d.update(tokens_per_s=speed, elapsed_s=elapsed, model=scorer.info.name)
        print(dumps(d, compact=False))
        return
    info = scorer.info
    stride = f", stride {d['stride']}" if d.get("stride") is not None else ""
    windows = d.get("num_windows", 0)
    lines = [
        ("model", f"{info.name} ({info.backend}, {info.device}, {info.dtype})"),
        ("perplexity", f"{d['perplexity']:.4f} ± {d['perplexity_stderr']:.4f}"),
        ("tokens", f"{d['num_tokens']} scored in {windows} window{'s' * (windows != 1)} "
                   f"(policy {d.get('policy', args.policy)}, context {d.get('context_length', args.context_length)}"
                   f"{stride})"),
    ]
    if "num_rows" in d:
        lines.append(("rows", f"{d['num_rows']} scored, {d['failed_rows']} failed"))
    if "output" in d:
        lines.append(("output", f"{d['written']} written, {d['already_done']} already done -> {d['output']}"))
    if d.get("word_perplexity") is None:
        na = "n/a (not defined with --max-tokens)"
        lines += [("word ppl", na), ("byte ppl", na), ("bits/byte", na)]
    else:
        lines += [("word ppl", f"{d['word_perplexity']:.4f} ({d['num_words']} words)"),
                  ("byte ppl", f"{d['byte_perplexity']:.4f} ({d['num_bytes']} bytes)"),
                  ("bits/byte", f"{d['bits_per_byte']:.4f}")]
    lines.append(("speed", f"{speed:.0f} tokens/s ({elapsed:.2f} s)"))
    for k, v in lines:
        print(f"{k:<11} {v}")


def _per_row(args: argparse.Namespace) -> int:
    if args.steer or args.capture:
        raise LogprobeError("--steer", "is not available per row yet", "use --join to score one text")
    scorer = args.make_scorer(args)
    windows = window_options(args).resolved(scorer.info.max_length)
    job = PerplexityRows(args.text_field, windows, args.keep_columns)
    start = time.perf_counter()
    sink = None if args.output is not None else ListSink()
    counts, sink = run_table(args, scorer, job, _rows(args), sink, summary=False)
    if counts.stopped:
        print(f"logprobe: stopped: {counts.written} rows written; run the same command again to resume",
              file=sys.stderr)
        return 130
    all_rows = sink.rows if isinstance(sink, ListSink) else read_output(args.output)
    agg = aggregate(all_rows)
    if agg["num_tokens"] == 0:
        raise LogprobeError(args.text_field, "no row could be scored", "see the row errors above")
    agg.update(policy=args.policy, context_length=windows.context_length, stride=windows.stride)
    if args.output is None and args.json:
        agg["rows"] = all_rows
    elif args.output is not None:
        agg.update(output=args.output, written=counts.written, already_done=counts.already_done)
    _report(args, scorer, agg, time.perf_counter() - start)
    return exit_code(counts)

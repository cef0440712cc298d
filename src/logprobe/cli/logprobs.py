"""``logprobe logprobs``: per-token log-probs of RL sequences, rows in -> rows out (resumable)."""

from __future__ import annotations

import argparse

from ..jobs import LogprobsRows
from .common import head_options, hook_specs, hooks_parser
from .rows import add_images_arg, add_table_args, exit_code, images_options, run_table


def add_logprobs_parser(sub, common: argparse.ArgumentParser, head: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "logprobs", parents=[common, head, hooks_parser()],
        help="per-token log-probs of RL sequences: JSONL/CSV/Parquet in -> JSONL/Parquet out",
        description="Stream per-token log-probs of completions. Each input row has prompt_token_ids and "
                    "completion_token_ids (lists; JSON text in CSV) with optional id (echoed; null when absent), "
                    "temperature, top_k, entropy, steer and capture (override the options). Each output row is "
                    '{"index": <0-based input row>, "id": ..., "logprobs": [...], "sum_logprob": ..., '
                    '"is_greedy": [...]} (+ "entropy", "top_k_ids", "top_k_logprobs", "captures" when asked), '
                    "written as each batch completes, not in input order. Captures with reduce 'none' go to "
                    "safetensors side files in --capture-dir, referenced from the row by file and key.",
        epilog="Resume: if --output exists, rows already there are skipped and the rest added (a truncated "
               "last JSONL line or an unfinished Parquet part is removed first), so rerunning an interrupted "
               "command finishes it. Bad rows are reported as 'line N: ...' / 'row N: ...' on stderr and written "
               "with an \"error\" field; they make the exit code 1 and are computed again on the next run.")
    add_table_args(p, required=True)
    add_images_arg(p)
    p.add_argument("--capture-dir", default=None, metavar="DIR",
                   help="where reduce 'none' captures are written, one INDEX.safetensors per row "
                        "(default: OUTPUT.captures/)")
    p.set_defaults(func=cmd_logprobs)


def cmd_logprobs(args: argparse.Namespace) -> int:
    head_options(args).checked()  # fail before loading the model
    job = LogprobsRows(head_options(args), hook_specs(args), args.capture_dir or args.output + ".captures",
                       args.keep_columns, **images_options(args))
    counts, _ = run_table(args, args.make_scorer(args), job)
    return exit_code(counts)

"""Table jobs from the shell: ``--input`` rows through a job (``logprobe.jobs``) into ``--output``.

Shared by ``score``, ``perplexity`` and ``logprobs``: the table options, the progress bar (rows
done/total with ETA, tokens and tokens/s), SIGTERM/SIGINT handling (stop before the next forward
pass with every finished row written, exit 130, rerun to resume) and the summary line.

>>> p = argparse.ArgumentParser(); add_table_args(p, required=False)
>>> p.parse_args(["--input", "a.csv", "--keep-columns", "q,a"]).keep_columns
('q', 'a')
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

from ..errors import LogprobeError
from ..io.jsonsafe import dumps
from ..io.tables import count_rows, open_sink, read_rows, table_format
from ..jobs import RunCounts, run_rows
from .common import PROG

INPUT_FORMATS = ("jsonl", "csv", "parquet")


def add_table_args(p: argparse.ArgumentParser, required: bool) -> None:
    t = p.add_argument_group("table files")
    t.add_argument("--input", required=required, default=None, metavar="FILE",
                   help="rows: JSONL, CSV or Parquet (by extension or --input-format); - reads JSONL from stdin")
    t.add_argument("--input-format", choices=INPUT_FORMATS, default=None)
    t.add_argument("--output", required=required, default=None, metavar="FILE",
                   help="results, one row per input row: JSONL (a file) or Parquet (*.parquet: a directory of "
                        "part files, one per batch). An existing output is resumed: rows already there are skipped")
    t.add_argument("--output-format", choices=("jsonl", "parquet"), default=None)
    t.add_argument("--keep-columns", type=lambda s: tuple(c for c in s.split(",") if c), default=None,
                   metavar="A,B", help="only these input columns are copied into each output row (default: every "
                                       "input column; a result column of the same name replaces it)")
    t.add_argument("--batch-rows", type=int, default=64, metavar="N",
                   help="input rows per batch: results reach the output at least this often (default: %(default)s)")


def add_images_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images-column", default=None, metavar="NAME",
                   help="a column of each row's prompt images (a model with a vision tower): a path relative to "
                        "the table file's folder, bytes, a data: URL, or a list of them (JSON text in CSV); one "
                        "placeholder per image in the prompt. A row whose image cannot be read fails alone")


def images_options(args: argparse.Namespace) -> dict:
    """The job's ``images_column`` and ``base_dir`` (the input file's folder; stdin: the current one)."""
    base = os.path.dirname(os.path.abspath(args.input)) if args.input not in (None, "-") else ""
    return {"images_column": args.images_column, "base_dir": base}


class Progress:
    """A tqdm bar on stderr: rows done/total with ETA, tokens done and tokens/s."""

    def __init__(self, total_rows: int | None, enabled: bool) -> None:
        self.bar = None
        self.tokens = 0
        self.start = time.perf_counter()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_rows, unit="row", desc="scoring", file=sys.stderr)

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            speed = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens} tok, {speed:.0f} tok/s", refresh=False)
            self.bar.update(rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def show_progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


@contextlib.contextmanager
def stop_on_signals():
    """Yields a list that SIGTERM/SIGINT append to (the job stops before its next forward pass)."""
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        yield stopping
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_table(args: argparse.Namespace, scorer, job, rows=None, sink=None,
              summary: bool = True) -> tuple[RunCounts, object]:
    """Run ``job`` over ``rows`` (default: ``args.input``) into ``sink`` (default: ``args.output``);
    prints the summary when writing a file."""
    if args.batch_rows < 1:
        raise LogprobeError("--batch-rows", f"must be a positive integer, got {args.batch_rows}")
    total = None
    if rows is None:
        fmt = table_format(args.input, args.input_format, "--input", INPUT_FORMATS)
        if args.input != "-" and fmt != "parquet":
            try:
                open(args.input, "rb").close()
            except OSError as e:
                raise LogprobeError("--input", f"cannot read {args.input!r}: {e.strerror or e}",
                                    "check the path") from e
        rows = read_rows(args.input, fmt)
        total = count_rows(args.input, fmt) if show_progress(args) else None
    if sink is None:
        sink = open_sink(args.output, args.output_format, job.float32_columns, job.result_types())
    start = time.perf_counter()
    progress = Progress(total, show_progress(args))
    try:
        with stop_on_signals() as stopping:
            counts = run_rows(scorer, job, rows, sink, done=getattr(sink, "done", set()),
                              batch_rows=args.batch_rows, stop=lambda: bool(stopping), progress=progress)
    finally:
        progress.close()
        sink.close()
    if summary:
        _summary(args, counts, stopping, time.perf_counter() - start)
    return counts, sink


def _summary(args, counts: RunCounts, stopping: list[int], elapsed: float) -> None:
    if args.output is None:
        return
    summary = {"output": args.output, "written": counts.written, "already_done": counts.already_done,
               "failed": counts.failed, "elapsed_s": round(elapsed, 3)}
    if stopping:
        summary["interrupted"] = signal.Signals(stopping[0]).name
    if args.json:
        print(dumps(summary, compact=False))
    else:
        print(f"{counts.written} written, {counts.already_done} already done, {counts.failed} failed "
              f"-> {args.output} ({elapsed:.2f} s)")
    if stopping:
        print(f"{PROG}: stopped by {signal.Signals(stopping[0]).name}: {counts.written} rows written and flushed; "
              "run the same command again to resume", file=sys.stderr)


def exit_code(counts: RunCounts) -> int:
    """130 when stopped by a signal, 1 when some rows failed, else 0."""
    return 130 if counts.stopped else (1 if counts.failed else 0)

"""Table files in and out: JSONL, CSV and Parquet rows, written in batches and resumable.

Input (``read_rows``): one ``Row`` per record, numbered from 0 in file order. JSONL: one JSON
object per line (blank lines are skipped but keep their number; a line that is not JSON is a
``Row`` with a ``problem``); CSV: a header line, then one row per record (every cell a string;
the jobs parse numbers and JSON lists themselves); Parquet: read one record batch at a time.

Output, one dict per finished input row (``{"index": i, ...}``; a row that failed has an
``"error"``):

* JSONL (``JsonlSink``): one line per row, a batch's rows written (in index order) and flushed
  when the batch ends. Resume: the lines already there are kept (a cut-off last line is removed),
  error lines are dropped so those rows run again; when the rerun's rows fill gaps, the file is
  rewritten in index order at the end (atomically).
* Parquet (``ParquetSink``): ``OUTPUT`` is a directory of part files ``part-00000.parquet``,
  ``part-00001.parquet``, ..., one per batch of rows, each written to ``.part-N.tmp`` and renamed
  when complete, so a killed run leaves only whole parts (and maybe a tmp file, deleted on
  resume). ``pyarrow.dataset.dataset(OUTPUT)``, ``pandas.read_parquet(OUTPUT)`` or ``read_output``
  read it back. Per-token arrays are list<float32> columns (the values are float32 already, so
  nothing is rounded).

Both outputs are in input order (``index`` ascending), a resumed job's included, so an output
read back lines up with its input row for row (when no row failed).

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> sink = open_sink(os.path.join(d, "out.parquet"), None, float32_columns={"logprobs"})
>>> sink.add({"index": 0, "logprobs": [-0.5, -1.25]}); sink.end_batch()
>>> read_output(os.path.join(d, "out.parquet"))
[{'index': 0, 'logprobs': [-0.5, -1.25], 'error': None}]
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import LogprobeError
from .jsonsafe import dumps
from .parquet import ParquetSink, read_parts

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}


@dataclass(slots=True)
class Row:
    """One input record: ``data`` (a dict), or ``problem`` (why it could not be read)."""

    index: int
    where: str  # "line 3" (JSONL) or "row 3" (CSV, Parquet): 1-based, for messages
    data: dict | None = None
    problem: str | None = None


def table_format(path: str, given: str | None, option: str, allowed: tuple[str, ...]) -> str:
    """``given``, or the format named by ``path``'s extension ("-" is JSONL)."""
    fmt = given or ("jsonl" if path == "-" else FORMATS.get(os.path.splitext(path)[1].lower()))
    if fmt not in allowed:
        what = f"format {given!r}" if given else f"the extension of {path!r}"
        raise LogprobeError(option, f"{what} is not one of {', '.join(allowed)}",
                            f"name the file *.{allowed[0]} or give {option}-format")
    return fmt


def read_rows(path: str, fmt: str) -> Iterator[Row]:
    """The records of ``path`` in order (``-`` reads JSONL from stdin, line by line)."""
    if fmt == "parquet":
        yield from _parquet_rows(path)
        return
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8", newline="" if fmt == "csv" else None)
    except OSError as e:
        raise LogprobeError("--input", f"cannot read {path!r}: {e.strerror or e}", "check the path") from e
    try:
        yield from (_csv_rows(f) if fmt == "csv" else _jsonl_rows(f))
    except UnicodeDecodeError as e:
        raise LogprobeError("--input", f"is not UTF-8 text ({e.reason})", "convert it to UTF-8") from e
    except csv.Error as e:
        raise LogprobeError("--input", f"is not valid CSV ({e})", "fix the file") from e
    finally:
        if f is not sys.stdin:
            f.close()


def _jsonl_rows(f) -> Iterator[Row]:
    for index, line in enumerate(iter(f.readline, "")):  # readline: a pipe's lines arrive as written
        if not line.strip():
            continue
        where = f"line {index + 1}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            yield Row(index, where, problem=f"JSON: invalid: {e.msg} at column {e.colno}; fix or remove the line")
            continue
        if isinstance(data, dict):
            yield Row(index, where, data)
        else:
            yield Row(index, where, problem=f"line: must be a JSON object, got {type(data).__name__}")


def _csv_rows(f) -> Iterator[Row]:
    for index, rec in enumerate(csv.DictReader(f)):
        extra = rec.pop(None, None)
        if extra is not None:
            yield Row(index, f"row {index + 1}", problem=f"has {len(extra)} more cells than the header")
        else:
            yield Row(index, f"row {index + 1}", {k: (None if v is None else v) for k, v in rec.items()})


def _parquet_rows(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise LogprobeError("--input", f"cannot read {path!r} as Parquet ({e})", "check the path") from e
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield Row(index, f"row {index + 1}", rec)
            index += 1


def count_rows(path: str, fmt: str) -> int | None:
    """How many records ``path`` holds (for a progress bar); None for stdin."""
    if path == "-":
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        n = sum(1 for line in f if line.strip())
    return n - 1 if fmt == "csv" else n


# -- output ----------------------------------------------------------------------------------------


def open_sink(path: str, fmt: str | None, float32_columns: set[str] = frozenset(), types: dict | None = None):
    """A ``JsonlSink`` or ``ParquetSink`` for ``path`` (format from ``fmt`` or the extension);
    ``types``: the job's declared result columns (Parquet only)."""
    fmt = table_format(path, fmt, "--output", ("jsonl", "parquet"))
    if fmt == "parquet":
        return ParquetSink(path, float32_columns, types)
    return JsonlSink(path)


def read_output(path: str) -> list[dict]:
    """The rows of a JSONL output file or a Parquet output directory, in file order."""
    if os.path.isdir(path):
        return read_parts(path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class JsonlSink:
    """Appends one JSON line per row, a batch at a time in index order; ``done`` holds the rows
    already there. ``close`` rewrites the file in index order when a resumed run filled gaps."""

    def __init__(self, path: str) -> None:
        if os.path.isdir(path):
            raise LogprobeError("--output", f"{path!r} is a directory", "give a file path")
        self.path = path
        self._rows: list[dict] = []
        self.done = self._resume()
        self._last = max(self.done, default=-1)  # the highest index in the file
        self._disordered = False
        try:
            self._f = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise LogprobeError("--output", f"cannot write {path!r}: {e.strerror or e}", "check the path") from e

    def _resume(self) -> set[int]:
        """Indices already written; a cut-off tail is removed and error lines dropped (rerun)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return set()
        except OSError as e:
            raise LogprobeError("--output", f"cannot read {self.path!r}: {e.strerror or e}", "check the path") from e
        done: set[int] = set()
        keep: list[bytes] = []
        lines = data.splitlines(keepends=True)
        for n, line in enumerate(lines):
            rec = _json_line(line)
            if rec is None:  # cut off by a kill, or not ours: this line and the rest are recomputed
                cut = len(lines) - n
                print(f"logprobe: {self.path}: removed {cut} incomplete line{'s' * (cut != 1)} at the end "
                      "(they will be recomputed)", file=sys.stderr)
                break
            if rec.get("error") is None:
                done.add(rec["index"])
                keep.append(line)
        kept = b"".join(keep)
        if kept != data:
            _replace(self.path, kept)
        return done

    def add(self, row: dict) -> None:
        self._rows.append(row)

    def end_batch(self) -> None:
        """Write the rows added since the last call, in index order, and flush."""
        if not self._rows:
            return
        rows = sorted(self._rows, key=lambda r: r["index"])
        self._rows = []
        self._disordered |= rows[0]["index"] < self._last
        self._last = max(self._last, rows[-1]["index"])
        self._f.write("".join(dumps(r) + "\n" for r in rows))
        self._f.flush()

    def close(self) -> None:
        self.end_batch()
        self._f.close()
        if self._disordered:  # a resumed run filled gaps: the whole file in index order
            with open(self.path, "rb") as f:
                lines = [line for line in f.read().splitlines(keepends=True) if line.strip()]
            lines.sort(key=lambda line: json.loads(line)["index"])
            _replace(self.path, b"".join(lines))
            self._disordered = False


def _json_line(line: bytes) -> dict | None:
    """A complete output line as a dict with an int index, else None."""
    if not line.endswith(b"\n"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and type(rec.get("index")) is int else None


def _replace(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise LogprobeError("--output", f"cannot rewrite {path!r}: {e.strerror or e}") from e

"""Rows in, rows out: the one loop that runs a row job (score, perplexity, logprobs) on a scorer.

A job turns one input row, under the scorer's ``ScoringContext``, into a ``RowWork``: the row's
``scoring.work.Job`` (engine requests, and how their results become the output columns). ``run_rows`` reads rows in batches, runs each batch's requests in
shared forward passes and hands every finished row to a sink (``io.tables``):

    input row 7 --job.work(row, context)--> requests r0, r1 (windows, continuations) --engine--> results
                --work.job.finish--> {"index": 7, <kept columns>, <results>}  --> sink.add

A row the job cannot read (missing field, bad ids, too long) or that does not fit in memory even
alone becomes ``{"index": i, ..., "error": "<why>"}`` and a line ``"row 8: <why>"`` on stderr; the
other rows go on. Rows in ``done`` are skipped (resume). ``stop()`` is asked before each forward
pass: the rows finished so far are in the sink when it returns ``stopped``.

>>> from logprobe import Scorer                                      # doctest: +SKIP
>>> from logprobe.jobs import ScoreRows, run_rows
>>> counts = run_rows(Scorer(), ScoreRows(), rows, sink)            # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..engine.delivery import RunStopped
from ..engine.request import RequestResult
from ..errors import LogprobeError
from ..io.tables import Row
from ..scoring.inputs import check_no_media
from ..scoring.work import Job


@dataclass(slots=True)
class RowWork:
    """One input row: its index, the output row's first columns (``head``: index, id, kept
    columns) and its ``Job``, whose ``finish(results)`` gives the rest of the output row."""

    index: int
    head: dict
    job: Job


@dataclass(slots=True)
class RunCounts:
    written: int = 0
    already_done: int = 0
    failed: int = 0
    stopped: bool = False


def row_head(row: Row, keep: tuple[str, ...] | None, echo_id: bool = False, images_column: str | None = None) -> dict:
    """``{"index": i}``, then ``id`` (when echoed) and the kept input columns (None where missing);
    ``keep`` None: every input column but ``index``, ``error`` (the output's own) and
    ``images_column`` (image bytes are not copied into every output row), as the Ray path passes
    them through (a result column of the same name replaces it).

    >>> row_head(Row(3, "row 4", {"q": 1, "index": 9, "text": "a"}), None)
    {'index': 3, 'q': 1, 'text': 'a'}
    """
    head: dict[str, Any] = {"index": row.index}
    data = row.data or {}
    if echo_id:
        head["id"] = data.get("id")
    if keep is None:
        keep = tuple(k for k in data if k not in ("index", "error", images_column))
    head.update((k, data.get(k)) for k in keep)
    return head


def _batches(rows: Iterable[Row], size: int, done: set[int], counts: RunCounts) -> Iterator[list[Row]]:
    batch: list[Row] = []
    for row in rows:
        if row.index in done:
            counts.already_done += 1
            continue
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def run_rows(scorer, job, rows: Iterable[Row], sink, *, done: set[int] = frozenset(), batch_rows: int = 64,
             stop: Callable[[], bool] | None = None, progress=None, report=None) -> RunCounts:
    """Run ``job`` over ``rows`` into ``sink`` (see the module docstring). ``progress``: an object
    with ``update(rows, tokens)`` (``cli.progress``), or None. ``report(line)``: stderr by default."""
    report = report or (lambda line: print(line, file=sys.stderr))
    counts = RunCounts()
    for batch in _batches(rows, batch_rows, done, counts):
        works = []
        for row in batch:
            try:
                if row.problem is not None:  # unreadable (not JSON): reported as the reader words it
                    _failed(sink, job.head(row), row.where, row.problem, counts, report)
                else:
                    check_media(row, getattr(job, "images_column", None))
                    works.append(job.work(row, scorer.context))
            except LogprobeError as e:
                _failed(sink, job.head(row), row.where, str(e), counts, report)
        counts.stopped = _run_batch(scorer, works, batch, sink, counts, report, stop, progress)
        sink.end_batch()
        if counts.stopped:
            break
    return counts


def check_media(row: Row, images_column: str | None) -> None:
    """Refuse a row with a media column (``images``, ``image_data``, ...) that the job does not
    read: its text would be scored without it. The job's ``images_column`` is read."""
    try:
        check_no_media({k: v for k, v in row.data.items() if v is not None and k != images_column}, "")
    except LogprobeError as e:
        raise LogprobeError(e.field, "is a media column this job does not read (the text would be scored "
                            "without it)", f"name it with --images-column {e.field} (a model with a vision "
                            "tower), or drop the column") from e


class ListSink:
    """Rows kept in memory, in the order they finished (a sink for ``run_rows`` without a file)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.done: set[int] = set()

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def end_batch(self) -> None:
        pass

    def close(self) -> None:
        pass


def map_rows(scorer, job, rows: list[Row], report=None) -> list[dict]:
    """``run_rows`` over ``rows`` in memory: one output dict per input row, in the input's order
    (``Row.index`` must be unique). Used where rows arrive in batches from elsewhere (Ray Data).

    >>> map_rows(None, None, [])
    []
    """
    if not rows:
        return []
    sink = ListSink()
    run_rows(scorer, job, rows, sink, batch_rows=len(rows), report=report or (lambda line: None))
    order = {r.index: k for k, r in enumerate(rows)}
    return sorted(sink.rows, key=lambda out: order[out["index"]])


def _failed(sink, head: dict, where: str, message: str, counts: RunCounts, report) -> None:
    message = " ".join(message.split())
    report(f"{where}: {message}")
    sink.add({**head, "error": message})
    counts.failed += 1


def _run_batch(scorer, works: list[RowWork], batch: list[Row], sink, counts: RunCounts, report, stop,
               progress) -> bool:
    """Run the requests of ``works`` together; True when ``stop`` ended it early."""
    requests, owner = [], []
    for k, w in enumerate(works):
        requests.extend(w.job.requests)
        owner.extend((k, j) for j in range(len(w.job.requests)))
    results: list[list] = [[None] * len(w.job.requests) for w in works]
    left = [len(w.job.requests) for w in works]
    where = {r.index: r.where for r in batch}

    def on_result(i: int, res: RequestResult) -> None:
        k, j = owner[i]
        results[k][j] = res
        left[k] -= 1
        if left[k] == 0:
            w = works[k]
            try:
                sink.add({**w.head, **w.job.finish(results[k])})
                counts.written += 1
            except LogprobeError as e:
                _failed(sink, w.head, where[w.index], str(e), counts, report)
            if progress is not None:
                progress.update(1, w.job.num_tokens)

    def on_error(i: int, e: Exception) -> None:  # out of memory even alone: the row fails, once
        k, _ = owner[i]
        if left[k] > 0:
            left[k] = -1
            text = f"{e.problem}; {e.fix}" if isinstance(e, LogprobeError) else str(e)
            _failed(sink, works[k].head, where[works[k].index], text, counts, report)

    if not requests:
        return bool(stop and stop())
    try:
        executor = scorer.executor
        if executor.per_request_errors:
            executor.run(requests, on_result=on_result, progress=False, stop=stop, on_error=on_error)
        else:  # worker processes: a replica's error fails the batch; stop() asked while they run
            executor.run(requests, on_result=on_result, stop=stop)
    except RunStopped:
        return True
    return bool(stop and stop())

"""A whole table job on Ray Data: input files -> numbered rows -> actors -> Parquet, resumable.

``run_dataset`` is what ``logprobe ray {logprobs,score,perplexity}`` runs:

    files (sorted)  --read_json/csv/parquet-->  rows  --number: index 0..N-1 in file order-->
    minus the indices already in OUTPUT  --map_batches(Logprobs | Score | Perplexity)-->
    OUTPUT/<write uuid>_<task>-<i>.parquet   (one row per input row: index, [id], kept columns,
                                              results, error)

* **Numbering**: rows are numbered in file order (files sorted by path, rows in file order), the
  CLI's ``index``; an input that has an ``index`` column keeps it. Numbering reads the input
  once into Ray's object store first (it spills to disk when large).
* **Resume**: every readable Parquet file in OUTPUT lists finished ``index`` values; a rerun
  skips them and writes new files, so no row is lost or written twice. A file cut off by a
  killed driver has no Parquet footer and cannot be read: it is deleted and its rows are done
  again; rows with an ``error`` are removed from their file (rewritten under a temporary name,
  then renamed) and computed again, as ``logprobe ... --output x.parquet`` does.
* **Retries**: Ray Data's actor pools run with ``max_restarts=-1`` (a dead actor, its process
  or node lost, is always replaced) and ``max_task_retries=-1`` (the batch it held is given to a
  live actor again until it completes); an exception raised by the job is not retried (bad rows
  never raise: they get an ``error``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from ..errors import LogprobeError
from .ray import PERPLEXITY_INPUTS, Logprobs, Perplexity, Score, aggregate_perplexity

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}


@dataclass(slots=True)
class RunSummary:
    rows: int = 0  # input rows
    already_done: int = 0
    written: int = 0
    failed: int = 0
    tokens: int = 0  # scored tokens of the rows written by this run
    elapsed_s: float = 0.0
    aggregate: dict | None = field(default=None)  # perplexity over every finished row of OUTPUT

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else math.inf


def filesystem(path: str, option: str):
    """``(pyarrow FileSystem, path on it)`` for a local path or a URI (s3://, gs://, ...)."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
    except (OSError, ValueError) as e:
        raise LogprobeError(option, f"cannot open {path!r} ({e})", "give a local path or a URI Arrow reads") from e


def input_files(path: str, fmt: str | None) -> tuple[object, list[str], str]:
    """``(filesystem, sorted file paths, format)`` of a file or a directory of JSONL/CSV/Parquet files."""
    import pyarrow.fs as pafs

    fs, root = filesystem(path, "--input")
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise LogprobeError("--input", f"{path!r} does not exist", "check the path")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        files = sorted(i.path for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))
                       and (fmt or FORMATS.get(os.path.splitext(i.base_name)[1].lower())))
    else:
        files = [root]
    kinds = {fmt or FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        found = "no JSONL, CSV or Parquet files" if not files else f"files of formats {sorted(map(str, kinds))}"
        raise LogprobeError("--input", f"{path!r} has {found}", "give files of one format (*.jsonl, *.csv, *.parquet) "
                            "or --input-format")
    return fs, files, kinds.pop()


def read_input(path: str, fmt: str | None = None):
    """The rows of ``path`` as a Ray Dataset, files in sorted order."""
    import ray.data

    fs, files, fmt = input_files(path, fmt)
    if fmt == "csv":  # quoted cells may hold newlines (texts)
        import pyarrow.csv

        return ray.data.read_csv(files, filesystem=fs,
                                 parse_options=pyarrow.csv.ParseOptions(newlines_in_values=True))
    reader = {"jsonl": ray.data.read_json, "parquet": ray.data.read_parquet}[fmt]
    return reader(files, filesystem=fs)


def _parquet_files(fs, root: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                  and not i.base_name.startswith("."))


def finished_indices(output: str) -> set[int]:
    """The ``index`` values finished in ``output`` (see the module docstring: unreadable files
    deleted, error rows removed so they run again)."""
    import pyarrow.compute as pc
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, root = filesystem(output, "--output")
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        raise LogprobeError("--output", f"{output!r} is a file", "give a directory (new, or an earlier run's)")
    if info.type == pafs.FileType.NotFound:
        return set()
    for i in fs.get_file_info(pafs.FileSelector(root)):
        if i.base_name.startswith(".") and i.base_name.endswith(".tmp"):
            fs.delete_file(i.path)
    done: set[int] = set()
    for path in _parquet_files(fs, root):
        try:  # only the index and error columns (per-token results stay on disk)
            names = [c for c in ("index", "error") if c in pq.read_schema(path, filesystem=fs).names]
            table = pq.read_table(path, filesystem=fs, columns=names)
        except (OSError, ValueError):  # cut off by a kill: no footer
            fs.delete_file(path)
            continue
        if "error" in table.column_names and table["error"].null_count < len(table):
            table = pq.read_table(path, filesystem=fs)
            table = table.filter(pc.is_null(table["error"]))
            _replace(fs, path, table)
        done.update(table["index"].to_pylist())
    return done


def _replace(fs, path: str, table) -> None:
    import pyarrow.parquet as pq

    if len(table) == 0:
        fs.delete_file(path)
        return
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    pq.write_table(table, tmp, filesystem=fs)
    fs.move(tmp, path)


def number_rows(ds, done: set[int], block_rows: int | None = None):
    """``(dataset with an index column minus the done rows, number of input rows)``, in blocks
    of at most ``block_rows`` rows (a block goes to one actor: a small input read as one block
    would keep every replica but one idle). The blocks are made by tasks that have finished when
    this returns: once the actors hold every CPU, a task queued behind them would wait forever."""
    import numpy as np
    import ray

    refs = ds.materialize().to_arrow_refs()  # in read order (preserve_order is set by run_dataset)
    if not refs:
        return ray.data.from_items([]), 0
    sizes = ray.get([ray.remote(_num_rows).remote(r) for r in refs])
    skip = ray.put(np.fromiter(sorted(done), dtype=np.int64, count=len(done)))
    index_block = ray.remote(_index_block)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    blocks = [index_block.remote(r, off, skip, b, min(b + (block_rows or n), n))
              for r, off, n in zip(refs, offsets, sizes) for b in range(0, max(n, 1), block_rows or max(n, 1))]
    ray.wait(blocks, num_returns=len(blocks), fetch_local=False)
    return ray.data.from_arrow_refs(blocks), int(sum(sizes))


def _num_rows(table) -> int:
    return table.num_rows


def _index_block(table, offset: int, skip, begin: int, end: int):
    """Rows ``begin:end`` of the block with ``index`` (first; kept when the input has one) minus
    the rows in ``skip``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = table.slice(begin, end - begin)
    offset += begin
    if "index" not in table.column_names:
        table = table.add_column(0, "index", pa.array(range(offset, offset + table.num_rows), pa.int64()))
    if len(skip):
        table = table.filter(pc.invert(pc.is_in(table["index"], value_set=pa.array(skip))))
    return table


def run_dataset(job: str, input_path: str, output: str, scorer_kwargs: dict, options: dict, *, replicas: int = 1,
                gpus_per_replica: float = 0, cpus_per_replica: float = 1, batch_size: int = 64,
                keep_columns: tuple[str, ...] = (), input_format: str | None = None) -> RunSummary:
    """Run ``job`` (logprobs, score, perplexity) over ``input_path`` into ``output`` on the Ray
    cluster this process is connected to (``ray.init`` first). See the module docstring."""
    import ray.data


    mapper = {"logprobs": Logprobs, "score": Score, "perplexity": Perplexity}[job]
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    start = time.perf_counter()
    ds = read_input(input_path, input_format)
    done = finished_indices(output)
    fs, root = filesystem(output, "--output")
    before = set(_parquet_files(fs, root))
    todo, total = number_rows(ds, done, batch_size)
    summary = RunSummary(rows=total, already_done=len(done))
    if total > len(done):
        out = todo.map_batches(mapper, fn_constructor_kwargs={**scorer_kwargs, **options, "columns": keep_columns},
                               batch_size=batch_size, batch_format="pyarrow", concurrency=replicas,
                               num_gpus=gpus_per_replica or None, num_cpus=cpus_per_replica)
        out.write_parquet(output if "://" in output else os.path.abspath(output))
    _count_new(summary, fs, [p for p in _parquet_files(fs, root) if p not in before], job)
    summary.elapsed_s = time.perf_counter() - start
    if job == "perplexity":
        summary.aggregate = aggregate_output(fs, root)
    return summary


def _count_new(summary: RunSummary, fs, files: list[str], job: str) -> None:
    """Rows, failures and scored tokens of this run's files."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    for path in files:
        table = pq.read_table(path, filesystem=fs)
        summary.written += len(table)
        summary.failed += len(table) - table["error"].null_count
        col = "logprobs" if job == "logprobs" else "num_tokens"
        if col not in table.column_names:
            continue
        values = table[col]
        if job == "logprobs":
            values = pc.list_value_length(values)
        elif pa.types.is_list(values.type):  # score rows with continuations: a count per continuation
            values = pc.list_flatten(values)
        summary.tokens += int(pc.sum(values).as_py() or 0)


def read_output(output: str):
    """Every row of an output directory as one pyarrow Table (schemas unified)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = filesystem(output, "--output")
    tables = [pq.read_table(p, filesystem=fs) for p in _parquet_files(fs, root)]
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def aggregate_output(fs, root: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq


    tables = []
    for p in _parquet_files(fs, root):
        names = set(pq.read_schema(p, filesystem=fs).names)
        cols = [c for c in (*PERPLEXITY_INPUTS, "error") if c in names]
        tables.append(pq.read_table(p, filesystem=fs, columns=cols))
    table = pa.concat_tables(tables, promote_options="permissive") if tables else []
    return aggregate_perplexity(table)

"""Ray Data: logprobe's three row jobs as callable classes for ``Dataset.map_batches``.

Each class loads one ``Scorer`` per Ray actor and maps a batch of rows to results through the
same row -> requests -> row code as ``logprobe score/perplexity/logprobs --input``
(``logprobe.jobs``), so a row gives the same columns (and, with ``deterministic=True``, the same
bits) on a cluster as through the library or the CLI:

* ``Logprobs``: ``prompt_token_ids``, ``completion_token_ids`` (optional per-row ``temperature``,
  ``top_k``, ``entropy``) -> ``logprobs`` (list<float32>), ``sum_logprob``, ``is_greedy`` (list<bool>),
  and ``entropy``, ``top_k_ids``, ``top_k_logprobs`` when asked;
* ``Score``: ``prompt`` + ``continuation`` (or ``continuations``, a list) -> ``continuation`` (as
  scored, after the join rule), ``log_prob``, ``num_tokens``, ``is_greedy``, ``token_logprobs``;
* ``Perplexity``: ``text`` -> ``nll_sum``, ``num_tokens``, ``nll_mean``, ``nll_stderr``,
  ``num_words``, ``num_bytes``, ``perplexity``, ... per text; ``aggregate_perplexity`` pools them.

Every input column passes through unchanged (types kept); the results are appended (a result
column replaces an input column of the same name), plus ``error``: null, or ``"field: reason"``
for a row the job could not score (ids out of the vocabulary, an empty prompt, too long): the
row stays in the block with null results, the block goes on.

    import ray, logprobe.ray
    ds = ray.data.read_parquet("rollouts/")
    out = logprobe.ray.map_batches(ds, logprobe.ray.Logprobs, fn_constructor_kwargs={"model": "org/model",
                                   "deterministic": True, "top_k": 5}, concurrency=4, num_gpus=1, batch_size=256)

``map_batches(ds, cls, ...)`` is ``ds.map_batches(cls, ...)`` (pyarrow batches by default) after one
check, before anything starts: the actors must leave the cluster a whole CPU for Ray Data's read
tasks (``check_cpus``). Actors that hold every CPU start first and the read waits behind them
forever (``ray.init(num_cpus=2)`` with ``concurrency=2, num_cpus=1``: "ListFiles 0/1", no error);
it is refused with the fix instead. ``num_cpus`` only reserves: a Scorer uses its threads whatever
it says, so ``num_cpus=0.5`` costs nothing.

Batches: any ``batch_format`` works (a pyarrow Table, a pandas DataFrame or a dict of numpy
arrays); ``"pyarrow"`` is the natural one (no conversion). A batch comes back as a pyarrow Table.
``num_gpus=G > 1`` makes the actor's Scorer tensor-parallel over its G GPUs. Ray Data restarts
a dead actor and retries its batch (``max_restarts``, ``max_task_retries``: Ray Data's defaults,
or pass them to ``map_batches``).

Corpus perplexity from per-text rows, exactly as ``Scorer.perplexity(texts)`` pools the tokens
(lm-eval's definitions; words are ``re.split(r"\\s+", text)``, bytes UTF-8)::

    row   nll_sum  num_tokens  num_words  num_bytes
    a       12.0        4          2          10
    b        8.0        6          3          14
    corpus: nll_mean = (12 + 8) / (4 + 6) = 2.0  -> perplexity = e^2.0 = 7.389
            word perplexity = e^(20 / 5) = 54.6, byte perplexity = e^(20 / 24) = 2.30,
            bits per byte = 20 / 24 / ln 2 = 1.202

>>> t = {"nll_sum": [12.0, 8.0], "num_tokens": [4, 6], "nll_mean": [3.0, 4 / 3], "nll_stderr": [0.5, 0.5],
...      "num_windows": [1, 1], "num_words": [2, 3], "num_bytes": [10, 14]}
>>> agg = aggregate_perplexity(t)
>>> round(agg["perplexity"], 3), round(agg["word_perplexity"], 1), round(agg["bits_per_byte"], 3)
(7.389, 54.6, 1.202)
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import Deterministic, EngineConfig
from ..errors import LogprobeError
from ..io.parquet import arrow_type, float32_type, with_declared
from ..io.tables import Row
from ..jobs import JOBS, aggregate, map_rows, row_job  # noqa: F401  (JOBS: re-exported by logprobe.ray)
from ..scorer import Scorer

PERPLEXITY_INPUTS = ("nll_sum", "num_tokens", "nll_mean", "nll_stderr", "num_windows", "num_words", "num_bytes")
_log = logging.getLogger("logprobe.ray")
NO_CAPTURE = "hidden-state captures are not available on Ray yet"


class _RowJob:
    """One Scorer per actor; ``__call__(batch) -> pyarrow.Table`` (see the module docstring).

    ``model``, ``device``, ``dtype``, ``deterministic``, ``max_batch_tokens``: as ``Scorer``;
    ``tp_invariant``: ``Deterministic.tp_invariant`` (with ``deterministic``);
    ``tensor_parallel_size``: default the number of GPUs Ray gave the actor (1 without GPUs).
    ``columns``: None (default) passes every input column through; a tuple makes the CLI's rows
    instead: ``index`` (read from the input's ``index`` column), ``id`` (logprobs), these columns.
    Other keywords are the job's options (``temperature``, ``top_k``, ``entropy``; score: ``join``;
    perplexity: ``text_field``, ``context_length``, ``stride``, ``policy``, ``prefix``, ``max_tokens``).
    """

    job_name = ""

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 deterministic: bool = False, tp_invariant: bool = True, max_batch_tokens: int | None = None,
                 tensor_parallel_size: int | None = None, columns: tuple[str, ...] | None = None, **options: Any) -> None:
        if options.get("capture") is not None:
            raise LogprobeError("capture", NO_CAPTURE, "use logprobe logprobs --capture on one machine")
        config = EngineConfig(max_batch_tokens=max_batch_tokens, progress=False,
                              deterministic=Deterministic(tp_invariant=tp_invariant) if deterministic else None)
        self.scorer = Scorer(model, device=device, dtype=dtype, config=config,
                             tensor_parallel_size=tensor_parallel_size or _actor_gpus())
        self.columns = columns
        self.job = row_job(self.job_name, keep=tuple(columns or ()), **options)

    def __call__(self, batch):
        table = to_arrow(batch)
        data = table.to_pylist()
        if self.columns is None:  # position in the batch; the input's columns come back as they were
            rows = [Row(k, f"row {k + 1} of the batch", d) for k, d in enumerate(data)]
        else:
            rows = [Row(d["index"], f"row {d['index'] + 1}", d) for d in data]
        for r in rows if self.job_name == "logprobs" else ():
            if r.data.get("capture") is not None:  # side files would need a shared disk: refused per row
                r.problem = f"capture: {NO_CAPTURE}"
        outs = map_rows(self.scorer, self.job, rows, report=_log.warning)
        types = self._types(table)
        if self.columns is not None:
            return result_table(outs, self.job.float32_columns, types)
        head = set(self.job.head(rows[0])) if rows else set()
        results = result_table([{k: v for k, v in o.items() if k not in head} for o in outs],
                               self.job.float32_columns, types)
        for name in results.column_names:
            if name in table.column_names:
                table = table.drop_columns([name])
            table = table.append_column(name, results[name])
        return table

    def _types(self, table) -> dict:
        """Every output column's pyarrow type, known before the rows are run, so that every
        block (one of failed rows too) writes the same schema: results from the job, the echoed
        ``id`` and kept columns from the input."""
        types = {k: arrow_type(t) for k, t in self.job.result_types(set(table.column_names)).items()}
        if self.columns is not None:
            types.update((k, table.schema.field(k).type) for k in ("id", *self.columns) if k in table.column_names)
        return types

    def __del__(self) -> None:
        scorer = getattr(self, "scorer", None)
        if scorer is not None and hasattr(scorer, "close"):
            scorer.close()


class Logprobs(_RowJob):
    """RL sequences -> per-token log-probs (``logprobe logprobs`` columns). See the module docstring."""

    job_name = "logprobs"


class Score(_RowJob):
    """Prompt + continuation(s) -> log-prob, greedy flag (``logprobe score`` columns)."""

    job_name = "score"


class Perplexity(_RowJob):
    """A text per row -> its NLL sum, token, word and byte counts (``aggregate_perplexity`` pools them)."""

    job_name = "perplexity"


JOBS_CLASSES: dict[str, type[_RowJob]] = {"logprobs": Logprobs, "score": Score, "perplexity": Perplexity}


READ_CPUS = 1.0  # what one Ray Data read task reserves (its map tasks' default)


def check_cpus(cluster_cpus: float, replicas: int, cpus_per_replica: float) -> None:
    """Refuse actors that leave the cluster less than a whole CPU for Ray Data's read tasks: they
    would start first and the read would wait behind them forever (one line, naming the fix).

    >>> check_cpus(4, 2, 1)
    >>> check_cpus(2, 2, 1)
    Traceback (most recent call last):
    logprobe.errors.LogprobeError: num_cpus: concurrency × num_cpus = 2 × 1 = 2 of the cluster's 2 CPUs leaves 0 for reading (a read task needs 1 CPU; it would wait forever behind the actors); use num_cpus=0.5 (a reservation only: the Scorer's threads do not change) or concurrency=1
    """
    held = replicas * cpus_per_replica
    if cluster_cpus - held >= READ_CPUS:
        return
    room = cluster_cpus - READ_CPUS
    fixes = []
    if room > 0:
        fixes.append(f"num_cpus={_round_down(room / replicas):g} (a reservation only: the Scorer's threads "
                     "do not change)")
        if cpus_per_replica > 0 and (fewer := int(room // cpus_per_replica)) >= 1:
            fixes.append(f"concurrency={fewer}")
    fix = " or ".join(fixes) if fixes else f"give the cluster more than {READ_CPUS:g} CPU (ray.init(num_cpus=...))"
    raise LogprobeError("num_cpus", f"concurrency × num_cpus = {replicas} × {cpus_per_replica:g} = {held:g} of the "
                        f"cluster's {cluster_cpus:g} CPUs leaves {max(cluster_cpus - held, 0):g} for reading (a read "
                        f"task needs {READ_CPUS:g} CPU; it would wait forever behind the actors)", f"use {fix}")


def _round_down(x: float) -> float:
    """``x`` rounded down to a hundredth (a num_cpus that fits)."""
    return max(int(x * 100) / 100, 0.01)


def map_batches(ds, job, *, concurrency: int | tuple | None = None, num_cpus: float | None = None,
                batch_format: str = "pyarrow", compute=None, **kwargs):
    """``ds.map_batches(job, ...)`` (``job``: ``Logprobs``, ``Score``, ``Perplexity``, a subclass,
    or its name) after ``check_cpus`` on the cluster this process is connected to (started as
    ``ds.map_batches`` would, if none): the replicas (``concurrency``, an int; a tuple: its
    largest size; ``compute``: an ``ActorPoolStrategy``) times ``num_cpus`` (Ray Data's default:
    1) must leave a whole CPU. Other keywords go to ``Dataset.map_batches`` as they are; an int
    ``concurrency`` becomes ``compute=ActorPoolStrategy(size=...)`` (Ray's non-deprecated form)."""
    import ray.data

    cls = JOBS_CLASSES.get(job, job) if isinstance(job, str) else job
    if not (isinstance(cls, type) and issubclass(cls, _RowJob)):
        raise LogprobeError("job", f"{job!r} is not a logprobe Ray job", f"give one of {', '.join(JOBS_CLASSES)} "
                            "(or logprobe.ray.Logprobs, Score, Perplexity)")
    if compute is None and concurrency is None:
        concurrency = 1
    if compute is None and isinstance(concurrency, int):
        compute, concurrency = ray.data.ActorPoolStrategy(size=concurrency), None
    if compute is not None:
        replicas = compute.max_size if compute.max_size not in (None, float("inf")) else compute.min_size
    else:
        replicas = max(concurrency[:2]) if isinstance(concurrency, tuple) else concurrency
    if not ray.is_initialized():
        ray.init()
    check_cpus(float(ray.cluster_resources().get("CPU", 0)), int(replicas), 1.0 if num_cpus is None else num_cpus)
    if concurrency is not None:
        kwargs["concurrency"] = concurrency
    if compute is not None:
        kwargs["compute"] = compute
    return ds.map_batches(cls, num_cpus=num_cpus, batch_format=batch_format, **kwargs)


def _actor_gpus() -> int:
    """How many GPUs Ray assigned to this actor (1 when none or outside Ray)."""
    try:
        import ray

        return max(1, len(ray.get_gpu_ids())) if ray.is_initialized() else 1
    except Exception:  # noqa: BLE001 (outside a worker)
        return 1


def to_arrow(batch):
    """A Ray Data batch (pyarrow Table, pandas DataFrame or dict of numpy arrays) as a pyarrow Table.

    >>> import numpy as np
    >>> to_arrow({"ids": np.array([np.array([1, 2]), np.array([3])], dtype=object)})["ids"].to_pylist()
    [[1, 2], [3]]
    """
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v) if getattr(getattr(v, "dtype", None), "kind", "") == "O" else v) for k, v in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)


def result_table(rows: list[dict], float32_columns=frozenset(), types: dict | None = None):
    """Output dicts as a pyarrow Table: every key of every row a column (null where a row lacks
    it), per-token float lists as float32 (they are float32 already: nothing is rounded), the
    declared ``types`` (name -> pyarrow type) present even where no row has them, and an
    ``error`` string column last.

    >>> import pyarrow as pa
    >>> result_table([{"index": 1, "error": "x: bad"}], {"x"}, {"x": pa.list_(pa.float32())}).schema.types
    [DataType(int64), ListType(list<item: float>), DataType(string)]
    """
    import pyarrow as pa


    names = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "error"]
    cols = {k: pa.array([r.get(k) for r in rows]) for k in names}
    for k in float32_columns & set(cols):
        cols[k] = cols[k].cast(float32_type(cols[k].type))
    cols["error"] = pa.array([r.get("error") for r in rows], pa.string())
    table = with_declared(pa.table(cols), types or {})
    return table.select([*(n for n in table.column_names if n != "error"), "error"])


def aggregate_perplexity(results) -> dict:
    """Corpus perplexity (± stderr), word and byte perplexity and bits per byte of ``Perplexity``
    rows: a Ray ``Dataset``, a pyarrow Table, a pandas DataFrame, a dict of columns or a list of
    row dicts. Rows with an ``error`` are left out (counted in ``failed_rows``). Only the per-row
    sums are read, so it pools blocks computed anywhere (``jobs.aggregate``; example in the
    module docstring)."""
    import pyarrow as pa

    if hasattr(results, "select_columns") and hasattr(results, "to_arrow_refs"):  # a Ray Dataset
        import ray

        names = [c for c in (*PERPLEXITY_INPUTS, "error") if c in results.columns()]
        tables = ray.get(results.select_columns(names).to_arrow_refs())
        results = pa.concat_tables(tables, promote_options="permissive") if tables else []
    if isinstance(results, list):
        return aggregate(results)
    if isinstance(results, dict):
        results = pa.table(results)
    elif not isinstance(results, pa.Table):
        results = pa.Table.from_pandas(results, preserve_index=False)
    names = [c for c in (*PERPLEXITY_INPUTS, "error") if c in results.column_names]
    return aggregate(results.select(names).to_pylist())

"""Parquet output as a directory of part files, one per batch of rows (see ``io.tables``).

Why part files: a part is written to ``.part-N.tmp`` and renamed into place only when whole, so
a run killed at any instant leaves complete parts only; the rows they hold are done, every
other row is computed again on the next run. Every part holds the ``index`` and ``error``
columns and every result column the job declares (``result_types``: null in a failed row); a
part's schema is the union of the parts before it and its own rows (a column one batch lacks is
null there), so a reader that takes the first part's schema sees every result column.

Order: a part's rows are in index order, and so are the parts of a run from the start. When a
resumed run's rows fill gaps (rows that failed, or a run stopped mid-way with rows after), the
sink's ``close`` writes every row, in index order, as one new part and then deletes the older
parts; a run killed between the two leaves rows twice, and the next open keeps the newest copy.

>>> import pyarrow as pa
>>> float32_type(pa.list_(pa.list_(pa.float64())))
ListType(list<item: list<item: float>>)
>>> arrow_type("list<list<int64>>")
ListType(list<item: list<item: int64>>)
"""

from __future__ import annotations

import os
import re

from ..errors import LogprobeError

PART = re.compile(r"^part-(\d{5,})\.parquet$")


def float32_type(t):
    """``t`` with every float64 leaf made float32 (lists of lists keep their nesting)."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(float32_type(t.value_type))
    return pa.float32() if pa.types.is_floating(t) else t


def arrow_type(tag: str):
    """A job's column type tag (``float64``, ``int64``, ``float32``, ``bool``, ``string``,
    ``list<T>``) as a pyarrow type; jobs declare their output columns in tags so that they need
    no pyarrow (``LogprobsRows.result_types``)."""
    import pyarrow as pa

    if tag.startswith("list<") and tag.endswith(">"):
        return pa.list_(arrow_type(tag[5:-1]))
    scalars = {"float64": pa.float64(), "float32": pa.float32(), "int64": pa.int64(), "bool": pa.bool_(),
               "string": pa.string()}
    if tag not in scalars:
        raise ValueError(f"unknown column type tag {tag!r}")
    return scalars[tag]


def with_declared(table, types: dict):
    """``table`` with every declared column (name -> pyarrow type): a missing one added as nulls,
    an all-null one (pyarrow's ``null`` type) cast, so that a batch of failed rows has the same
    schema as any other batch (a reader that takes one file's schema sees every column).

    >>> import pyarrow as pa
    >>> t = with_declared(pa.table({"index": [3], "x": [None]}), {"x": pa.float64(), "y": pa.list_(pa.int64())})
    >>> [str(f.type) for f in t.schema]
    ['int64', 'double', 'list<item: int64>']
    """
    import pyarrow as pa

    for name, kind in types.items():
        if name not in table.column_names:
            table = table.append_column(pa.field(name, kind), pa.nulls(len(table), kind))
        elif pa.types.is_null(table[name].type):
            table = table.set_column(table.column_names.index(name), pa.field(name, kind), table[name].cast(kind))
    return table


def _parts(path: str) -> list[tuple[int, str]]:
    found = [(int(m.group(1)), name) for name in os.listdir(path) if (m := PART.match(name))]
    return [(n, os.path.join(path, name)) for n, name in sorted(found)]


class ParquetSink:
    """Collects rows and writes them as one part file per batch (``end_batch``)."""

    def __init__(self, path: str, float32_columns: set[str] = frozenset(), types: dict | None = None) -> None:
        if os.path.isfile(path):
            raise LogprobeError("--output", f"{path!r} is a file; Parquet output is a directory of part files",
                                "give a new path (it becomes a directory) or an earlier run's directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise LogprobeError("--output", f"cannot create {path!r}: {e.strerror or e}", "check the path") from e
        self.path = path
        self.float32_columns = set(float32_columns)
        self.types = {k: arrow_type(t) for k, t in (types or {}).items()}  # declared columns (job.result_types)
        self.schema = None
        self._rows: list[dict] = []
        self.done = self._resume()
        parts = _parts(path)
        self._next = parts[-1][0] + 1 if parts else 0
        self._last = max(self.done, default=-1)  # the highest index written
        self._disordered = False

    def _resume(self) -> set[int]:
        """Indices in the whole parts; tmp files of a killed run removed, error rows dropped (rerun)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        for name in os.listdir(self.path):
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.path, name))
        done: set[int] = set()
        for _, part in reversed(_parts(self.path)):  # newest first: a row twice (a killed reorder) keeps that copy
            table = pq.read_table(part)
            drop = pc.invert(pc.is_null(table["error"]))
            if done:
                drop = pc.or_(drop, pc.is_in(table["index"], value_set=pa.array(sorted(done), pa.int64())))
            if pc.any(drop).as_py():
                table = table.filter(pc.invert(drop))
                self._write(table, part)
            done.update(table["index"].to_pylist())
            self.schema = table.schema if self.schema is None else pa.unify_schemas(
                [table.schema, self.schema], promote_options="permissive")
        return done

    def add(self, row: dict) -> None:
        self._rows.append(row)

    def end_batch(self) -> None:
        """Write the rows added since the last call as the next part file (nothing if none)."""
        if not self._rows:
            return
        rows = sorted(self._rows, key=lambda r: r["index"])
        self._disordered |= rows[0]["index"] < self._last
        self._last = max(self._last, rows[-1]["index"])
        table = self._table(rows)
        self._write(table, os.path.join(self.path, f"part-{self._next:05d}.parquet"))
        self._next += 1
        self._rows = []

    def close(self) -> None:
        self.end_batch()
        if self._disordered:  # a resumed run filled gaps: every row in index order, one part
            import pyarrow as pa
            import pyarrow.parquet as pq

            old = _parts(self.path)
            tables = [pq.read_table(part) for _, part in old]
            table = pa.concat_tables(tables, promote_options="permissive").sort_by("index")
            self._write(table, os.path.join(self.path, f"part-{self._next:05d}.parquet"))
            self._next += 1
            for _, part in old:
                os.remove(part)
            self._disordered = False

    def _table(self, rows: list[dict]):
        import pyarrow as pa

        names = list(dict.fromkeys(k for r in rows for k in r if k != "error")) + ["error"]
        table = pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in names})  # every row's keys
        for name in self.float32_columns & set(table.column_names):
            i = table.column_names.index(name)
            table = table.set_column(i, name, table[name].cast(float32_type(table[name].type)))
        table = with_declared(table, self.types)
        self.schema = table.schema if self.schema is None else pa.unify_schemas(
            [self.schema, table.schema], promote_options="permissive")
        for field in self.schema:
            if field.name not in table.column_names:
                table = table.append_column(field.name, pa.nulls(len(table), field.type))
        return table.select(self.schema.names).cast(self.schema)

    @staticmethod
    def _write(table, part: str) -> None:
        import pyarrow.parquet as pq

        tmp = os.path.join(os.path.dirname(part), "." + os.path.basename(part) + ".tmp")
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, part)
        except OSError as e:
            raise LogprobeError("--output", f"cannot write {part!r}: {e.strerror or e}", "check the path") from e


def read_parts(path: str) -> list[dict]:
    """Every row of a Parquet output directory, part by part (schemas unified)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(part) for _, part in _parts(path)]
    if not tables:
        return []
    return pa.concat_tables(tables, promote_options="permissive").to_pylist()

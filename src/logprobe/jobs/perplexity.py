"""Perplexity rows: one text per row -> its perplexity; ``aggregate`` pools the rows.

Each row is one token stream windowed on its own (``Scorer.perplexity_job`` with one text), so
the rows together are ``Scorer.perplexity(texts)``: ``aggregate`` recomputes the corpus numbers
from the rows' columns (``nll_sum``, ``num_tokens``, ``nll_mean``, ``nll_stderr``, words and
bytes) without the per-token values, so a resumed run that read half its rows back from the
output gives the same aggregate:

    mean = fsum(nll_sum) / N          M2 = sum_i (n_i - 1) n_i stderr_i^2 + n_i (mean_i - mean)^2
    stderr = sqrt(M2 / (N - 1) / N)   (the pooled sample variance: equal to the flat formula)

>>> rows = [{"nll_sum": 4.0, "num_tokens": 2, "nll_mean": 2.0, "nll_stderr": 1.0, "num_windows": 1, "num_words": 1,
...          "num_bytes": 4}]
>>> round(aggregate(rows)["perplexity"], 4), aggregate(rows)["num_rows"]
(7.3891, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import LogprobeError
from ..io.tables import Row
from ..scoring.options import Windows
from ..scoring.perplexity import perplexity_job
from ..scoring.stats import exp_or_inf
from ..scoring.work import Job, ScoringContext
from . import fields
from .base import RowWork, row_head

RESULT_COLUMNS = ("perplexity", "perplexity_stderr", "nll_mean", "nll_stderr", "nll_sum", "num_tokens",
                  "num_windows", "word_perplexity", "byte_perplexity", "bits_per_byte", "num_words", "num_bytes")


@dataclass(slots=True)
class PerplexityRows:
    text_field: str = "text"
    windows: Windows = Windows()
    keep: tuple[str, ...] = ()
    float32_columns = frozenset()

    def head(self, row: Row) -> dict:
        return row_head(row, self.keep)

    def result_types(self, names=()) -> dict[str, str]:
        """The result columns of every output row (null in a failed row), as ``io.parquet.arrow_type`` tags."""
        return {k: "int64" if k.startswith("num_") else "float64" for k in RESULT_COLUMNS}

    def work(self, row: Row, context: ScoringContext) -> RowWork:
        text = fields.text(row.data.get(self.text_field), self.text_field)
        try:
            job = perplexity_job(context, text, self.windows, return_token_nlls=True)
        except LogprobeError as e:  # "texts[0]: is empty" -> "text: is empty"
            field = self.text_field if e.field.startswith("texts") else e.field
            raise LogprobeError(field, e.problem, e.fix) from None

        def finish(results) -> dict:
            res = job.finish(results)
            out = {k: getattr(res, k) for k in RESULT_COLUMNS if k != "nll_sum"}
            out["nll_sum"] = math.fsum(res.token_nlls[0])
            return out

        return RowWork(row.index, self.head(row), Job(job.requests, finish))


def aggregate(rows: list[dict]) -> dict:
    """Corpus perplexity of the rows without an error (see the module docstring)."""
    good = [r for r in rows if r.get("error") is None]
    n = sum(r["num_tokens"] for r in good)
    out = {"num_rows": len(good), "failed_rows": len(rows) - len(good), "num_tokens": n}
    if n == 0:
        return out
    total = math.fsum(r["nll_sum"] for r in good)
    mean = total / n
    m2 = math.fsum((r["num_tokens"] - 1) * r["num_tokens"] * r["nll_stderr"] ** 2
                   + r["num_tokens"] * (r["nll_mean"] - mean) ** 2 for r in good)
    se = math.sqrt(m2 / (n - 1) / n) if n > 1 else math.nan
    out.update(perplexity=exp_or_inf(mean), perplexity_stderr=exp_or_inf(mean) * se, nll_mean=mean, nll_stderr=se,
               num_windows=sum(r["num_windows"] for r in good))
    if all(r.get("num_words") is not None for r in good):
        words, nbytes = sum(r["num_words"] for r in good), sum(r["num_bytes"] for r in good)
        out.update(word_perplexity=exp_or_inf(total / words), byte_perplexity=exp_or_inf(total / nbytes),
                   bits_per_byte=total / nbytes / math.log(2), num_words=words, num_bytes=nbytes)
    return out

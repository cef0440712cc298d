"""The three jobs as data: an input row -> engine requests -> an output row (``base.RowWork``).

``ScoreRows`` (prompt + continuations), ``PerplexityRows`` (a text per row; ``aggregate`` pools
them) and ``LogprobsRows`` (RL token ids) map rows; ``run_rows`` drives any of them over a row
source into a sink (``io.tables``), ``map_rows`` over a list of rows in memory (output rows in
input order); ``row_job`` makes one by name from flat options. The CLI and Ray Data (``logprobe.ray``) use them; the server can reuse the same mapping.
"""

from .base import ListSink, RowWork, RunCounts, map_rows, run_rows
from .logprobs import LogprobsRows
from .named import JOBS, row_job
from .perplexity import PerplexityRows, aggregate
from .score import ScoreRows, join_continuation

__all__ = ["JOBS", "ListSink", "LogprobsRows", "PerplexityRows", "RowWork", "RunCounts", "ScoreRows", "aggregate",
           "join_continuation", "map_rows", "row_job", "run_rows"]

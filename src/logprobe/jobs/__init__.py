"""The three jobs as data: an input row -> engine requests -> an output row (``base.RowWork``).

``ScoreRows`` (prompt + continuations), ``PerplexityRows`` (a text per row; ``aggregate`` pools
them) and ``LogprobsRows`` (RL token ids) map rows; ``run_rows`` drives any of them over a row
source into a sink (``io.tables``), ``map_rows`` over a list of rows in memory (output rows in
input order). The CLI and Ray Data (``logprobe.ray``) use them; the server can reuse the same mapping.
"""

from .base import ListSink, RowWork, RunCounts, map_rows, run_rows
from .logprobs import LogprobsRows
from .perplexity import PerplexityRows, aggregate
from .score import ScoreRows, join_continuation

__all__ = ["ListSink", "LogprobsRows", "PerplexityRows", "RowWork", "RunCounts", "ScoreRows", "aggregate",
           "join_continuation", "map_rows", "run_rows"]

"""Self-contained HTML pages of results (no model here: pages take numbers, not scorers).

``tokens`` holds the page's data (one ``Token`` per displayed token) and the pure functions that
build it from scorer results; ``html`` renders it: text coloured by surprisal or by KL(R || Q),
a tooltip per token (log-prob, rank, top alternatives), a KL histogram. No network, inline CSS/JS.
"""

from .html import kl_page, surprisal_page
from .tokens import Segment, Token, locate_targets

__all__ = ["Segment", "Token", "kl_page", "locate_targets", "surprisal_page"]

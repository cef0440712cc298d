"""What crosses the boundary: text coming in (``text.check_text``) and JSON going out (``jsonsafe``)."""

from .jsonsafe import dumps, encode, json_safe
from .text import check_text, text_problem

__all__ = ["check_text", "dumps", "encode", "json_safe", "text_problem"]

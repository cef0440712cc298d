"""Every string is checked before a tokenizer sees it.

A Python ``str`` may hold a lone surrogate (U+D800..U+DFFF) — ``json.loads('"\\ud800"')`` gives
one — which is not a Unicode scalar value: it has no UTF-8 encoding, and Rust tokenizers refuse it
with an opaque ``TypeError``. ``check_text`` turns that into a ``LogprobeError`` naming the field.
"""

from __future__ import annotations

from ..errors import LogprobeError

FIX = "send UTF-8 text"


def text_problem(value: str) -> str | None:
    """What is wrong with ``value`` as text, or None. Fast: one UTF-8 encode (C) in the common case."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"contains a lone surrogate (\\u{ord(value[e.start]):04x}) at character {e.start}, "
                "which is not valid Unicode")
    return None


def check_text(value: str, field: str) -> str:
    """``value`` unchanged, or ``LogprobeError(field, "contains a lone surrogate ...", "send UTF-8 text")``."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            raise LogprobeError(field, problem, FIX)
    return value

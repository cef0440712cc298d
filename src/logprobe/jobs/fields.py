"""Reading one field of an input row, whatever file it came from.

CSV cells are strings, so a list field may arrive as JSON text (``"[1, 2]"``) and a number as
``"0.5"``; JSONL and Parquet give the values themselves. Each function returns the value or raises
``LogprobeError(name, ...)``; an empty CSV cell counts as missing.

>>> id_list("[1, 2]", "prompt_token_ids"), number("0.5", "temperature", float), flag("true", "entropy")
([1, 2], 0.5, True)
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import LogprobeError


def missing(value: Any) -> bool:
    return value is None or value == ""


def _json_text(value: str, name: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise LogprobeError(name, f"is not a JSON list ({e.msg} at column {e.colno})",
                            'write it as JSON, e.g. [1, 2, 3] or ["a", "b"]') from e


def id_list(value: Any, name: str) -> list:
    """A list of token ids (checked against the vocabulary later, by the scorer)."""
    if isinstance(value, str):
        value = _json_text(value, name)
    if not isinstance(value, (list, tuple)):
        raise LogprobeError(name, f"must be a list of token ids, got {type(value).__name__}")
    return list(value)


def text(value: Any, name: str) -> str:
    if missing(value) and value != "":
        raise LogprobeError(name, "is missing", f"give a {name} column")
    if not isinstance(value, str):
        raise LogprobeError(name, f"must be text, got {type(value).__name__}")
    return value


def text_list(value: Any, name: str) -> list[str]:
    """A list of strings (in CSV: a JSON list)."""
    if isinstance(value, str):
        value = _json_text(value, name)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise LogprobeError(name, "must be a list of strings")
    return list(value)


def number(value: Any, name: str, kind: type) -> Any:
    """An int or float (CSV text parsed); bools are refused."""
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError as e:
            raise LogprobeError(name, f"must be a number, got {value!r}") from e
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LogprobeError(name, f"must be a number, got {value!r}")
    return value


def flag(value: Any, name: str) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise LogprobeError(name, f"must be true or false, got {value!r}")
    return value


def json_value(value: Any, name: str) -> Any:
    """A JSON structure (steer/capture lists): CSV text parsed, others as given."""
    return _json_text(value, name) if isinstance(value, str) else value

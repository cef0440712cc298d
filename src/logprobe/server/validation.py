"""A pydantic validation failure as one message naming the field: ``field: problem; fix``.

    {"sampling_params": {"temprature": 0}}  ->  400 "sampling_params.temprature: is not a known field;
                                                 accepted fields: max_new_tokens, temperature, ..."

A body the JSON parser cannot read says where (``parse_failure``, ``validation_message``):

    b'{"prompt": "caf\\xe9"}'  ->  "body: is not valid UTF-8 at byte 15 (line 1, column 16: invalid
                                    continuation byte 0xe9); send the JSON text encoded as UTF-8"
    b'[' * 10000 + b']' * 10000 -> "body: is nested deeper than the JSON parser reads (about 1,000 levels
                                    of arrays and objects; this body reaches 10,000 at byte 9,999); ..."
"""

from __future__ import annotations

import re
import sys
import typing

from pydantic import BaseModel

from ..io.text import text_problem
from ..scoring.inputs import MEDIA_FIELDS, MEDIA_PROBLEM

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-plain", "function-after"}


def _branch(part) -> bool:
    """A union-branch tag pydantic puts in ``loc`` ('function-after[...]', 'list[...]', 'float', a
    model's class name: 'SamplingParams'), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or bool(re.fullmatch(r"[a-z-]+\[.*\]", part, re.S))
                                      or (part[:1].isupper() and part in _model_names()))


def _model_names(cls: type = BaseModel) -> set[str]:
    """The class names of the pydantic models defined so far."""
    out: set[str] = set()
    for sub in cls.__subclasses__():
        out |= {sub.__name__} | _model_names(sub)
    return out


def _name(part: str) -> str:
    """A field name as text that is safe to echo (a lone surrogate is written as ``\\ud800``)."""
    return part if text_problem(part) is None else part.encode("utf-8", "backslashreplace").decode("utf-8")


def _loc(loc: tuple) -> str:
    """('body', 'prompt', 0, 3) -> 'prompt[0][3]'; union-branch tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if _branch(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{_name(str(part))}" if out else _name(str(part)))
    return out or "body"


def _pick(errors: list[dict]) -> tuple[dict, list[dict]]:
    """The error to report and the others. Among the failed branches of one union field, the
    explicit ``value_error`` (e.g. a lone surrogate in the string branch) says the most."""
    e = errors[0]
    loc = tuple(e.get("loc", ()))
    cut = next((i for i, p in enumerate(loc) if _branch(p)), None)
    if cut is None:
        return e, errors[1:]
    field = loc[:cut]
    same = [x for x in errors if tuple(x.get("loc", ()))[:cut] == field and len(x.get("loc", ())) > cut
            and _branch(x["loc"][cut])]
    best = next((x for x in same if x.get("type") == "value_error"), e)
    return best, [x for x in errors if x not in same]


def _model_at(model: type | None, loc: tuple) -> type | None:
    """The body model (or the nested one, e.g. ``sampling_params``) at ``loc`` ('body', field, ...)."""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if model is None or not isinstance(part, str) or _branch(part):
            continue
        field = model.model_fields.get(part)
        model = _nested_model(field.annotation) if field is not None else None
    return model


def _nested_model(annotation) -> type | None:
    """The pydantic model inside an annotation (``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _nested_model(a)) is not None), None)


def _line_column(text: str | bytes, offset: int) -> tuple[int, int]:
    """1-based line and column of ``offset`` in ``text`` (bytes: the column counts bytes).

    >>> _line_column('{"a":\\n  x}', 8), _line_column(b"ab", 1)
    ((2, 3), (1, 2))
    """
    newline = "\n" if isinstance(text, str) else b"\n"
    return text.count(newline, 0, offset) + 1, offset - (text.rfind(newline, 0, offset) + 1) + 1


def _nesting(body: bytes) -> tuple[int, int]:
    """(the deepest nesting of arrays and objects in a JSON body, the byte offset of the bracket
    that first reaches it); brackets inside strings do not count.

    >>> _nesting(b'{"a": [[1], "[[["]}')
    (3, 7)
    """
    import numpy as np

    plain = re.sub(rb'"(?:[^"\\]|\\.)*"', lambda m: b"_" * len(m.group(0)), body)
    a = np.frombuffer(plain, dtype=np.uint8)
    depth = np.cumsum((a == ord("[")) | (a == ord("{")), dtype=np.int64) - \
        np.cumsum((a == ord("]")) | (a == ord("}")), dtype=np.int64)
    if not len(depth):
        return 0, 0
    at = int(np.argmax(depth))
    return int(depth[at]), at


def parse_failure(cause: BaseException | None, body: bytes | None) -> str:
    """What FastAPI only calls "There was an error parsing the body" (its JSON parser raised
    something other than a syntax error), as ``body: problem; fix``: bytes that are not UTF-8
    (where), nesting deeper than the parser's recursion (how deep, where), else the error."""
    if isinstance(cause, UnicodeDecodeError):
        line, col = _line_column(cause.object, cause.start)
        byte = cause.object[cause.start:cause.start + 1].hex()
        return (f"body: is not valid {cause.encoding.upper()} at byte {cause.start} (line {line}, column {col}: "
                f"{cause.reason} 0x{byte}); send the JSON text encoded as UTF-8")
    if isinstance(cause, RecursionError):
        where = ""
        if body is not None:
            depth, at = _nesting(body)
            where = f"; this body reaches {depth:,} at byte {at:,}"
        return (f"body: is nested deeper than the JSON parser reads (about {sys.getrecursionlimit():,} levels of "
                f"arrays and objects{where}); send the fields as documented (none nests more than a few levels)")
    what = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return f"body: could not be read as JSON{what}; send a JSON object encoded as UTF-8"


def validation_message(errors: list[dict], model: type | None = None, doc: str | None = None) -> tuple[str, str]:
    """The first problem, stated as ``field: problem; fix`` (plus a count of any others). ``doc``:
    the body's text, for the line and column of a JSON syntax error."""
    # a misspelt field shows up as "unknown" and "missing": the unknown one explains both
    errors = sorted(errors, key=lambda x: x.get("type") != "extra_forbidden")
    e, others = _pick(errors)
    loc = tuple(e.get("loc", ()))
    key = "[key]" in loc  # a dict key is wrong: name the dict
    if key:
        loc = loc[:loc.index("[key]") - 1]
    field = _loc(loc)
    kind = e.get("type", "")
    if kind == "json_invalid":
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        where = ""
        if pos is not None and isinstance(doc, str):
            line, col = _line_column(doc, pos)
            where = f" at line {line}, column {col} (character {pos})"
        field, msg = "body", f"is not valid JSON{where}: {e.get('ctx', {}).get('error', e.get('msg'))}; send a JSON object"
    elif kind == "extra_forbidden" and loc and loc[-1] in MEDIA_FIELDS:
        msg = f"{MEDIA_PROBLEM}; send the text alone"  # named for what it is, not as an unknown field
    elif kind == "extra_forbidden":
        inner = _model_at(model, loc[:-1])
        known = ", ".join(inner.model_fields) if inner is not None else ""
        msg = f"is not a known field; accepted fields: {known}" if known else "is not a known field"
    elif kind == "missing":
        msg = "is required"
    elif kind in ("model_attributes_type", "model_type"):
        msg = "must be a JSON object"
    elif kind == "string_unicode":  # a string pydantic cannot read (e.g. a field name with a lone surrogate)
        value = e.get("input")
        problem = (text_problem(value) if isinstance(value, str) else None) or "is not valid Unicode"
        msg = f"{'a field name ' if field == 'body' else ''}{problem}; send UTF-8 text"
    else:
        msg = e.get("msg", "is invalid").removeprefix("Value error, ")
        msg = msg[0].lower() + msg[1:] if msg else msg
        if (m := re.match(r"((?:\[\d+\])+) (.*)", msg, re.S)):  # "[1][2] must be ..." from a list validator
            field, msg = field + m.group(1), m.group(2)
        if key:
            msg = "a key " + msg
    more = f" (and {len(others)} more problem{'s' * (len(others) > 1)})" if others else ""
    return field, f"{field}: {msg}{more}"

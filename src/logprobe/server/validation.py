"""A pydantic validation failure as one message naming the field: ``field: problem; fix``.

    {"sampling_params": {"temprature": 0}}  ->  400 "sampling_params.temprature: is not a known field;
                                                 accepted fields: max_new_tokens, temperature, ..."
"""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel

from ..io.text import text_problem

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


def validation_message(errors: list[dict], model: type | None = None) -> tuple[str, str]:
    """The first problem, stated as ``field: problem; fix`` (plus a count of any others)."""
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
        field, msg = "body", f"is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))}); send a JSON object"
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

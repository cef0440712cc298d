"""The one place results become JSON (server replies, the CLI's JSON and JSONL rows).

Rules, so that every reply is valid JSON (RFC 8259 has no NaN or Infinity):

- a non-finite float (nan, inf, -inf) is written as ``null``; the object holding it (directly or
  in a list under one of its keys) gains ``"<key>_reason"``: how many values and which kinds were
  replaced, e.g. ``{"logprobs": [-1.2, null], "logprobs_reason": "1 value not representable in
  JSON (-inf) written as null"}``. A non-finite value with no enclosing key (a bare list) just
  becomes ``null``. Inputs that would give such numbers are refused up front where possible (a
  perplexity needs at least two scored tokens), so this is the safety net, not the rule.
- the encoding never emits NaN/Infinity (``allow_nan=False``): a regression fails loudly.
- strings are written as UTF-8; a string that has no UTF-8 form (a lone surrogate, which input
  validation refuses, so only a bug could bring one here) makes the whole document ASCII-escaped
  (``\\ud800``) instead of failing.

The common case costs one C-speed ``json.dumps``: the tree is walked only when that fails.
"""

from __future__ import annotations

import json
import math
from typing import Any

_COMPACT = (",", ":")


def _kind(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _clean(obj: Any, found: list[str]) -> Any:
    """A copy of ``obj`` with non-finite floats replaced by None; their kinds are appended to ``found``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        found.append(_kind(obj))
        return None
    if isinstance(obj, dict):
        out = {}
        reasons = {}
        for k, v in obj.items():
            inner: list[str] = []
            out[k] = _clean(v, inner)
            if inner:
                n = len(inner)
                kinds = ", ".join(sorted(set(inner), key=inner.index))
                reasons[f"{k}_reason"] = (f"{n} value{'s' * (n != 1)} not representable in JSON ({kinds}) "
                                          "written as null")
        for k, r in reasons.items():
            if k not in out:
                out[k] = r
        return out
    if isinstance(obj, (list, tuple)):
        return [_clean(v, found) for v in obj]
    return obj


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (and ``<key>_reason`` fields added)."""
    return _clean(obj, [])


def dumps(obj: Any, *, compact: bool = True) -> str:
    """JSON text of ``obj`` under the rules above; always encodable as UTF-8."""
    seps = _COMPACT if compact else None
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=seps)
    except ValueError:  # a non-finite float somewhere: walk and replace
        text = json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False, separators=seps)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(json_safe(obj), ensure_ascii=True, allow_nan=False, separators=seps)
    return text


def encode(obj: Any) -> bytes:
    """``dumps(obj)`` as UTF-8 bytes (an HTTP reply body)."""
    return dumps(obj).encode("utf-8")

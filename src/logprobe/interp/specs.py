"""Per-request ``capture`` and ``steer`` entries: validation and resolution to token positions.

A request is a token list ``t[0..n)`` whose first ``p`` tokens are the prompt (context) and the
rest the continuation (completion). A hook point's row ``k`` is the state after reading ``t[k]``:

    tokens    : [The] [capital] [of] [France] [is] | [ĠParis]
    index     :   0       1      2      3      4   |    5          n = 6, p = 5
    all = 0..5   prompt = 0..4   continuation = 5   last = 5   last_prompt = 4
    last_prompt is the row that predicts the first continuation token (row 4 -> ĠParis).
    [a, b]: indices a..b-1 (negative counts from the end, b = null: to the end), e.g. [-2, null] = 4, 5.
    k: index k alone.

Steering row ``k`` changes the log-probs of tokens after ``k`` only (the row of ``k`` predicts
``t[k+1]``): steering ``[p, n)`` leaves every log-prob of tokens ``<= p`` bitwise unchanged.
Capturing the last token's row makes the engine feed that token too (it is otherwise only a target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.request import CaptureAt, SteerAt
from ..errors import LogprobeError
from .points import resolve_points
from .vectors import ANY, _key, is_zero, load_vectors

REDUCES = ("none", "mean", "sum", "last", "project")
OPS = ("add", "add_signed", "project_out")
NAMED_POSITIONS = ("all", "prompt", "continuation", "last", "last_prompt")
_CAPTURE_KEYS = {"at", "positions", "reduce", "vector"}
_STEER_KEYS = {"at", "vector", "coeff", "positions", "op"}


@dataclass(frozen=True, slots=True)
class CaptureSpec:
    points: tuple[str, ...]
    positions: object  # a name of NAMED_POSITIONS, an int, or (start, end | None)
    reduce: str
    vectors: dict[str, torch.Tensor] | None = None  # project: per point (or "*")


@dataclass(frozen=True, slots=True)
class SteerSpec:
    entries: tuple[tuple[str, torch.Tensor, float], ...]  # (point, vector [H], coeff); no-op ones dropped
    positions: object
    op: str


@dataclass(slots=True)
class Capture:
    """One captured point of one request: ``value`` is [n, H] (none), [H] (mean, sum, last) or [n]
    (project), float32; ``positions`` are the token indices read."""

    at: str
    positions: list[int]
    reduce: str
    value: torch.Tensor

    def to_dict(self) -> dict:
        return {"at": self.at, "positions": self.positions, "reduce": self.reduce, "value": self.value.tolist()}


def check_positions(value, field: str):
    if isinstance(value, str):
        if value not in NAMED_POSITIONS:
            raise LogprobeError(field, f"unknown positions {value!r}",
                                f"use one of {', '.join(NAMED_POSITIONS)}, an index, or [start, end]")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], int) \
            and not isinstance(value[0], bool) and (value[1] is None or isinstance(value[1], int)
                                                    and not isinstance(value[1], bool)):
        return (value[0], value[1])
    raise LogprobeError(field, f"must be one of {', '.join(NAMED_POSITIONS)}, an index, or [start, end], "
                        f"got {value!r}")


def resolve_positions(positions, n: int, p: int, field: str, need_prompt: bool = True) -> tuple[int, ...]:
    """Token indices (ascending) that ``positions`` names in a request of ``n`` tokens, ``p`` of prompt.

    >>> resolve_positions("last_prompt", 6, 5, "positions"), resolve_positions((-2, None), 6, 5, "positions")
    ((4,), (4, 5))
    """
    if positions in ("prompt", "continuation", "last_prompt") and not need_prompt:
        raise LogprobeError(field, f"{positions!r} needs a prompt/continuation split, which perplexity has not",
                            "use all, last, an index or [start, end]")
    if positions == "all":
        return tuple(range(n))
    if positions == "prompt":
        return tuple(range(p))
    if positions == "continuation":
        return tuple(range(p, n))
    if positions == "last":
        return (n - 1,)
    if positions == "last_prompt":
        return (p - 1,)
    if isinstance(positions, int):
        k = positions + n if positions < 0 else positions
        if not 0 <= k < n:
            raise LogprobeError(field, f"index {positions} is outside the request's {n} tokens",
                                f"use -{n}..{n - 1}")
        return (k,)
    a, b = positions
    a2 = a + n if a < 0 else a
    b2 = n if b is None else (b + n if b < 0 else b)
    if not (0 <= a2 <= n and 0 <= b2 <= n):
        raise LogprobeError(field, f"span [{a}, {b}] is outside the request's {n} tokens",
                            f"use indices within -{n}..{n}")
    return tuple(range(a2, b2))


def _items(items, field: str) -> list[dict]:
    if items is None:
        return []
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise LogprobeError(field, "must be a list of objects")
    for i, x in enumerate(items):
        if not isinstance(x, dict):
            raise LogprobeError(f"{field}[{i}]", "must be an object")
    return list(items)


def _unknown(item: dict, allowed: set[str], field: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise LogprobeError(f"{field}.{extra[0]}", "is not a known field", f"use {', '.join(sorted(allowed))}")


def parse_capture(items, num_layers: int, hidden: int, field: str = "capture") -> list[CaptureSpec]:
    specs = []
    for i, item in enumerate(_items(items, field)):
        f = f"{field}[{i}]"
        _unknown(item, _CAPTURE_KEYS, f)
        if "at" not in item:
            raise LogprobeError(f"{f}.at", "is missing", "name a hook point, e.g. blocks.0.resid_post")
        points = tuple(_at(item["at"], num_layers, f"{f}.at"))
        reduce = item.get("reduce", "none")
        if reduce not in REDUCES:
            raise LogprobeError(f"{f}.reduce", f"unknown reduction {reduce!r}", f"use one of {', '.join(REDUCES)}")
        vectors = None
        if reduce == "project":
            if item.get("vector") is None:
                raise LogprobeError(f"{f}.vector", "is missing", "reduce 'project' needs a vector to project onto")
            vectors = load_vectors(item["vector"], hidden, num_layers, f"{f}.vector")
            for pt in points:
                if pt not in vectors and ANY not in vectors:
                    raise LogprobeError(f"{f}.vector", f"has no vector for {pt}")
        elif item.get("vector") is not None:
            raise LogprobeError(f"{f}.vector", "is only used with reduce 'project'")
        specs.append(CaptureSpec(points, check_positions(item.get("positions", "all"), f"{f}.positions"), reduce,
                                 vectors))
    return specs


def parse_steer(items, num_layers: int, hidden: int, field: str = "steer") -> list[SteerSpec]:
    specs = []
    for i, item in enumerate(_items(items, field)):
        f = f"{field}[{i}]"
        _unknown(item, _STEER_KEYS, f)
        if item.get("vector") is None:
            raise LogprobeError(f"{f}.vector", "is missing", "give a vector, {layer: vector}, or a file path")
        vectors = load_vectors(item["vector"], hidden, num_layers, f"{f}.vector")
        if "at" in item:
            points = _at(item["at"], num_layers, f"{f}.at")
        elif ANY in vectors:
            raise LogprobeError(f"{f}.at", "is missing", "name the hook point(s) the vector is added at")
        else:
            points = sorted(vectors, key=lambda pt: (int(pt.split(".")[1]), pt))
        op = item.get("op", "add")
        if op not in OPS:
            raise LogprobeError(f"{f}.op", f"unknown op {op!r}", f"use one of {', '.join(OPS)}")
        coeffs = _coeffs(item.get("coeff", 1.0), points, num_layers, f"{f}.coeff")
        entries = []
        for pt in points:
            v = vectors.get(pt, vectors.get(ANY))
            c = coeffs.get(pt, 0.0)
            if v is None or c == 0.0 or is_zero(v):
                continue  # no-op: leaves the forward bitwise as without it
            entries.append((pt, v, c))
        specs.append(SteerSpec(tuple(entries), check_positions(item.get("positions", "all"), f"{f}.positions"), op))
    return specs


def _at(value, num_layers: int, field: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise LogprobeError(field, "must be a hook-point name or a list of them")
    out: list[str] = []
    for n in names:
        try:
            pts = resolve_points(n, num_layers)
        except LogprobeError as e:
            raise LogprobeError(field, e.problem, e.fix) from None
        out.extend(p for p in pts if p not in out)
    return out


def _coeffs(value, points: list[str], num_layers: int, field: str) -> dict[str, float]:
    if isinstance(value, dict):
        out = {}
        for k, c in value.items():
            pt = _key(k, num_layers, field)
            if pt not in points:
                raise LogprobeError(field, f"key {k!r} ({pt}) is not among the steered points",
                                    "give coefficients for the points of 'at' only")
            out[pt] = _number(c, f"{field}[{k}]")
        return out
    c = _number(value, field)
    return {pt: c for pt in points}


def _number(c, field: str) -> float:
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
        raise LogprobeError(field, f"must be a finite number, got {c!r}")
    return float(c)


def request_hooks(captures: list[CaptureSpec], steers: list[SteerSpec], n: int, p: int, field: str = "",
                  need_prompt: bool = True, offset: int = 0, deterministic: bool = False
                  ) -> tuple[tuple[SteerAt, ...], tuple[CaptureAt, ...]]:
    """Engine-level entries for one request of ``n`` tokens, ``p`` of prompt. ``offset`` shifts
    the resolved indices (a prefix token the user's positions do not count). ``deterministic``
    (the mode): mean/sum read the rows and add them once at the end, in token order,
    so chunking cannot change the order of the additions."""
    steer: list[SteerAt] = []
    for i, s in enumerate(steers):
        pos = resolve_positions(s.positions, n, p, f"{field}steer[{i}].positions", need_prompt)
        if not pos:
            continue  # an empty span steers nothing
        pos = tuple(k + offset for k in pos)
        steer.extend(SteerAt(pt, pos, s.op, v, c) for pt, v, c in s.entries)
    capture: list[CaptureAt] = []
    for i, c in enumerate(captures):
        pos = resolve_positions(c.positions, n, p, f"{field}capture[{i}].positions", need_prompt)
        if not pos:
            raise LogprobeError(f"{field}capture[{i}].positions", "selects no token", "give a non-empty span")
        if c.reduce == "last":
            pos = pos[-1:]
        pos = tuple(k + offset for k in pos)
        kind = {"none": "rows", "last": "rows", "mean": "sum", "sum": "sum", "project": "project"}[c.reduce]
        if deterministic and kind == "sum":
            kind = "rows"
        for pt in c.points:
            vec = None if c.vectors is None else c.vectors.get(pt, c.vectors.get(ANY))
            capture.append(CaptureAt(pt, pos, kind, vec))
    return tuple(steer), tuple(capture)


def capture_results(specs: list[CaptureSpec], resolved: tuple[CaptureAt, ...], values: list[torch.Tensor] | None,
                    offset: int = 0) -> list[Capture]:
    """Engine outputs (one per CaptureAt, in order) -> ``Capture`` per spec and point."""
    out: list[Capture] = []
    k = 0
    for spec in specs:
        for pt in spec.points:
            c, v = resolved[k], values[k]
            n = len(c.positions)
            if spec.reduce in ("mean", "sum") and c.kind == "rows":
                v = v.sum(0)
            if spec.reduce == "mean":
                v = v / n
            elif spec.reduce == "last":
                v = v[0]
            out.append(Capture(pt, [x - offset for x in c.positions], spec.reduce, v))
            k += 1
    return out

"""Steering and capture for one packed batch, as tensors the model applies at named points.

Nothing here is a Python callback: the engine resolves every request's ``steer`` and ``capture``
against the packed rows (see ``engine.runner.pack``) into tables, and each model calls
``hooks(point, h)`` at its hook points (names in ``interp.points``). With ``hooks=None`` the
model runs exactly as without this module.

Steering at a point, for rows ``r`` with vector ``v = table[index]`` and coefficient ``c``
(computed in float32, added in the stream's dtype):

    add          h[r] += c * v
    add_signed   h[r] += c * sign(<h[r], v>) * v          (pushes a row further to its own side)
    project_out  h[r] -= c * <h[r], v^> v^                 (v^ = v / |v|; c = 1 removes the direction)

Ops at one point run in that table order: all ``project_out`` tables first, then ``add_signed``,
then ``add``; rows of one table read the same ``h``. Captures read ``h`` after the steering at
the same point.

Capture kinds (outputs float32, no padding: only the listed rows are touched):

    rows     h[r]                               -> [N, H]
    sum      h[r] added per segment id g[r]     -> [G, H]   in row order (mean = sum / count, by the caller)
    project  <h[r], table[index]>                -> [N]

Routing (mixture-of-experts layers, ``RouteTable``): at each router point the MoE block hands its
chosen expert ids [T, k] to ``Hooks.routing``, which first forces the listed rows' ids
(``force_rows`` get ``force_ids[:, layer]``; the block then re-weighs every row from its own router
probabilities, as it weighs its own choice) and then reads the ids of ``rows`` (``out[point]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STEER_OPS = ("project_out", "add_signed", "add")  # application order at one point
CAPTURE_KINDS = ("rows", "sum", "project")


@dataclass(slots=True)
class SteerTable:
    op: str
    rows: torch.Tensor  # [N] packed rows
    table: torch.Tensor  # [K, H] float32 vectors
    index: torch.Tensor  # [N] which vector each row gets
    coeff: torch.Tensor  # [N] float32


@dataclass(slots=True)
class CaptureTable:
    kind: str
    rows: torch.Tensor  # [N]
    groups: torch.Tensor | None = None  # [N] segment id of each row (sum)
    num_groups: int = 0
    table: torch.Tensor | None = None  # [K, H] (project)
    index: torch.Tensor | None = None  # [N] (project)
    out: torch.Tensor | None = None  # filled by the forward pass


@dataclass(slots=True)
class RouteTable:
    """Routed experts of one forward pass, for every MoE layer (``layers``: router point -> its
    index among the model's MoE layers). ``rows`` [N]: rows whose expert ids are read, into
    ``out[point]`` [N, k]; ``force_rows`` [M] take ``force_ids[:, layer]`` [M, k] instead of
    their router's choice."""

    layers: dict[str, int]
    rows: torch.Tensor | None = None
    force_rows: torch.Tensor | None = None
    force_ids: torch.Tensor | None = None  # [M, moe_layers, k] int64
    out: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class Hooks:
    """Per-point steering and capture tables of one forward pass."""

    steer: dict[str, list[SteerTable]] = field(default_factory=dict)
    capture: dict[str, list[CaptureTable]] = field(default_factory=dict)
    route: RouteTable | None = None

    def routing(self, point: str, ids: torch.Tensor, reweigh) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A MoE block's expert ids [T, k] at router ``point``: (weights, ids) when rows are forced
        here (``reweigh(ids)`` -> weights [T, k] from the block's own probabilities), else None;
        the ids used are read for the rows asked."""
        r = self.route
        if r is None or point not in r.layers:
            return None
        out = None
        if r.force_rows is not None and len(r.force_rows):
            ids = ids.clone()
            ids[r.force_rows] = r.force_ids[:, r.layers[point]].to(ids.dtype)
            out = reweigh(ids), ids
        if r.rows is not None:
            r.out[point] = ids[r.rows]
        return out

    def __call__(self, point: str, h: torch.Tensor) -> torch.Tensor:
        tables = self.steer.get(point)
        if tables:
            h = _steer(h, tables)
        for c in self.capture.get(point, ()):
            c.out = _capture(h, c)
        return h

    def __bool__(self) -> bool:
        return bool(self.steer or self.capture or self.route is not None)


def _steer(h: torch.Tensor, tables: list[SteerTable]) -> torch.Tensor:
    for op in STEER_OPS:
        group = [t for t in tables if t.op == op]
        if not group:
            continue
        delta_rows, deltas = [], []
        for t in group:
            v = t.table[t.index]  # [N, H] float32
            if op == "add":
                d = t.coeff[:, None] * v
            else:
                x = h[t.rows].float()  # [N, H]
                if op == "add_signed":
                    d = (t.coeff * torch.sign((x * v).sum(-1)))[:, None] * v
                else:
                    u = v / v.norm(dim=-1, keepdim=True)
                    d = -(t.coeff * (x * u).sum(-1))[:, None] * u
            delta_rows.append(t.rows)
            deltas.append(d)
        h = add_rows(h.clone(), torch.cat(delta_rows), torch.cat(deltas).to(h.dtype))
    return h


def add_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] += src[i] in place, each destination row's additions in one fixed order:
    row order. On CPU ``index_add_`` runs serially (an accumulating ``index_put_`` does not); on
    CUDA an accumulating ``index_put_`` sorts the rows by destination, stably, then adds each
    destination's in one pass: the CPU's bits on the same rows (CUDA's ``index_add_`` adds by
    atomics, in whatever order they land; ``tests/test_interp.py`` checks both on a GPU).

    >>> add_rows(torch.zeros(2, 1), torch.tensor([1, 0, 1]), torch.tensor([[1.0], [2.0], [3.0]])).tolist()
    [[2.0], [4.0]]
    """
    if dst.is_cuda:
        return dst.index_put_((index,), src, accumulate=True)
    return dst.index_add_(0, index, src)


def _capture(h: torch.Tensor, c: CaptureTable) -> torch.Tensor:
    x = h[c.rows].float()  # [N, H]
    if c.kind == "rows":
        return x
    if c.kind == "sum":
        return add_rows(x.new_zeros(c.num_groups, x.shape[1]), c.groups, x)  # [G, H]
    return (x * c.table[c.index]).sum(-1)  # [N]

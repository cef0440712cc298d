"""Weights pushed by a trainer over a collective (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed`` protocol): no checkpoint on disk.

    trainer (rank 0)                              this scorer (rank ``rank_offset``)
    POST /init_weights_update_group  ---------->  join: TCPStore client of the trainer's store
    init_custom_process_group(rank 0) <-------->  the same group (gloo or nccl), ``group_name``
    POST /update_weights_from_distributed ----->  for each (name, dtype, shape): an empty buffer
    broadcast(tensor, src=0) per tensor  ------->   filled by broadcast from rank 0
                                                  then all of them through ``update_weights``

The group is built as SGLang, vLLM and OpenRLHF build theirs (``init_custom_process_group``):
``rendezvous("tcp://addr:port")`` (the trainer, rank 0, hosts the store), a ``PrefixStore`` of
the group name, then ``_new_process_group_helper``; no default process group is needed on either
side, and the trainer may use any of those projects' helpers: the store keys are the same.

Every tensor is received before any weight changes, so a name or shape the model does not have,
or a NaN, is refused by the update (all or nothing) after the trainer's broadcasts completed: the
group stays usable. Metadata that cannot be received at all (lengths that differ, an unknown
dtype, a negative dimension) is refused before the first broadcast.

Trainers send the weights in buckets (several requests, down to one tensor each, as OpenRLHF and
verl do): the received tensors are held (``WeightGroup.held``) until they cover every weight of
the model, then applied together, so no score is ever computed on a model half old, half new. A
bucket naming a weight the model does not have is applied at once (the update refuses it, naming
it, and the held tensors are dropped), as is one repeating a name already held.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..errors import LogprobeError
from .update import Incoming, units, weight_slots

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# NCCL's socket transport (what carries the weights when a trainer turns peer-to-peer and shared
# memory off, as torchrl's SGLang scheme does) opens as many sockets as the *receiving* side asks
# for, one by default: ~5 GB/s, 3 s for llama-8b's 16 GB. 4 threads x 4 sockets: ~14 GB/s.
SOCKET_DEFAULTS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
DEFAULT_GROUP = "weight_update_group"
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16, "float64": torch.float64, "double": torch.float64}


def parse_dtype(value, field_name: str) -> torch.dtype:
    """``"bfloat16"``, ``"torch.bfloat16"`` or a ``torch.dtype`` -> the dtype (floats only)."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise LogprobeError(field_name, f"{value} is not a float dtype", f"send one of {sorted(set(_DTYPES))}")
    key = value.removeprefix("torch.") if isinstance(value, str) else None
    if key not in _DTYPES:
        raise LogprobeError(field_name, f"{value!r} is not a float dtype this scorer takes",
                            "send one of 'float32', 'bfloat16', 'float16', 'float64' (or 'torch.bfloat16' ...)")
    return _DTYPES[key]


def check_metadata(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The three lists of ``update_weights_from_distributed`` -> (name, dtype, shape) triples."""
    for key, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)) or not value:
            raise LogprobeError(key, "must be a non-empty list", "one entry per tensor the trainer broadcasts")
    if not len(names) == len(dtypes) == len(shapes):
        raise LogprobeError("shapes", f"names, dtypes and shapes have {len(names)}, {len(dtypes)} and "
                            f"{len(shapes)} entries", "give one of each per tensor")
    out = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise LogprobeError(f"names[{i}]", f"must be a non-empty string, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise LogprobeError(f"shapes[{i}]", f"must be a list of non-negative integers, got {shape!r}")
        out.append((name, parse_dtype(dtype, f"dtypes[{i}]"), tuple(shape)))
    return out


def check_address(master_address, master_port, connect_timeout: float) -> None:
    """Refuse quickly what cannot be the trainer's store: a name that does not resolve, a port out of
    range, nothing listening there within ``connect_timeout`` s (the trainer starts its store as it
    sends the request, so a short wait covers the race)."""
    if not isinstance(master_address, str) or not master_address:
        raise LogprobeError("master_address", f"must be a host name or IP address, got {master_address!r}")
    if not isinstance(master_port, int) or isinstance(master_port, bool) or not 1 <= master_port <= 65535:
        raise LogprobeError("master_port", f"must be a port number (1-65535), got {master_port!r}")
    try:
        ipaddress.ip_address(master_address)
    except ValueError:
        try:
            socket.getaddrinfo(master_address, master_port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise LogprobeError("master_address", f"{master_address!r} does not resolve ({e})",
                                "give the trainer's host name or IP address") from e
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            with socket.create_connection((master_address, master_port), timeout=max(0.1, min(2.0, connect_timeout))):
                return
        except (OSError, UnicodeError) as e:
            if time.monotonic() >= deadline:
                raise LogprobeError("master_port", f"nothing listens on {master_address}:{master_port} ({e})",
                                    "start the trainer's process group (rank 0 hosts the store) as you send "
                                    "this request") from e
            time.sleep(0.1)


def socket_settings(environ, backend: str) -> dict[str, str]:
    """The NCCL socket settings this receiving side adds to its environment before joining.

    Only where the user set neither of the two (their choice stands), and only for ``nccl``:

    >>> socket_settings({}, "nccl")
    {'NCCL_SOCKET_NTHREADS': '4', 'NCCL_NSOCKS_PERTHREAD': '4'}
    >>> socket_settings({"NCCL_NSOCKS_PERTHREAD": "2"}, "nccl"), socket_settings({}, "gloo")
    ({}, {})

    NCCL reads them once per process, when its first socket connection is made (the transport
    is used at all only where peer-to-peer and shared memory are off or impossible); bits are
    unaffected: a broadcast copies bytes.
    """
    if backend != "nccl" or any(k in environ for k in SOCKET_DEFAULTS):
        return {}
    return dict(SOCKET_DEFAULTS)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: float):
    """The process group of ``init_custom_process_group`` (SGLang/vLLM/OpenRLHF), this side's rank."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )
    settings = socket_settings(os.environ, backend)
    if settings:
        os.environ.update(settings)
        log.info("weight group %r: NCCL sockets %s (set NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD to choose)",
                 group_name, " ".join(f"{k}={v}" for k, v in settings.items()))
    t = timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=t))
    store.set_timeout(t)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=t)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def covers(model, named: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether ``named`` holds every weight of ``model`` (then the update can run), or a name the
    model does not have (then the update refuses it: no later bucket could make it right)."""
    try:
        slots = weight_slots(model)
        seen = set()
        for name, t in named:
            for unit, _ in units(Incoming(name, tuple(t.shape), t.dtype, lambda t=t: t), model, "names"):
                if unit is None:
                    continue
                if unit not in slots:
                    return True
                seen.add(unit)
    except LogprobeError:
        return True  # the update says what is wrong
    return seen >= slots.keys()


@dataclass(eq=False)
class WeightGroup:
    """One joined group: its process group, where its tensors are received, and a lock (one
    transfer at a time: two interleaved ones would mix their broadcasts)."""

    name: str
    pg: object
    rank: int
    world_size: int
    backend: str
    device: torch.device
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: list = field(default_factory=list)  # (name, tensor) received, waiting for the rest of the weights
    held_version: str | None = None
    held_lock: threading.Lock = field(default_factory=threading.Lock)

    def receive(self, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
        """Each tensor broadcast by rank 0, in order, into a fresh buffer."""
        import torch.distributed as dist
        out = []
        with self.lock:
            for name, dtype, shape in metadata:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(buf, src=0, group=self.pg)
                out.append((name, buf))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def collect(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None, model,
                field: str = "names") -> tuple[list[tuple[str, torch.Tensor]] | None, str | None]:
        """Hold ``bucket`` with the tensors received before it; -> (every held tensor, the last
        ``weight_version`` given) once they cover ``model``'s weights (or must be refused: an
        unknown or repeated name; the update then names it), else (None, None): wait for more."""
        with self.held_lock:
            names = {n for n, _ in self.held}
            repeated = [n for n, _ in bucket if n in names]
            self.held.extend(bucket)
            if weight_version is not None:
                self.held_version = weight_version
            if not repeated and not covers(model, self.held):
                return None, None
            out, version = self.held, self.held_version
            self.held, self.held_version = [], None
            return out, version

    TEARDOWN_WAIT = 10.0  # seconds ``destroy`` waits for the group's teardown before it returns anyway

    def destroy(self) -> None:
        """Leave the group. NCCL's teardown (``ncclCommFinalize``) waits until every member leaves,
        and SGLang-style trainers leave only after the server's reply (seen on two H200s: the
        reply never came, the trainer waited for it). So the teardown runs in a thread: gloo's
        finishes within the wait, NCCL's when the trainer leaves too; the reply does not wait."""
        import torch.distributed as dist
        with self.lock:
            self.held = []
            t = threading.Thread(target=dist.destroy_process_group, args=(self.pg,), daemon=True,
                                 name="logprobe-weight-group-teardown")
            t.start()
            t.join(self.TEARDOWN_WAIT)


class WeightGroups:
    """A scorer's joined groups by name (``Scorer.init_weights_update_group`` ...)."""

    def __init__(self) -> None:
        self._groups: dict[str, WeightGroup | None] = {}  # None: being joined
        self._lock = threading.Lock()

    def join(self, device: torch.device, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout: float = 600.0,
             connect_timeout: float = 10.0) -> WeightGroup:
        if not isinstance(group_name, str) or not group_name:
            raise LogprobeError("group_name", f"must be a non-empty string, got {group_name!r}")
        if backend not in BACKENDS:
            raise LogprobeError("backend", f"{backend!r} is not supported", "use 'nccl' (CUDA) or 'gloo'")
        if backend == "nccl" and device.type != "cuda":
            raise LogprobeError("backend", f"'nccl' needs the model on a CUDA device; it is on {device.type}",
                                "use backend 'gloo'")
        for key, value in (("world_size", world_size), ("rank_offset", rank_offset)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise LogprobeError(key, f"must be an integer, got {value!r}")
        if world_size < 2:
            raise LogprobeError("world_size", f"is {world_size}", "the trainer (rank 0) and at least this scorer: 2 or more")
        if not 1 <= rank_offset < world_size:
            raise LogprobeError("rank_offset", f"is {rank_offset}; this scorer's rank must be 1 .. world_size - 1 "
                                f"({world_size - 1})", "rank 0 is the trainer")
        with self._lock:
            if group_name in self._groups:
                raise LogprobeError("group_name", f"{group_name!r} is already joined (or being joined)",
                                    "destroy it first (destroy_weights_update_group) or use another name")
            self._groups[group_name] = None
        try:
            check_address(master_address, master_port, connect_timeout)
            try:
                pg = join_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
            except LogprobeError:
                raise
            except Exception as e:  # noqa: BLE001 - the store or the backend refused (timeout, ...)
                raise LogprobeError("master_address", f"could not join {group_name!r} at {master_address}:"
                                    f"{master_port}: {type(e).__name__}: {e}",
                                    "check the address, port, world_size and that every rank joins") from e
            group = WeightGroup(group_name, pg, rank_offset, world_size, backend,
                                device if backend == "nccl" else torch.device("cpu"))
        except BaseException:
            with self._lock:
                self._groups.pop(group_name, None)
            raise
        with self._lock:
            self._groups[group_name] = group
        return group

    def get(self, group_name: str) -> WeightGroup:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise LogprobeError("group_name", f"{group_name!r} is not a joined weight update group",
                                "call init_weights_update_group first")
        return group

    def destroy(self, group_name: str = DEFAULT_GROUP) -> None:
        group = self.get(group_name)
        with self._lock:
            self._groups.pop(group_name, None)
        group.destroy()

    def close(self) -> None:
        for name in [n for n, g in self._groups.items() if g is not None]:
            try:
                self.destroy(name)
            except Exception:  # noqa: BLE001 - closing anyway
                pass

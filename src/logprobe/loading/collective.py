"""Weights pushed by a trainer over a collective (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed`` protocol): no checkpoint on disk.

    trainer (rank 0)                              this scorer (rank ``rank_offset``)
    POST /init_weights_update_group  ---------->  a receiver process is started; it joins as a
    init_custom_process_group(rank 0) <-------->   TCPStore client of the trainer's store: the
                                                   same group (gloo or nccl), ``group_name``
    POST /update_weights_from_distributed ----->  the metadata checked (``check_declared``), one
                                                   buffer in the scorer's memory for the bucket
    broadcast(tensor, src=0) per tensor  ------->  received into it by the receiver process
                                                  then all of them through ``update_weights``

The group is built as SGLang, vLLM and OpenRLHF build theirs (``init_custom_process_group``):
``rendezvous("tcp://addr:port")`` (the trainer, rank 0, hosts the store), a ``PrefixStore`` of
the group name, then ``_new_process_group_helper``; no default process group is needed on either
side, and the trainer may use any of those projects' helpers: the store keys are the same.

A trainer's bug costs the trainer an error, never the scorer. The group lives in a receiver
process (``loading.receiver``), not in this one: a broadcast of another size than declared makes
gloo abort the process it runs in, which cannot be caught there. Before one byte is received,
the metadata is checked against the model by the update's own name mapping (a known name, the
model's shape, each name once across the held buckets, no empty shape, a bound on the bytes): a
refusal names ``names[i]`` or ``shapes[i]``. Every receive is bounded in time
(``receive_timeout``). A refusal, a timeout or the receiver's death leaves the group (the trainer
has broadcast, or is about to, tensors nobody can receive in step): the process is killed, the
held buckets dropped, the old weights stay, and the error says "the group was left: call
init_weights_update_group again"; every later call on that group name is refused so until it is
joined again.

Every tensor is received before any weight changes, so a NaN is refused by the update (all or
nothing) after the trainer's broadcasts completed: the group stays usable.

Trainers send the weights in buckets (several requests, down to one tensor each, as OpenRLHF and
verl do): the received tensors are held (``WeightGroup.held``) until they cover the model
(``covers``), then applied together, so no score is ever computed on a model half old, half new.

The weights transformers holds as buffers (``Family.buffers``: the sigmoid routers'
``mlp.gate.e_score_correction_bias``, Gemma 4's ``layer_scalar``) are not in a trainer's
``named_parameters()``, and ``update_weights`` keeps them when none is sent. Coverage follows that
rule: every parameter, and every buffer once one of them has come in this round. On DeepSeek-V3
(buffers b1, b2):

    [params 1/2] [params 2/2]                 -> applied at the second bucket, b1 and b2 kept
    [b1, b2, params 1/2] [params 2/2]          -> applied at the second bucket, with b1 and b2
    [b1, params 1/2] [params 2/2]              -> held: b2 still to come
    [params 1/2] [params 2/2] [b1, b2]          -> applied at the second bucket, b1 and b2 kept;
                                                   the third is refused (``WeightGroup.collect``)

When the parameters are complete nothing says whether buffers follow: the stream
``P P B | P P B`` (buffers sent after the parameters) is ``P P | B P P | B`` (a trainer that
starts sending buffers first) bucket for bucket. Taken as the second, each bias would be served
one update late, silently. So a bucket of buffers alone (no parameter) that opens a round right
after an update of the group that kept them is refused: received, dropped, a 400 naming it, the
group still joined. A bucket that brings buffers with a parameter opens a round as any other.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reduction a receive buffer is sent by

from ..errors import LogprobeError
from .receiver import ReceiverFault, ReceiverProcess, layout_of, shared_buffer, unlink_buffer, views
from .update import Incoming, buffer_slots, sent_names, tower_slots, units, weight_slots, whole_slots

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# NCCL's socket transport (what carries the weights when a trainer turns peer-to-peer and shared
# memory off, as torchrl's SGLang scheme does) opens as many sockets as the *receiving* side asks
# for, one by default: ~5 GB/s, 3 s for llama-8b's 16 GB. 4 threads x 4 sockets: ~14 GB/s.
SOCKET_DEFAULTS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
DEFAULT_GROUP = "weight_update_group"
MAX_WORLD_SIZE = 1 << 16  # ranks: more than any trainer's group; every rank costs the collective a connection
RECEIVE_TIMEOUT = 300.0  # s one update_weights_from_distributed may take receiving its tensors (default)
STARTUP_WAIT = 120.0  # s a receiver process may take to start (importing torch), on top of the join's timeout
LEFT = "the group was left: call init_weights_update_group again (the old weights stay in force)"
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16, "float64": torch.float64, "double": torch.float64,
           "float8_e4m3fn": torch.float8_e4m3fn}  # FP8 block codes, for a model held FP8 (``update_fp8``)


def parse_dtype(value, field_name: str) -> torch.dtype:
    """``"bfloat16"``, ``"torch.bfloat16"`` or a ``torch.dtype`` -> the dtype (floats only; FP8 codes
    ``float8_e4m3fn`` too, which only a model held as FP8 blocks takes)."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise LogprobeError(field_name, f"{value} is not a float dtype", f"send one of {sorted(set(_DTYPES))}")
    key = value.removeprefix("torch.") if isinstance(value, str) else None
    if key not in _DTYPES:
        raise LogprobeError(field_name, f"{value!r} is not a float dtype this scorer takes",
                            "send one of 'float32', 'bfloat16', 'float16', 'float64', 'float8_e4m3fn' "
                            "(or 'torch.bfloat16' ...)")
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


def covers(model, named: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether ``named`` holds every parameter of ``model`` (its vision tower's aside: taken where
    sent, ``Family.towers``; a tower bucket after the text model's last one would open the next
    round) and, once one of the weights transformers holds as buffers is among them, every one of
    those (then the update can run: ``update_weights`` keeps the buffers when none is sent), or a
    name the model does not have (then the update refuses it: no later bucket could make it right)."""
    return coverage(model, named)[0]


def coverage(model, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, list[str]]:
    """(``covers``, the buffers the update would keep: all of them when none was sent, else [])."""
    try:
        weight_slots(model)
        slots = whole_slots(model)[0]
        seen = set()
        for name, t in named:
            for unit in _units_of(model, name, t):
                if unit not in slots:
                    return True, []
                seen.add(unit)
    except LogprobeError:
        return True, []  # the update says what is wrong
    buffers, towers = set(buffer_slots(model, slots)), set(tower_slots(model, slots))
    if not seen & buffers:
        return seen >= slots.keys() - buffers - towers, sorted(buffers)
    return seen >= slots.keys() - towers, []


def _units_of(model, name: str, t: torch.Tensor) -> list[str]:
    """The slots a received tensor lands in (none: a tensor the model ignores)."""
    return [u for u, _ in units(Incoming(name, tuple(t.shape), t.dtype, lambda t=t: t), model, "names")
            if u is not None]


def late_buffers(model, bucket: list[tuple[str, torch.Tensor]], kept: list[str]) -> LogprobeError | None:
    """The refusal of a bucket of buffers and no parameter that opens a round right after an update
    of its group kept them (``kept``, the module docstring), naming its first buffer; None for any
    other bucket."""
    buffers = set(buffer_slots(model, whole_slots(model)[0]))
    first = None
    for i, (name, t) in enumerate(bucket):
        got = _units_of(model, name, t)
        if any(u not in buffers for u in got):
            return None  # a parameter: a new round
        if got and first is None:
            first = i
    if first is None:
        return None
    shown = ", ".join(sent_names(model, kept[:2])) + (" ..." if len(kept) > 2 else "")
    return LogprobeError(
        f"names[{first}]", f"{bucket[first][0]!r} came after the parameters of the last update, which was applied "
        f"without the buffers ({len(kept)} kept: {shown}); held, it would be applied with the next update's "
        "parameters, one update late", "send the buffers before the last parameter or in its bucket "
        "(state_dict() order), or with the first parameters of the next update, or leave them out; this bucket "
        "was received and dropped, the group stays joined")




@dataclass
class Declared:
    """What the buckets of a group declared so far: Hugging Face names, the units they land in
    (``update.units``), and the elements of the tensors the model does not hold (ignored)."""

    names: set = field(default_factory=set)
    units: set = field(default_factory=set)
    ignored: int = 0

    def add(self, other: Declared) -> None:
        self.names |= other.names
        self.units |= other.units
        self.ignored += other.ignored


def _unread() -> torch.Tensor:
    raise RuntimeError("metadata only: nothing is received yet")


def check_declared(model, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]], held: Declared) -> Declared:
    """Refuse, before one byte is received, a bucket the update would refuse or that could not be
    received; -> what it declares. Each name: a weight of the model through the update's own
    mapping (``units``: fused, stacked and per-expert names included), of the shape the model
    takes for it, given once (in this bucket and the held ones), no shape without elements. The
    tensors the model does not hold (a vision tower, ``rotary_emb.inv_freq``: received, then
    ignored as the loader ignores them) may add up to as many elements as the model's weights:
    no bucket asks for more than twice the model's elements.

    On tiny Llama (lm_head [300, 64]): ``lm_head.weight`` declared (3, 3) -> ``shapes[0]``:
    "'lm_head.weight' has shape (3, 3), the model's is (300, 64)"; ``model.no_such.weight`` ->
    ``names[0]``; a name given in a held bucket -> ``names[i]`` "... already received"."""
    weight_slots(model)  # the model's refusals
    full = whole_slots(model)[0]
    budget = sum(t.numel() for t in full.values())
    out = Declared()
    for i, (name, dtype, shape) in enumerate(metadata):
        if math.prod(shape) == 0:
            raise LogprobeError(f"shapes[{i}]", f"{list(shape)} ({name!r}) has no elements",
                                "send each tensor with its shape")
        if name in out.names or name in held.names:
            raise LogprobeError(f"names[{i}]", f"{name!r} is given twice" + (" (already received in an earlier "
                                "bucket)" if name in held.names else ""), "send each weight once per update")
        out.names.add(name)
        for unit, piece in units(Incoming(name, tuple(shape), dtype, _unread), model, f"shapes[{i}]"):
            _check_unit(i, name, unit, piece, full, out, held)
        if out.ignored + held.ignored > budget:
            raise LogprobeError(f"shapes[{i}]", f"{list(shape)} ({name!r}, a tensor the model does not hold) "
                                f"brings the ignored tensors to {out.ignored + held.ignored} elements, more than "
                                f"the model's own {budget}", "send the model's weights")
    return out


def _check_unit(i: int, name: str, unit: str | None, piece: Incoming, full: dict, out: Declared,
                held: Declared) -> None:
    """``names[i]`` (``name``)'s piece for ``unit``: known, new, of the model's shape; counted in
    ``out`` (a unit, or the elements of a tensor the model ignores)."""
    if unit is None:
        out.ignored += _ignored(name, piece, full, f"shapes[{i}]")
        return
    if unit not in full:
        raise LogprobeError(f"names[{i}]", f"{name!r} is not a weight of this model",
                            "send the Hugging Face names of the same architecture (model.layers.N...)")
    if unit in out.units or unit in held.units:
        raise LogprobeError(f"names[{i}]", f"{name!r} gives {unit} again", "send each weight once per update")
    if tuple(piece.shape) != tuple(full[unit].shape):
        part = "" if unit.endswith(name.removeprefix("model.")) else f" for {unit}"
        raise LogprobeError(f"shapes[{i}]", f"{name!r} has shape {tuple(piece.shape)}{part}, the model's is "
                            f"{tuple(full[unit].shape)}")
    out.units.add(unit)


def _ignored(name: str, piece: Incoming, full: dict, at: str) -> int:
    """The elements of a tensor the model does not hold; a tied model's ``lm_head.weight`` must
    still have the embedding's shape (the update checks it so)."""
    embed = tuple(full["embed_tokens.weight"].shape) if "embed_tokens.weight" in full else None
    if name == "lm_head.weight" and embed is not None and tuple(piece.shape) != embed:
        raise LogprobeError(at, f"lm_head.weight has shape {tuple(piece.shape)}, the model's (tied) embedding is "
                            f"{embed}")
    return math.prod(piece.shape)


def fault_error(fault: ReceiverFault, metadata: list, timeout: float) -> LogprobeError:
    """The error a receiver's fault gives, naming the tensor in flight where it is known (gloo
    reports each): ``names[i]`` (not broadcast in time, or the collective failed) or
    ``shapes[i]`` (a broadcast of another size than declared: a longer one makes gloo end the
    process, a shorter one is seen by the receiver); ``names`` where it is not known (NCCL)."""
    i = fault.index if fault.index is not None and 0 <= fault.index < len(metadata) else None
    what = "the tensors" if i is None else f"names[{i}] {metadata[i][0]!r}"
    declared = "" if i is None else f" (declared {str(metadata[i][1]).removeprefix('torch.')} {list(metadata[i][2])})"
    problem = {"timeout": f"{what} did not arrive within {timeout:g} s",
               "ended": f"{fault.detail} while receiving {what}{declared}: a broadcast longer than declared ends it so",
               "short": f"{what}{declared}: {fault.detail}"}.get(fault.kind, f"receiving {what} failed: {fault.detail}")
    if i is None:
        return LogprobeError("names", problem, LEFT)
    return LogprobeError(f"shapes[{i}]" if fault.kind in ("ended", "short") else f"names[{i}]", problem, LEFT)


class Received(NamedTuple):
    """What a bucket's receipt hands on (``Scorer.receive_weights_from_distributed``): ``tensors`` to
    write now (every held one once the round is complete; an ``in_place`` group's: this bucket, each
    time), or None (held: more buckets to come); ``version``, the round's last ``weight_version``
    once it is complete; ``complete``, whether this bucket completed the round; ``kept``, the
    buffers a complete in-place round leaves out (native names, ``coverage``); ``in_place``, the
    group's way."""

    tensors: list[tuple[str, torch.Tensor]] | None
    version: str | None
    complete: bool
    kept: tuple[str, ...] = ()
    in_place: bool = False


@dataclass(eq=False)
class WeightGroup:
    """One joined group: its receiver process, where its tensors land, the buckets held, and a
    lock (one update at a time: two interleaved ones would mix their broadcasts)."""

    name: str
    process: ReceiverProcess
    rank: int
    world_size: int
    backend: str
    device: torch.device
    receive_timeout: float = RECEIVE_TIMEOUT
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: list = field(default_factory=list)  # (name, tensor) received, waiting for the rest of the weights
    declared: Declared = field(default_factory=Declared)  # what ``held`` holds
    held_version: str | None = None
    kept: list[str] = field(default_factory=list)  # buffers the last covering round left out (``late_buffers``)
    left: str | None = None  # why the group was left (a fault); None while it works
    in_place: bool = False  # each bucket written as it comes (``collect_in_place``), not held

    def receive(self, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
        """Each tensor broadcast by rank 0, in order, into one buffer of this process's memory,
        by the receiver process, within ``receive_timeout`` s (else ``ReceiverFault``)."""
        layout, nbytes = layout_of(metadata)
        try:
            flat, handle = shared_buffer(nbytes, self.device)
        except (OSError, torch.OutOfMemoryError) as e:  # /dev/shm or the GPU full: the trainer can send less
            raise LogprobeError("shapes", f"the bucket's {nbytes} bytes cannot be held on {self.device}: "
                                f"{type(e).__name__}: {e}", "send smaller buckets") from e
        try:
            self.process.receive(handle, layout, self.receive_timeout, progress=self.backend == "gloo")
        finally:
            unlink_buffer(handle)
        return [(name, t) for (name, _, _), t in zip(metadata, views(flat, layout))]

    def collect(self, bucket: list[tuple[str, torch.Tensor]], declared: Declared, weight_version: str | None,
                model) -> tuple[list[tuple[str, torch.Tensor]] | None, str | None]:
        """Hold ``bucket`` with the tensors received before it; -> (every held tensor, the last
        ``weight_version`` given) once they cover ``model`` (``covers``), else (None, None): wait.
        A bucket of buffers alone opening a round after a round that kept them is refused
        (``late_buffers``), once: the next round starts afresh."""
        covered, kept = self._take(bucket, bucket, declared, weight_version, model)
        if not covered:
            return None, None
        out, version = self.held, self.held_version
        self.drop()
        self.kept = kept
        return out, version

    def collect_in_place(self, bucket: list[tuple[str, torch.Tensor]], declared: Declared, weight_version: str | None,
                         model) -> Received:
        """An ``in_place`` group's bucket: -> ``Received`` of the bucket itself, to be written now;
        ``complete`` once the round's buckets cover ``model`` (``covers``: their names and shapes
        alone are held, as meta tensors), with the round's last ``weight_version`` and the buffers
        it leaves out (``kept``). The same refusals as ``collect``."""
        covered, kept = self._take(bucket, [(name, t.to("meta")) for name, t in bucket], declared, weight_version,
                                   model)
        if not covered:
            return Received(bucket, None, False, (), True)
        version = self.held_version
        self.drop()
        self.kept = kept
        return Received(bucket, version, True, tuple(kept), True)

    def _take(self, bucket, hold, declared: Declared, weight_version: str | None, model) -> tuple[bool, list[str]]:
        """``bucket`` joins the round (``hold``: what of it is held, the tensors or their meta
        twins) -> ``coverage`` of the round so far; a late bucket of buffers is refused first."""
        if not self.held and self.kept:
            late, self.kept = late_buffers(model, bucket, self.kept), []
            if late is not None:
                raise late
        self.held.extend(hold)
        self.declared.add(declared)
        if weight_version is not None:
            self.held_version = weight_version
        return coverage(model, self.held)

    def drop(self) -> None:
        self.held, self.declared, self.held_version = [], Declared(), None

    TEARDOWN_WAIT = 10.0  # seconds ``destroy`` waits for the group's teardown before it returns anyway

    def destroy(self) -> None:
        """Leave the group. NCCL's teardown (``ncclCommFinalize``) waits until every member leaves,
        and SGLang-style trainers leave only after the server's reply (seen on two H200s: the
        reply never came, the trainer waited for it). So the reply waits for the receiver's
        teardown ``TEARDOWN_WAIT`` s at most: gloo's finishes within it, NCCL's when the trainer
        leaves too (the process is reaped, or killed, behind)."""
        with self.lock:
            self.drop()
            self.process.leave(self.TEARDOWN_WAIT)


class WeightGroups:
    """A scorer's joined groups by name (``Scorer.init_weights_update_group`` ...)."""

    def __init__(self) -> None:
        self._groups: dict[str, WeightGroup | None] = {}  # None: being joined
        self._left: dict[str, str] = {}  # group name -> why it was left, until it is joined again
        self._lock = threading.Lock()

    def join(self, device: torch.device, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout: float = 600.0,
             connect_timeout: float = 10.0, receive_timeout: float = RECEIVE_TIMEOUT, in_place: bool = False
             ) -> WeightGroup:
        check_join(device, rank_offset, world_size, group_name, backend, timeout, receive_timeout)
        with self._lock:
            if group_name in self._groups:
                raise LogprobeError("group_name", f"{group_name!r} is already joined (or being joined)",
                                    "destroy it first (destroy_weights_update_group) or use another name")
            self._groups[group_name] = None
        try:
            check_address(master_address, master_port, connect_timeout)
            process = start_receiver(device, master_address, master_port, rank_offset, world_size, group_name,
                                     backend, timeout)
            group = WeightGroup(group_name, process, rank_offset, world_size, backend,
                                device if backend == "nccl" else torch.device("cpu"), receive_timeout,
                                in_place=in_place)
        except BaseException:
            with self._lock:
                self._groups.pop(group_name, None)
            raise
        with self._lock:
            self._groups[group_name] = group
            self._left.pop(group_name, None)
        return group

    def receive(self, group_name: str, names, dtypes, shapes, model, weight_version: str | None = None) -> Received:
        """Check the metadata, receive the bucket, hold it (or, ``in_place``, hand it on); -> ``Received``.
        A refusal or a fault on a joined group leaves it (``LEFT``)."""
        group = self._joined(group_name)
        if group is None:  # the metadata's own errors first, then the group's
            check_metadata(names, dtypes, shapes)
            group = self.get(group_name)  # raises, unless it was joined meanwhile
        with group.lock:
            if group.left is not None:  # left while this call waited for the lock
                raise self._left_error(group_name, group.left)
            try:
                metadata = check_metadata(names, dtypes, shapes)
                declared = check_declared(model, metadata, group.declared)
                received = group.receive(metadata)
            except LogprobeError as e:
                self._leave(group, e.problem)
                raise LogprobeError(e.field, e.problem, f"{e.fix}; {LEFT}" if e.fix else LEFT) from e
            except ReceiverFault as fault:
                e = fault_error(fault, metadata, group.receive_timeout)
                self._leave(group, e.problem)
                raise e from fault
            except BaseException as e:  # out of memory, ...: the trainer's broadcasts are out of step
                self._leave(group, f"{type(e).__name__}: {e}")
                raise
            if group.in_place:
                return group.collect_in_place(received, declared, weight_version, model)
            tensors, version = group.collect(received, declared, weight_version, model)
            return Received(tensors, version, tensors is not None)

    def _joined(self, group_name) -> WeightGroup | None:
        with self._lock:
            return self._groups.get(group_name) if isinstance(group_name, str) else None

    def _leave(self, group: WeightGroup, why: str) -> None:
        """After a fault: the receiver killed, the held buckets dropped, the name refused until
        joined again."""
        log.warning("weight group %r left: %s", group.name, why)
        group.left = why
        group.drop()
        group.process.kill()
        with self._lock:
            if self._groups.get(group.name) is group:
                del self._groups[group.name]
                self._left[group.name] = why

    @staticmethod
    def _left_error(group_name: str, why: str) -> LogprobeError:
        return LogprobeError("group_name", f"{group_name!r} was left after a fault ({why})",
                             "call init_weights_update_group again")

    def get(self, group_name: str) -> WeightGroup:
        with self._lock:
            group, why = self._groups.get(group_name), self._left.get(group_name)
        if why is not None:
            raise self._left_error(group_name, why)
        if group is None:
            raise LogprobeError("group_name", f"{group_name!r} is not a joined weight update group",
                                "call init_weights_update_group first")
        return group

    def drop_round(self, group_name: str) -> None:
        """Forget what the buckets of the round under way declared (an in-place bucket was refused
        after its receipt): the next bucket opens a round."""
        group = self._joined(group_name)
        if group is not None:
            with group.lock:
                group.drop()

    def destroy(self, group_name: str = DEFAULT_GROUP) -> None:
        group = self.get(group_name)
        with self._lock:
            self._groups.pop(group_name, None)
        group.destroy()

    def close(self) -> None:
        self._left.clear()
        for name in [n for n, g in self._groups.items() if g is not None]:
            try:
                self.destroy(name)
            except Exception:  # noqa: BLE001 - closing anyway
                pass


def check_join(device: torch.device, rank_offset, world_size, group_name, backend, timeout,
               receive_timeout) -> None:
    """Refuse what cannot be joined before anything connects, naming the field."""
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
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise LogprobeError("world_size", f"is {world_size}", "the trainer (rank 0) and every rank that receives: "
                            f"2 .. {MAX_WORLD_SIZE}")
    if not 1 <= rank_offset < world_size:
        raise LogprobeError("rank_offset", f"is {rank_offset}; this scorer's rank must be 1 .. world_size - 1 "
                            f"({world_size - 1})", "rank 0 is the trainer")
    for key, value in (("timeout", timeout), ("receive_timeout", receive_timeout)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            raise LogprobeError(key, f"must be a number of seconds > 0, got {value!r}")


def start_receiver(device: torch.device, master_address: str, master_port: int, rank: int, world_size: int,
                   group_name: str, backend: str, timeout: float) -> ReceiverProcess:
    """A receiver process joined to the group (its NCCL socket settings in its environment: NCCL
    reads them in the process that joins)."""
    settings = socket_settings(os.environ, backend)
    if settings:
        log.info("weight group %r: NCCL sockets %s (set NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD to choose)",
                 group_name, " ".join(f"{k}={v}" for k, v in settings.items()))
    cuda = None
    if backend == "nccl":
        cuda = device.index if device.index is not None else torch.cuda.current_device()
    process = ReceiverProcess({**os.environ, **settings})
    try:
        process.join(dict(master_address=master_address, master_port=master_port, rank=rank, world_size=world_size,
                          group_name=group_name, backend=backend, timeout=timeout, device=cuda),
                     timeout + STARTUP_WAIT)
    except ReceiverFault as fault:
        raise LogprobeError("master_address", f"could not join {group_name!r} at {master_address}:{master_port}: "
                            f"{fault.detail}", "check the address, port, world_size and that every rank joins") from fault
    return process

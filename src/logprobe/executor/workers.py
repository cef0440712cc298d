"""Worker processes owned by the library: one replica = ``tp`` processes, one per rank.

The process that makes a ``Scorer(tensor_parallel_size=N)`` drives; it never holds weights. Each
worker joins its replica's process group (NCCL on GPUs, gloo on CPU), reads only its shard of the
weights (``loading.load_shard``) and then serves one message kind: *run these requests* (or the
same under the profiler, ``Profile``: a measuring tool, answered with each rank's summary). Every
rank of a replica runs the same engine loop on the same requests (planning is a pure function of
them), so the ranks meet at the same collectives without any per-batch messages; rank 0 sends
each pass's ``Result`` records back as one ``Results`` message once the pass is read (``Outbox``),
every rank sends ``Done`` at the end (the messages are the small records of ``executor.messages``,
read with ``match``). A watched run (the server's) can lose requests on the way: the driver sends
``Cancel`` to every rank, and the ranks agree between passes on which to leave out (``Watch``).
Before every forward pass the ranks also agree that it fits in memory (``FitsAgreement``): when
one rank has no room, every rank splits and retries the same way. An out-of-memory inside a
pass cannot be agreed: that rank reports it (``Failed(fatal=True)``), and the driver stops the
replica at once rather than wait for the ranks blocked in the pass's collectives.

Workers are fresh interpreters (``python -c`` calling ``executor.workers._main``), not forks or
multiprocessing spawns: nothing of the caller's script is imported again in them, so a script
needs no ``if __name__ == "__main__"`` guard. They connect back over a local authenticated
socket. Messages are pickled inline (no shared-memory handles to leak), CPU tensors as numpy
arrays (``MessagePickler``). A worker that dies is seen through its pidfd: the driver stops the
rest of its replica and raises an error naming the rank; nothing waits forever, and no process is
left behind.
"""

from __future__ import annotations

import gc
import hmac
import io
import os
import pickle
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing import connection

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ..config import COLLECTIVE_SMS, EngineConfig
from ..engine.budget import agreed_budget
from ..engine.runner import Engine
from ..errors import LogprobeError
from ..loading.loader import load_shard
from ..loading.update import StagedWeights
from ..parallel.context import ParallelContext
from .messages import (
    Cancel,
    Close,
    Done,
    EndWeights,
    Failed,
    Profile,
    Profiled,
    Ready,
    Result,
    Results,
    Run,
    StageWeights,
)
from .profile import profile_run

READY_TIMEOUT_S = 600.0  # loading a large model's shard can take minutes


class WorkerDied(LogprobeError):
    pass


@dataclass(slots=True)
class LaunchSpec:
    """What every worker of one replica needs (picklable)."""

    model: str | None
    device: str  # "cpu" or "cuda"
    dtype: str
    config: EngineConfig
    tp: int
    replica: int = 0
    first_gpu: int = 0
    port: int = 0
    threads: int = 1
    ep: int = 1  # expert-parallel size within the replica (divides tp)
    attention: str | None = None  # "data" or "tensor" (ParallelContext.attention; None: the model's default)
    placement: object | None = None  # replicas of hot experts (ParallelContext.placement; parallel.placement)
    load_format: object = "auto"  # "auto", "dummy" or a loading.dummy.RandomWeights (loader.load_shard)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# CPU tensors of these dtypes travel as numpy arrays: the same bytes, a tenth of the pickling time
# (256 results of two [900] tensors: 58 ms to pickle and 42 ms to load as tensors, 5.5 and 3.5 as
# arrays on a 2-core CPU; rank 0 pickles each result while it should be launching the next pass)
ARRAY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                          torch.int8, torch.uint8, torch.bool})


def tensor_from_array(a) -> torch.Tensor:
    """The receiving end of ``MessagePickler``: the tensor of a pickled array (its bytes, its dtype)."""
    return torch.from_numpy(a)


class MessagePickler(pickle.Pickler):
    """The plain pickler, except that a plain CPU tensor of an ``ARRAY_DTYPES`` dtype is written as
    its numpy array (only its own elements: a view does not carry its whole storage), and a CUDA
    tensor as a CUDA IPC handle of its storage (``torch.multiprocessing``'s reduction: the receiver
    maps the sender's memory, after the sender's stream has written it; the sender's allocator
    keeps the memory until the receiver lets go of it). Bits are kept, -0.0 and NaN payloads
    included; two views of one storage arrive as two tensors. Other tensors (bfloat16 on the CPU,
    parameters) take torch's own reduction."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.requires_grad:
            if obj.device.type == "cpu" and obj.dtype in ARRAY_DTYPES:
                return tensor_from_array, (obj.numpy(),)
            if obj.device.type == "cuda":
                return reduce_tensor(obj)
        return NotImplemented


def dumps(msg) -> bytes:
    buf = io.BytesIO()
    MessagePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getvalue()


def freeze_heap() -> int:
    """What is alive once the model is loaded (modules, tokenizer tables: ~400k objects with
    llama-8b's) moved out of the garbage collector's scans (``gc.freeze``, as vLLM and SGLang do).
    A full collection walked all of them, 0.4 s with the GPU idle, about once per 256 RL requests
    in the server; after the freeze it took 0.1 s (docs/perf.md). In a worker of a tensor-parallel
    replica such a pause stops every rank (each waits for it in the next collective). Reference
    counting still frees them; only cycles among them stay. Returns the objects frozen (the
    server's ``/metrics``: ``logprobe_gc_frozen_objects``; a worker's ``Ready.frozen``)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def send(conn, msg) -> None:
    conn.send_bytes(dumps(msg))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def collective_settings(environ, backend: str, overlapped: bool) -> dict[str, str]:
    """The NCCL settings a worker adds to its environment before its process group starts where
    collectives run beside the products by design (``overlapped``: data-parallel attention over
    more than one rank): NCCL's collectives on at most ``COLLECTIVE_SMS`` blocks, the
    multiprocessors deterministic mode's matmul leaves free beside them
    (``config.Numerics.collective_sms``). NCCL took 24 blocks a collective on two H200s, so the
    matmul's persistent programs waited for SMs the collectives held; capped to the 16 left free,
    Qwen3-30B-A3B's deterministic pass at two GPUs went 2.572 -> 2.491 s. Split by heads the
    collectives stand alone between products, and the cap cost llama-8b's W1 at TP = 2 2.5-3%
    (docs/perf.md): none there. Only where the user set neither (their choice stands), only for nccl:

    >>> collective_settings({}, "nccl", True)
    {'NCCL_MAX_CTAS': '16', 'NCCL_MIN_CTAS': '1'}
    >>> collective_settings({}, "nccl", False), collective_settings({"NCCL_MAX_CTAS": "32"}, "nccl", True)
    ({}, {})

    Deterministic mode's bits are unaffected: its sums over ranks are logprobe's own fixed trees
    (``parallel.context``), whatever blocks move the bytes."""
    if backend != "nccl" or not overlapped or "NCCL_MAX_CTAS" in environ or "NCCL_MIN_CTAS" in environ:
        return {}
    return {"NCCL_MAX_CTAS": str(COLLECTIVE_SMS), "NCCL_MIN_CTAS": "1"}


def worker_main(spec: LaunchSpec, rank: int, conn) -> None:
    """Entry point of one rank (a spawned process)."""
    import torch.distributed as dist


    try:
        torch.set_num_threads(spec.threads)
        if spec.device == "cuda":
            torch.cuda.set_device(spec.first_gpu + rank)
            device, backend = f"cuda:{spec.first_gpu + rank}", "nccl"
        else:
            device, backend = "cpu", "gloo"
        overlapped = spec.attention == "data" and spec.tp > 1  # the driver resolved the layout
        os.environ.update(collective_settings(os.environ, backend, overlapped))  # read when NCCL's communicator starts
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                                world_size=spec.tp)
        with _AnonPeak() as peak:
            loaded = load_shard(spec.model, ParallelContext(rank, spec.tp, dist.group.WORLD, experts=spec.ep,
                                                   attention=spec.attention, placement=spec.placement), device,
                                spec.dtype, tokenizer=False, load_format=spec.load_format)
        config = spec.config
        if config.max_batch_tokens is None:  # the default: agreed by the group, told to the driver
            config = replace(config, max_batch_tokens=agreed_budget(loaded.model, torch.device(device)))
        engine = Engine(loaded.model, config, torch.device(device))
        control = control_group(spec.tp, spec.device)
        if control is not None:
            engine.agree_fits = FitsAgreement(control)
        _test_fault(engine, rank, os.environ.get(TEST_OOM_ENV))
        send(conn, Ready(_param_bytes(loaded.model), peak.growth, config.max_batch_tokens, freeze_heap()))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then this process ends
        send(conn, _error(e))
        return
    stage = None  # a weight update in progress (loading.update.StagedWeights)
    later: deque = deque()  # messages a watched run read while looking for Cancel
    while True:
        try:
            msg = later.popleft() if later else recv(conn)
        except (EOFError, OSError):  # the driver is gone
            break
        match msg:
            case Close():
                break
            case Cancel():  # for a run that ended before it came
                pass
            case StageWeights() | EndWeights():
                stage = _weights_message(msg, loaded.model, stage, conn)
            case Run() | Profile():
                _run(msg, engine, rank, conn, control, later)
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(msg: Run | Profile, engine: Engine, rank: int, conn, control, later: deque) -> None:
    """One run on this rank: rank 0 sends its results a pass at a time, every rank ``Done`` (with
    the engine's pass count) or ``Failed``. A watched run reads its cancellations (``Watch``,
    agreed over ``control``) between passes."""
    outbox = Outbox(conn, engine) if rank == 0 else None
    on_result, on_batch = (outbox.add, outbox.flush) if outbox is not None else (None, None)
    watch = Watch(conn, control, later, outbox) if isinstance(msg, Run) and msg.watched else None
    try:
        if isinstance(msg, Profile):  # the same run, measured (executor.profile)
            send(conn, Profiled(profile_run(engine, msg.requests, msg.config, rank, on_result, on_batch)))
        else:
            engine.config = msg.config
            engine.run(msg.requests, on_result=on_result, progress=False, on_batch=on_batch,
                       stop=None if watch is None else watch.between,
                       cancelled=None if watch is None else watch.cancelled)
        if outbox is not None:
            outbox.flush()
        send(conn, Done(engine.passes, engine.oom_count))
    except BaseException as e:  # noqa: BLE001
        if outbox is not None and not isinstance(e, OSError):
            outbox.flush()  # the results delivered before the error reach the driver first
        # an out-of-memory the engine let through is one inside a pass (``Engine._recoverable``)
        inside = isinstance(e, torch.OutOfMemoryError) and control is not None
        send(conn, _out_of_step(e, rank, engine) if inside else _error(e))


def control_group(tp: int, device: str):
    """The group the ranks of a replica agree on cancellations (``Watch``) and on each pass's
    memory (``FitsAgreement``) over: None alone; the model's own gloo group on CPU; a gloo group
    beside NCCL on CUDA (agreeing over NCCL would make the host wait for the GPU's queue before
    every pass). Every rank of the world calls it, in the same order (``dist.new_group``)."""
    import torch.distributed as dist

    if tp == 1:
        return None
    return dist.new_group(backend="gloo") if device == "cuda" else dist.group.WORLD


class Watch:
    """A watched run's cancellations, as every rank of the replica agrees on them. ``between`` is
    ``Engine.run``'s ``stop`` (never True): asked before every forward pass, at the same point of
    the same plan on every rank. There each rank reads the ``Cancel`` messages that have come,
    and the ranks apply the first n, n the fewest any of them has read (an all-reduce MIN over
    ``group``): all leave the same requests out of the same passes, whatever the order the
    messages reached them in. ``cancelled`` is ``Engine.run``'s ``cancelled``. Rank 0 also
    reports each pass to the driver (its ``outbox``), so the server's pass count is live.

        rank 0 has read Cancel(a), Cancel(b); rank 1 only Cancel(a)  -> both drop a now,
        and b before the next pass (rank 1 has read it by then, or later: never one rank alone).

    Messages other than ``Cancel`` read meanwhile (none are sent during a run) wait in ``later``.
    """

    def __init__(self, conn, group, later: deque, outbox: Outbox | None) -> None:
        self.conn, self.group, self.later, self.outbox = conn, group, later, outbox
        self.read: list[tuple[int, ...]] = []  # Cancel messages read, in order
        self.applied = 0  # how many of them every rank has applied
        self.gone: set[int] = set()

    def between(self) -> bool:
        import torch.distributed as dist

        if self.outbox is not None:
            self.outbox.flush(report=True)
        while self.conn.poll(0):
            msg = recv(self.conn)
            if isinstance(msg, Cancel):
                self.read.append(msg.indices)
            else:
                self.later.append(msg)
        n = len(self.read)
        if self.group is not None:
            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            n = int(t.item())
        for indices in self.read[self.applied:n]:
            self.gone.update(indices)
        self.applied = n
        return False

    def cancelled(self, i: int) -> bool:
        return i in self.gone


class FitsAgreement:
    """``Engine.agree_fits`` of a replica's rank: every rank's answer to "does this pass fit?"
    (``Engine._preflight``, before every forward pass, at the same point of the same plan on
    every rank) agreed by an all-reduce MAX over ``group`` (the gloo control group of ``Watch``:
    over NCCL the host would wait for the GPU's queue before every pass) of a flag, 1 for "no".

        rank 0: fits, rank 1: out of memory  -> MAX(0, 1) = 1: both answer False

    One all-reduce of one int64 per pass (a watched run's ``Watch`` adds its own, asked earlier:
    merged into this one, a cancellation read while a pass is packed would reach the pass after
    it): 0.54-0.68 ms on the 2-core CPU (a gloo loop of 3,000), about 1 ms of a tiny Llama's
    16-17 ms passes at TP = 2 there (docs/parallel.md); on CUDA the host agrees while the GPU
    still runs the pass before."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, fits: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor([0 if fits else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) == 0


def _out_of_step(e: BaseException, rank: int, engine: Engine) -> Failed:
    """The report of an out-of-memory inside a forward pass on this rank: fatal to the replica
    (the other ranks wait in the pass's collectives), naming the rank and the budget to lower."""
    return Failed("max_batch_tokens", f"rank {rank} ran out of memory inside a forward pass, after every rank "
                  f"agreed it would fit ({_first_line(e)})",
                  f"lower max_batch_tokens (now {engine.config.max_batch_tokens}; the pass's working budget "
                  f"was {engine.budget}) and create a new Scorer", fatal=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) <= 200 else text[:197] + "..."


# A test seam, read by the worker only: LOGPROBE_TEST_OOM=RANK:WHERE:ROWS makes rank RANK of
# every replica run out of memory on each pass of more than ROWS rows (``_test_fault``).
TEST_OOM_ENV = "LOGPROBE_TEST_OOM"


def _test_fault(engine: Engine, rank: int, value: str | None) -> None:
    """Install ``TEST_OOM_ENV``'s fault on this rank (tests/test_oom_parallel.py), where WHERE is
    "before" (this rank's pre-flight answers no: ``Engine.fault_hook`` raises, as a reservation
    that failed would) or "inside" (the model's final norm raises, mid-pass, once every rank has
    agreed; ROWS counts the rows the norm sees: this rank's share under data-parallel attention).

        LOGPROBE_TEST_OOM=1:before:100   rank 1 has no room for a pass of more than 100 rows
    """
    if not value:
        return
    who, where, rows = value.split(":")
    if int(who) != rank:
        return
    limit = int(rows)

    def fault(n: int) -> None:
        if n > limit:
            raise torch.OutOfMemoryError(f"{TEST_OOM_ENV}: rank {rank}, {n} rows")

    if where == "before":
        engine.fault_hook = lambda rows, tokens: fault(rows)
    else:
        engine.model.norm.register_forward_pre_hook(lambda module, args: fault(args[0].shape[0]))


class Outbox:
    """Rank 0's results of one run on their way to the driver: ``add`` keeps each as the engine
    delivers it, ``flush`` (``Engine.run``'s ``on_batch``, after each pass) sends those kept as one
    ``Results`` message, with the engine's pass count. With a message a request, the driver woke,
    polled and unpickled once for each of a pass's ~128 requests, and rank 0's two-GPU W1 run
    ended 24 ms after its last kernel (rank 1, which sends nothing: 3 ms). ``flush(report=True)``
    (a watched run, before each pass) sends the count alone when passes went by without results
    (a long request's chunks)."""

    __slots__ = ("conn", "engine", "items", "reported")

    def __init__(self, conn, engine: Engine | None = None) -> None:
        self.conn, self.engine, self.items = conn, engine, []
        self.reported = self.passes

    @property
    def passes(self) -> int:
        return self.engine.passes if self.engine is not None else 0

    def add(self, index: int, result) -> None:
        self.items.append(Result(index, result))

    def flush(self, report: bool = False) -> None:
        if self.items or (report and self.passes != self.reported):
            items, self.items = self.items, []
            self.reported = self.passes
            send(self.conn, Results(items, self.reported))


def _weights_message(msg: StageWeights | EndWeights, model, stage, conn):
    """A weight update (``loading.update.update_workers``): ``StageWeights`` stages slices (no
    answer); ``EndWeights`` "prepare" answers whether every slice arrived and converted (and covers the
    shard; "prepare part": a part of an update), "commit"
    copies them into the shard, "abort" drops them; those three answer ``Done`` or ``Failed``."""
    try:
        match msg:
            case StageWeights(pairs):
                stage = stage or StagedWeights(model)
                stage.add(pairs)
                return stage
            case EndWeights("prepare" | "prepare part" as step):
                (stage or StagedWeights(model)).prepare(whole=step == "prepare")
            case EndWeights("commit"):
                if stage is not None:  # a part may hold nothing of this rank's
                    stage.commit()
                stage = None
            case _:
                stage = None
        send(conn, Done())
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        send(conn, _error(e))
    return stage


def _rss_anon() -> int:
    """Resident anonymous memory of this process, bytes (Linux ``RssAnon``; file pages that a
    memory-mapped checkpoint brings in are not counted: they are the page cache's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _AnonPeak:
    """Peak growth of ``RssAnon`` over a block, sampled every 2 ms by a thread (what loading a
    shard costs the process at its worst, reported to the driver)."""

    def __enter__(self):
        self.base = self.top = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.top = max(self.top, _rss_anon())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.top = max(self.top, _rss_anon())

    @property
    def growth(self) -> int:
        return self.top - self.base


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _error(e: BaseException) -> Failed:
    if isinstance(e, LogprobeError):
        return Failed(e.field, e.problem, e.fix)
    return Failed("worker", f"{type(e).__name__}: {e}", "")


class _Proc:
    """A worker process: its Popen, a pidfd that becomes readable when it exits, its connection."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.sentinel = os.pidfd_open(popen.pid)
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


class WorkerGroup:
    """The ``tp`` processes of one replica: spawned at construction, where they import torch and
    the package and connect while the driver reads the model (``executor.engine.parallel_parts``),
    then given their ``LaunchSpec`` and waited for by ``start``."""

    def __init__(self, tp: int, replica: int = 0) -> None:
        self.tp, self.replica = tp, replica
        self.spec: LaunchSpec | None = None
        self._key = secrets.token_bytes(32)
        self._listener = socket.create_server(("127.0.0.1", 0))
        host, port = self._listener.getsockname()[:2]
        self.procs: list[_Proc] = []
        self.conns: list = [None] * tp
        self.passes = 0  # forward passes rank 0 has reported (``Results``, ``Done``)
        self.oom_count = 0  # out-of-memory errors its ranks agreed on and split around (rank 0's ``Done``)
        try:
            for rank in range(tp):
                cmd = [sys.executable, "-c", _ENTRY, host, str(port), self._key.hex(), str(rank)]
                self.procs.append(_Proc(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=_worker_env())))
        except BaseException:
            self.close()
            raise

    def start(self, spec: LaunchSpec) -> WorkerGroup:
        """Hand every rank ``spec`` and wait until each has loaded its shard (``Ready``)."""
        spec.port = spec.port or free_port()
        self.spec = spec
        try:
            for _ in range(self.tp):
                self._accept(self._listener, self._key)
            for conn in self.conns:
                send(conn, spec)
            self.param_bytes, self.load_peak_bytes, self.frozen = [], [], []
            for rank in range(self.tp):
                match self._recv(rank, READY_TIMEOUT_S):
                    case Failed() as failed:
                        raise failed.error()
                    case Ready(param_bytes, load_peak_bytes, budget, frozen):
                        self.param_bytes.append(param_bytes)
                        self.load_peak_bytes.append(load_peak_bytes)
                        self.frozen.append(frozen)
                        self.budget = budget
        except BaseException:
            self.close()
            raise
        finally:
            self._listener.close()
        return self

    def _accept(self, listener, key: bytes) -> None:
        """The next worker to connect proves it holds ``key`` and says its rank (raw bytes: nothing
        is unpickled from a peer before that); a worker that dies first is an error."""
        end = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < end:
            ready, _, _ = select.select([listener, *[p.sentinel for p in self.procs]], [], [], 1.0)
            for r, p in enumerate(self.procs):
                if p.sentinel in ready:
                    self._died(r)
            if listener in ready:
                sock, _ = listener.accept()
                conn = connection.Connection(sock.detach())
                hello = conn.recv_bytes(64)
                rank = int.from_bytes(hello[len(key):], "little")
                if not hmac.compare_digest(hello[:len(key)], key) or not 0 <= rank < len(self.conns):
                    conn.close()
                    continue
                self.conns[rank] = conn
                return
        raise WorkerDied("tensor_parallel_size", f"workers did not connect within {READY_TIMEOUT_S:.0f} s")

    def submit(self, requests, config: EngineConfig, profiled: bool = False, watched: bool = False) -> None:
        """Every rank runs ``requests`` (``profiled``: under the profiler, ``Profile``; ``watched``:
        ``cancel`` may drop some while it runs)."""
        data = dumps(Profile(requests, config) if profiled else Run(requests, config, watched))  # once for all
        for conn in self.conns:
            conn.send_bytes(data)

    def cancel(self, indices: list[int]) -> None:
        """Requests ``indices`` of the watched run under way: no pass of theirs after the one under
        way (``Watch``); their results, if any come, are the caller's to ignore."""
        self.broadcast(Cancel(tuple(indices)))

    def broadcast(self, msg, rank: int | None = None) -> None:
        """Send ``msg`` to every rank (or to one)."""
        for r, conn in enumerate(self.conns):
            if rank is None or r == rank:
                send(conn, msg)

    def messages(self):
        """Yield ``Result``s from rank 0 (and each rank's ``Profiled`` after a ``Profile``) until
        every rank is done; raise a rank's error. A message that brings neither (a pass's count
        alone, a rank's ``Done``) yields None: each step reads only what has come, so a caller
        that waits on ``conns`` first never blocks in it. ``passes``: rank 0's count, as it comes."""
        done, error = set(), None
        while len(done) < len(self.conns):
            for rank in self._ready(sorted(set(range(len(self.conns))) - done)):
                try:
                    msg = recv(self.conns[rank])
                except (EOFError, OSError):  # its end of the socket closed: the process is going
                    self._died(rank)
                match msg:
                    case Results(items, passes):
                        self.passes = passes
                        yield from items or (None,)
                        continue
                    case Profiled():
                        yield msg
                        continue
                    case Failed(fatal=True):
                        self._out_of_step(rank, msg)
                    case Failed():
                        error = error or msg
                    case Done(passes, oom_count):
                        if rank == 0 and passes is not None:
                            self.passes = passes
                        if rank == 0 and oom_count is not None:
                            self.oom_count = oom_count
                done.add(rank)
                if len(done) < len(self.conns):
                    yield None
        if error is not None:
            raise error.error()

    def _ready(self, ranks: list[int]) -> list[int]:
        """Ranks with a message; a dead worker is an error naming it (and ends the replica)."""
        conns = {self.conns[r]: r for r in ranks}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while True:
            ready = connection.wait([*conns, *sentinels], timeout=5.0)
            got = [conns[c] for c in ready if c in conns]
            if got:
                return got
            for s in ready:
                if s in sentinels:
                    self._died(sentinels[s])

    def _recv(self, rank: int, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.conns[rank].poll(1.0):
                return recv(self.conns[rank])
            if not self.procs[rank].is_alive():
                self._died(rank)
        raise WorkerDied("tensor_parallel_size", f"worker rank {rank} did not start within {timeout:.0f} s")

    def _out_of_step(self, rank: int, failed: Failed) -> None:
        """Rank ``rank`` has left the replica's lockstep (``Failed.fatal``): the other ranks wait
        in collectives that will not complete (gloo's and NCCL's time out only after minutes), so
        the replica is stopped now, and the error names the rank."""
        self.close(timeout=0.0)
        raise WorkerDied(failed.field, f"{failed.problem}; replica {self.replica} was stopped", failed.fix)

    def _died(self, rank: int) -> None:
        self.procs[rank].join(5.0)
        code = self.procs[rank].exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.close()
        raise WorkerDied("tensor_parallel_size", f"worker rank {rank} of replica {self.replica} died "
                         f"({how}, pid {self.procs[rank].pid})",
                         "its replica was stopped; create a new Scorer (out of memory? fewer tokens per batch)")

    def close(self, timeout: float = 10.0) -> None:
        self._listener.close()
        for conn, p in zip(self.conns, self.procs):
            if conn is not None and p.is_alive():
                try:
                    send(conn, Close())
                except (OSError, BrokenPipeError):
                    pass
            elif conn is None and p.is_alive():  # never given a spec (the driver failed first): nothing to finish
                p.terminate()
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:  # blocked in a collective with a dead peer: stop it
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        for p in self.procs:
            if p.sentinel is not None:
                os.close(p.sentinel)
                p.sentinel = None
        self.conns = []

    @property
    def alive(self) -> bool:
        return bool(self.conns) and all(p.is_alive() for p in self.procs)


def _worker_env() -> dict[str, str]:
    """The caller's environment, with this package importable in the worker."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../src
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


# `python -m logprobe.executor.workers` would import this module twice (the package's own imports
# reach it before runpy runs it as __main__, and runpy warns): the worker imports it once instead
_ENTRY = "import sys; from logprobe.executor.workers import _main; _main(sys.argv[1:])"


def _main(argv: list[str]) -> None:
    host, port, key, rank = argv
    conn = connection.Connection(socket.create_connection((host, int(port))).detach())
    conn.send_bytes(bytes.fromhex(key) + int(rank).to_bytes(4, "little"))
    # a rank imports no transformers: it reads no tokenizer (``load_shard(tokenizer=False)``), and
    # native models, the only ones split over ranks, need none (the import alone took 2-10 s)
    worker_main(recv(conn), int(rank), conn)


def default_threads(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // processes)


"""The receiver process: the one process that joins a weight update group and receives every
broadcast of it (``loading.collective`` starts one per group, at ``init_weights_update_group``).

A collective's failure cannot be caught where it happens: a trainer broadcasting a tensor of
another size than it declared makes gloo abort the process on its transport thread, and NCCL
hangs. So the server never joins the group itself: this process does, and the server kills it
when it fails, times out, or the group is out of step with the trainer; the server goes on.

It is a fresh interpreter (``python -c`` running this file by path, importing only the
standard library and torch; nothing of the package, no model), as the executor's workers are
(a multiprocessing spawn would import the caller's ``__main__`` again: ``logprobe serve``'s CLI,
6 s). It speaks over its stdin and stdout (``multiprocessing.connection`` messages; stray prints
go to stderr), and exits when its parent does.

    server                                          receiver (this process)
    ("join", {address, port, rank, ...})  ------->  rendezvous, the group (gloo or nccl)
                                         <-------  ("joined",) | ("fault", "failed", why)
    ("receive", buffer, layout)          ------->  broadcast(view, src=0) per tensor, into the
                                                    server's buffer (CPU: a shared-memory file;
                                                    CUDA: its device tensor, by CUDA IPC)
                                         <-------  ("got", i) per tensor (gloo), then ("done",)
                                                    | ("fault", "failed" | "short", why) and exit
    ("leave", wait)                      ------->  destroy the group (at most ``wait`` s), exit

Both ends are here: ``ReceiverProcess`` is the server's handle (it raises ``ReceiverFault``, which
``loading.collective`` turns into an error naming the field), the functions below it run in the
receiver.
"""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - its reductions rebuild a CUDA tensor the server sends by IPC
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

# this file run by path (nothing of the package imported), the working directory off sys.path
_ENTRY = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"
ALIGN = 256  # bytes: every tensor of a receive buffer starts on a boundary any dtype (and CUDA) takes


class ReceiverFault(Exception):
    """The receiver process failed (``kind`` "failed": its collective raised; "short": a gloo
    broadcast shorter than declared), ended ("ended": killed, or gloo aborted it on a broadcast
    longer than declared) or ran out of time ("timeout"), at tensor ``index`` of the
    receive (-1: the join; None: not known, NCCL reports no tensor before the last). The process
    is dead when this is raised."""

    def __init__(self, kind: str, index: int | None, detail: str) -> None:
        super().__init__(f"{kind} at {index}: {detail}")
        self.kind, self.index, self.detail = kind, index, detail


class ReceiverProcess:
    """The server's handle of one receiver process: started at construction (``env``: its
    environment, the NCCL socket settings included), then ``join``, ``receive`` ..., ``leave``.
    Any fault kills the process before ``ReceiverFault`` is raised, so no receive can still write
    into a buffer the caller frees."""

    def __init__(self, env: dict[str, str]) -> None:
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        try:
            self.popen = subprocess.Popen([sys.executable, "-c", _ENTRY, os.path.abspath(__file__)], stdin=child_in,
                                          stdout=child_out, env=env)
        except BaseException:
            for fd in (to_child, from_child):
                os.close(fd)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        self.outbox, self.inbox = Connection(to_child, readable=False), Connection(from_child, writable=False)
        self.pid = self.popen.pid

    def join(self, kwargs: dict, timeout: float) -> None:
        """Join the group (``join``'s arguments), within ``timeout`` s (the process's start included)."""
        self._send(("join", kwargs), -1)
        message = self._answer(time.monotonic() + timeout, -1, timeout)
        if message[0] != "joined":
            self._fault(message[1], -1, message[2])

    def receive(self, buffer, layout: list, timeout: float, progress: bool) -> None:
        """Every tensor of ``layout`` into ``buffer`` (``shared_buffer``'s handle) within ``timeout`` s;
        ``progress``: the process reports each tensor (gloo), so a fault names the one in flight."""
        self._send(("receive", buffer, layout), 0 if progress else None)
        deadline, got = time.monotonic() + timeout, 0
        while True:
            message = self._answer(deadline, got if progress else None, timeout)
            if message[0] == "done":
                return
            if message[0] == "got":
                got = message[1] + 1
            else:
                self._fault(message[1], got if progress else None, message[2])

    def _send(self, message, index: int | None) -> None:
        try:
            self.outbox.send(message)
        except OSError:
            self._fault("ended", index, "")

    def _answer(self, deadline: float, index: int | None, timeout: float) -> tuple:
        left = deadline - time.monotonic()
        if left <= 0 or not self.inbox.poll(left):
            self._fault("timeout", index, f"nothing came within {timeout:g} s")
        try:
            return self.inbox.recv()
        except (EOFError, OSError):
            self._fault("ended", index, "")

    def _fault(self, kind: str, index: int | None, detail: str):
        self.kill()
        if kind == "ended":
            detail = f"the receiver process ended (exit code {self.popen.returncode})"
        raise ReceiverFault(kind, index, detail)

    def kill(self) -> None:
        """End the process now and wait until it is gone (its receives cannot write any more)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._close()

    def leave(self, wait: float) -> None:
        """Ask the process to destroy its group and exit; wait ``wait`` s at most for it (gloo's
        teardown is quick; NCCL's waits until the trainer leaves, after this reply), then a thread
        reaps it, killing it if it is still there ``wait`` s later."""
        try:
            self.outbox.send(("leave", wait))
        except OSError:
            pass
        try:
            self.popen.wait(wait)
            self._close()
        except subprocess.TimeoutExpired:
            threading.Thread(target=self._reap, args=(wait,), daemon=True, name="logprobe-receiver-reaper").start()

    def _reap(self, wait: float) -> None:
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._close()

    def _close(self) -> None:
        self.outbox.close()
        self.inbox.close()


def layout_of(metadata: list) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """(name, dtype, shape) triples -> where each tensor lies in one flat receive buffer, and its
    size in bytes: [(dtype name, shape, byte offset)], each offset a multiple of ``ALIGN``.

    >>> layout_of([("a", torch.float32, (3, 3)), ("b", torch.bfloat16, (2,))])
    ([('float32', (3, 3), 0), ('bfloat16', (2,), 256)], 512)
    """
    out, at = [], 0
    for _, dtype, shape in metadata:
        out.append((str(dtype).removeprefix("torch."), tuple(shape), at))
        at += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return out, at


def shared_buffer(nbytes: int, device: torch.device):
    """A receive buffer of ``nbytes`` the receiver process writes into, the server's own memory:
    -> (flat uint8 tensor, the handle to send the process). CUDA: a device tensor (sent by CUDA
    IPC: the process writes into it, no copy); CPU: a file in /dev/shm mapped by both (unlinked
    when the receive ends: ``unlink_buffer``; the mappings stay), its space reserved now, so a
    full /dev/shm raises ``OSError`` here instead of killing a process that writes into it."""
    if device.type == "cuda":
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return flat, flat
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"logprobe-weights-{os.getpid()}-", dir=where)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        flat = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return flat, ("file", path, nbytes)


def unlink_buffer(handle) -> None:
    """Remove a CPU buffer's file (the mappings stay until their tensors are freed)."""
    if isinstance(handle, tuple):
        os.unlink(handle[1])


# -- the receiver process ----------------------------------------------------------------------


def flat_buffer(buffer):
    """The server's receive buffer as one flat uint8 tensor: a CUDA tensor as sent (the server's
    memory, by CUDA IPC), or ``("file", path, nbytes)``: a shared-memory file the server mapped."""
    if isinstance(buffer, torch.Tensor):
        return buffer
    _, path, nbytes = buffer
    fd = os.open(path, os.O_RDWR)
    try:
        return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)


def views(flat, layout):
    """``layout``: [(dtype name, shape, byte offset)] -> the tensors, views of ``flat``."""
    out = []
    for dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        n = dtype.itemsize
        for d in shape:
            n *= d
        out.append(flat[offset:offset + n].view(dtype).view(shape))
    return out


def join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
         timeout: float, device: int | None):
    """The process group of ``init_custom_process_group`` (SGLang/vLLM/OpenRLHF), this side's rank."""
    if device is not None:
        torch.cuda.set_device(device)
    t = timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=t))
    store.set_timeout(t)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=t)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class ShortBroadcast(Exception):
    """A gloo broadcast shorter than its buffer: gloo takes it and leaves the rest as it was."""


def receive(pg, buffer, layout, outbox: Connection, cuda: bool) -> None:
    """Each tensor of ``layout`` broadcast by rank 0, in order, into the server's buffer. Gloo's
    broadcasts complete as they return: each is reported (the server names the one that failed)
    and checked for its length: gloo aborts this process on a broadcast longer than the buffer,
    and takes a shorter one silently, leaving the buffer's end as it was. So the last bytes (8 at
    most) are set to random ones first: still there afterwards, the broadcast was short (or the
    trainer's tensor ends with those bytes: one chance in 2**64, 2**16 for a one-element
    bfloat16; then the update is refused, never wrong). NCCL does not check a broadcast's size:
    one of another size hangs (the server's timeout ends it) or is misread, so under NCCL the
    metadata checked before receiving is the guard. FP8 codes are received as their bytes (gloo has no
    float8 type, NCCL sends float8 as bytes): a gloo trainer broadcasts ``codes.view(torch.uint8)``."""
    flat = flat_buffer(buffer)
    for i, view in enumerate(views(flat, layout)):
        end = None if cuda else view.view(-1).view(torch.uint8)[-8:]
        if end is not None:
            mark = torch.frombuffer(bytearray(os.urandom(end.numel())), dtype=torch.uint8)
            end.copy_(mark)
        dist.broadcast(view.view(torch.uint8) if view.dtype == torch.float8_e4m3fn else view, src=0, group=pg)
        if end is not None and torch.equal(end, mark):
            raise ShortBroadcast(f"the broadcast was shorter than the {view.numel() * view.element_size()} bytes "
                                 f"declared (gloo takes it and leaves the rest of the buffer unwritten)")
        if not cuda:
            outbox.send(("got", i))
    if cuda:
        torch.cuda.synchronize()  # the weights are in the server's memory before it reads them


def leave(pg, wait: float) -> None:
    """Destroy the group, waiting at most ``wait`` s: NCCL's teardown waits until every member
    leaves, and a trainer may leave only after the server's reply."""
    t = threading.Thread(target=dist.destroy_process_group, args=(pg,), daemon=True)
    t.start()
    t.join(wait)


def watch_parent() -> None:
    """Exit when the server does (a receive may be blocked in the collective meanwhile)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(inbox: Connection, outbox: Connection) -> None:
    kind, kwargs = inbox.recv()
    try:
        pg = join(**kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the server, which names the field
        outbox.send(("fault", "failed", f"{type(e).__name__}: {e}"))
        return
    outbox.send(("joined",))
    cuda = kwargs["device"] is not None
    while True:
        message = inbox.recv()
        if message[0] == "leave":
            leave(pg, message[1])
            return
        try:
            receive(pg, message[1], message[2], outbox, cuda)
        except ShortBroadcast as e:
            outbox.send(("fault", "short", str(e)))
            return
        except Exception as e:  # noqa: BLE001 - the group is out of step: the server kills it
            outbox.send(("fault", "failed", f"{type(e).__name__}: {e}"))
            return
        del message  # the server's buffer: this process holds no reference to it once done
        outbox.send(("done",))


def main() -> None:
    watch_parent()
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print must not reach the server's channel
    inbox, outbox = Connection(0, writable=False), Connection(out, readable=False)
    try:
        serve(inbox, outbox)
    except EOFError:  # the server closed the channel: nothing left to do
        pass
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: a collective's threads may still be blocked


if __name__ == "__main__":
    main()

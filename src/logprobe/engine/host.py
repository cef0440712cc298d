"""A batch's head outputs to the host in one device-to-host copy, started without waiting.

The head leaves per-row tensors on the device: log-prob and rank, entropy and top-k when asked.
Copying each request's slice of each field (``.cpu()``) is one synchronising copy per request and
field, some hundreds per batch on RL groups, and each one stalls the host until the GPU is idle.
Instead the fields are laid end to end in one int32 buffer (float32 bits reinterpreted, not
converted; ranks and ids narrowed, a vocabulary being < 2**31), copied once into pinned memory
without blocking, and read when the engine next needs them: after it has launched the next
batch, so that planning and packing that batch overlap this one on the GPU.

Layout of the buffer, rows n = 3, top-k 2, entropy asked (lp: log-prob, r: rank, h: entropy)::

    [lp0 lp1 lp2 | r0 r1 r2 | h0 h1 h2 | id00 id01 id10 id11 id20 id21 | tl00 tl01 tl10 tl11 tl20 tl21]
     <- n ->       <- n ->    <- n ->    <------------ n * k ---------->  <------------ n * k --------->

>>> import torch
>>> from logprobe.layers.logprob_head import HeadOutput
>>> out = HeadOutput(torch.tensor([-0.5, -2.0]), torch.zeros(2), torch.tensor([0, 7]),
...                  topk_ids=torch.tensor([[3, 1, 4], [1, 5, 9]]), topk_logprobs=-torch.rand(2, 3))
>>> copy = start_copy(out, top_k=2, entropy=False)
>>> copy.buffer.tolist()[2:4], copy.buffer.numel()   # ranks follow the two log-probs; 2 * (2 + 2 * 2)
([0, 7], 12)
>>> rows = copy.wait()
>>> rows.topk_ids.tolist(), rows.entropy
([[3, 1], [1, 5]], None)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import host_values_to
from ..layers.logprob_head import HeadOutput


@dataclass(slots=True)
class HostRows:
    """A batch's per-row results on the host (views into one buffer; the engine copies each
    request's rows out of it)."""

    logprobs: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64
    entropy: torch.Tensor | None  # [n] float32
    topk_ids: torch.Tensor | None  # [n, k] int64
    topk_logprobs: torch.Tensor | None  # [n, k] float32


@dataclass(slots=True)
class HostCopy:
    """A copy in flight; ``wait()`` blocks until it has landed and gives the rows."""

    buffer: torch.Tensor  # int32, the layout of the module docstring
    rows: int
    top_k: int
    entropy: bool
    event: torch.cuda.Event | None = None  # recorded after the copy (CUDA only)

    def wait(self) -> HostRows:
        buf = self.buffer
        if self.event is not None:
            self.event.synchronize()
            # the results may live long: pageable memory for them, the pinned buffer back to its cache
            buf = torch.empty(buf.shape, dtype=torch.int32).copy_(buf)
        return unpack(buf, self.rows, self.top_k, self.entropy)


def start_copy(out: HeadOutput, top_k: int, entropy: bool) -> HostCopy:
    """Lay ``out``'s fields end to end (the first ``top_k`` alternatives; entropy if asked) and
    start their copy to the host."""
    n = out.logprobs.shape[0]
    parts = [_bits(out.logprobs), out.ranks.to(torch.int32)]
    if entropy:
        parts.append(_bits(out.entropy))
    if top_k:
        parts += [out.topk_ids[:, :top_k].to(torch.int32).reshape(-1),  # [n * k]
                  _bits(out.topk_logprobs[:, :top_k])]
    flat = torch.cat(parts)
    if not flat.is_cuda:
        return HostCopy(flat, n, top_k, entropy)
    host = torch.empty(flat.shape, dtype=torch.int32, pin_memory=True)
    host.copy_(flat, non_blocking=True)  # queued on the tensor's device's current stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))  # that stream, not the current device's
    return HostCopy(host, n, top_k, entropy, event)


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device`` without a host sync (``kernels.host_values_to``).

    >>> to_device([3, 1, 4], torch.long, torch.device("cpu")).tolist()
    [3, 1, 4]
    """
    return host_values_to(values, dtype, device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bits as int32, flattened (no conversion: the numbers come back whole)."""
    return t.contiguous().view(torch.int32).reshape(-1)


def unpack(buf: torch.Tensor, n: int, top_k: int, entropy: bool) -> HostRows:
    """The fields of ``buf`` (the layout of the module docstring) as views."""
    if buf.numel() != n * (2 + entropy + 2 * top_k):
        raise ValueError(f"a buffer of {buf.numel()} words does not hold {n} rows, top-k {top_k}, entropy {entropy}")
    lp, ranks, off = buf[:n].view(torch.float32), buf[n:2 * n].long(), 2 * n
    ent = None
    if entropy:
        ent, off = buf[off:off + n].view(torch.float32), off + n
    ids = tlp = None
    if top_k:
        m = n * top_k
        ids = buf[off:off + m].long().view(n, top_k)
        tlp = buf[off + m:off + 2 * m].view(torch.float32).view(n, top_k)
    return HostRows(lp, ranks, ent, ids, tlp)

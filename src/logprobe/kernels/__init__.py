"""GPU kernels (Triton). Each has a thin typed wrapper and a pure-PyTorch reference it is tested against.

Importing this package never fails: ``triton_available()`` says whether the kernels can run.
"""

from __future__ import annotations

import array
import functools
import os


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # any import failure (missing, broken CUDA libs) means: use the PyTorch path
        return False
    return True


def interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``): kernels run on CPU tensors, slowly."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def host_tensor(values, dtype):
    """A flat list of host numbers as a CPU tensor of ``dtype``, through a typed ``array`` where
    one holds them (a 131k-id list: 1.6 ms against 5.7 ms for ``torch.tensor`` on the 2-core CI
    machine); anything else (nested
    lists, floats for an integer dtype, empty) as ``torch.tensor`` makes it.

        >>> import torch
        >>> host_tensor([0, 3, 5], torch.int64), host_tensor([[1, 2]], torch.int64)
        (tensor([0, 3, 5]), tensor([[1, 2]]))
    """
    import torch

    code = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}.get(dtype)
    if code is not None and isinstance(values, list) and values:
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass
    return torch.tensor(values, dtype=dtype)


def host_values_to(values, dtype, device):
    """Host values (a list, or a CPU tensor) as a tensor of ``dtype`` on ``device``. To CUDA through
    pinned memory without blocking: ``torch.tensor(values, device="cuda")`` copies from pageable
    memory and waits for the GPU to drain first, a host synchronisation that exposes every launch
    after it (PyTorch keeps the pinned block until the copy is done).

        >>> import torch
        >>> host_values_to([0, 3, 5], torch.int64, "cpu").tolist()
        [0, 3, 5]
    """
    import torch

    t = values.to(dtype) if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():  # a graph would copy from this block at every replay
        raise RuntimeError("a host-to-device copy while capturing a CUDA graph: its replays would read the "
                           "pinned block after it was freed (engine.graphs runs such a pass eagerly)")
    return t.pin_memory().to(device, non_blocking=True)


"""GPU kernels (Triton). Each has a thin typed wrapper and a pure-PyTorch reference it is tested against.

Importing this package never fails: ``triton_available()`` says whether the kernels can run.
"""

from __future__ import annotations

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

    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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

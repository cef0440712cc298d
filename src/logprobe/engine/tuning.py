"""Which kernel tuning tables an engine binds (``kernels.tuning``): on CUDA with Triton, the
shipped tables and the persistent cache of ``EngineConfig.tuning_cache``; nothing on CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import EngineConfig
from ..kernels import triton_available
from ..kernels.tuning import KernelTuning, default_cache_dir


def start_tuning(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> KernelTuning | None:
    """The tuning bound for ``model`` on ``device`` (its ``autotuned_modules`` imported first), or
    None where nothing is autotuned (CPU, no Triton)."""
    if device.type != "cuda" or not triton_available():
        return None
    cache = config.tuning_cache
    folder = None if cache is False else default_cache_dir() if cache is True else Path(cache).expanduser()
    name = torch.cuda.get_device_name(device)
    return KernelTuning(name, folder, tuple(getattr(model, "autotuned_modules", ()))).start()

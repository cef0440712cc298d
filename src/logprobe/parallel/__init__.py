"""Tensor and data parallelism, the low floor: rank arithmetic (``shard``) and a rank's group and
collectives (``context``). The processes that own workers live in ``executor``. Model code sees
ranks only through the parallel layers of ``layers/``."""

from .context import ParallelContext

__all__ = ["ParallelContext"]

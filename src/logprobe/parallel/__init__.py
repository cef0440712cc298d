"""Tensor and data parallelism: rank arithmetic (``shard``), a rank's group and collectives
(``context``), worker processes owned by the library (``workers``) and the engine that drives
them (``engine``). Model code sees ranks only through the parallel layers of ``layers/``."""

from .context import ParallelContext

__all__ = ["ParallelContext"]

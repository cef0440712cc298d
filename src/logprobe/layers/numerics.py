"""How a model's layers learn the numerics mode: one frozen ``config.Numerics``, handed down.

A layer whose arithmetic depends on the mode (fixed row tiles, column blocks, Triton or PyTorch
elementwise ops) is a ``NumericsUser`` and reads ``self.numerics``; nothing else is ever written
into it. The engine derives the object once per config (``config.numerics_for``) and hands it to
the model before a forward pass; the model rewrites its layers' reference only when the object
differs from the one they hold, so an unchanged config costs one comparison per pass.

Why set it when it changes rather than pass it with every call: ``Linear.forward(x)`` is the one
interface of dense, packed and parallel layers alike, and threading an argument through each of
them (and through the hooks) would change every layer's signature for a value that changes only
with the config. Several engines may share one model (``compare``, tests, a default and a
deterministic ``Scorer`` on one ``LoadedModel``): each hands its own object before each of its
passes, and passes never interleave (one model runs one forward at a time), so every pass runs
under the numerics of the engine that launched it.

    >>> from torch import nn
    >>> from logprobe.config import EngineConfig, numerics_for
    >>> from logprobe.layers.linear import Linear
    >>> class Tiny(NumericsUser, nn.Module):
    ...     pass
    >>> m = Tiny(); m.proj = Linear(4, 4)
    >>> m.set_numerics(numerics_for(EngineConfig(deterministic=True), "cpu"))
    >>> m.proj.numerics.row_tile
    128
"""

from __future__ import annotations

from ..config import Numerics


class NumericsUser:
    """A layer that computes according to ``self.numerics`` (the class default: not deterministic,
    Triton elementwise ops on CUDA). A model's root calls ``set_numerics`` on itself."""

    numerics: Numerics = Numerics()

    def set_numerics(self, numerics: Numerics) -> None:
        """Hand ``numerics`` to this module and every ``NumericsUser`` below it, unless it already
        holds an equal one."""
        if numerics == self.numerics:
            return
        for m in self.modules():  # type: ignore[attr-defined]  (a mixin of nn.Module classes)
            if isinstance(m, NumericsUser):
                m.numerics = numerics


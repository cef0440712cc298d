"""``ModelCaps``: what a model family can do, stated once on its class and read by the engine,
the scorer, the CLI and the server (a module without ``caps`` gets the defaults).

>>> ModelCaps.of(object())
ModelCaps(context=False, hooks=False, tensor_parallel=True, state_align=1, deterministic=False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelCaps:
    context: bool = False  # shared-prefix segments and chunk KV caches (see layers.attention.AttentionMeta)
    hooks: bool = False  # steering and capture at the points of interp.points
    tensor_parallel: bool = True  # deterministic mode keeps its bits equal across TP sizes
    # a sequence may be cut (chunks, shared prefixes) only at multiples of this many rows from its
    # start without changing a bit: 64 for the chunked linear attention of the hybrid families
    state_align: int = 1
    # deterministic mode without context: each request runs alone in its own forward, so its bits
    # cannot depend on the batch (the transformers backend); models with context have it anyway
    deterministic: bool = False

    @staticmethod
    def of(model) -> ModelCaps:
        """``model.caps``, or the defaults for a module that states none."""
        caps = getattr(model, "caps", None)
        return caps if isinstance(caps, ModelCaps) else ModelCaps()

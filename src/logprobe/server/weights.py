"""The served weights: their version, and their replacement from disk between engine steps.

``ServedWeights.load(path)`` runs ``Scorer.load_weights(path)`` inside ``Batcher.exclusive``: new
requests wait in the queue, requests already started finish on the old weights, the engine step
under way ends, the weights are swapped, and the queue resumes on the new ones. So every request
is computed under one version, and its reply says which (``weights_version``, the batcher's tag
of the moment it started):

    t ->   [req A: old weights] [swap, version 1 -> 2] [req B: new weights]
           B arrived during A: it waited, and answers weights_version 2

Each version also has a name, SGLang's ``weight_version`` (a string): the one the update gave,
else the count as a string (``"0"`` at load). ``name(version)`` gives it for a reply's version, so
a request that started before an update answers the old name, as it answers the old number.

A checkpoint that cannot be loaded changes nothing (``Scorer.load_weights`` keeps the old weights
when it fails): the caller gets its message as a ``LogprobeError`` naming ``model_path``.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import LogprobeError
from ..scorer import Scorer
from .batcher import Batcher

log = logging.getLogger("logprobe.server")


class ServedWeights:
    def __init__(self, scorer: Scorer, batcher: Batcher, weight_sync_timeout: float = 300.0) -> None:
        self.scorer = scorer
        self.batcher = batcher
        self.weight_sync_timeout = weight_sync_timeout  # s a weight group's receive may take
        batcher.tag = self._scorer_version()
        self._names = {batcher.tag: str(getattr(scorer, "weight_version", batcher.tag))}

    @property
    def version(self) -> int:
        """The version new requests will be computed under (the one of the last completed swap)."""
        return self.batcher.tag

    def name(self, version: int) -> str:
        """The ``weight_version`` string of ``version`` (one the batcher stamped on a job)."""
        return self._names.get(version, str(version))

    @property
    def weight_version(self) -> str:
        """The name of the weights new requests will be computed under."""
        return self.name(self.version)

    def _scorer_version(self) -> int:
        return int(getattr(self.scorer, "weights_version", 0))

    def load(self, path: str, weight_version: str | None = None, in_place: bool = False) -> int:
        """Swap in the checkpoint at ``path`` between engine steps; returns the new version, named
        ``weight_version`` (default: the version as a string). Blocking (call it from a worker thread).
        ``in_place``: ``Scorer.load_weights(..., in_place=True)`` (workers copy in as they go)."""
        if not os.path.exists(path):
            raise LogprobeError("model_path", f"{path!r} does not exist on the server",
                                "give a local checkpoint path the server can read")
        if not hasattr(self.scorer, "load_weights"):
            raise LogprobeError("model_path", "this logprobe cannot load weights into a running model",
                                "update logprobe")
        return self.batcher.exclusive(lambda: self._swap(path, weight_version, in_place))

    def _swap(self, path: str, weight_version: str | None = None, in_place: bool = False) -> int:
        kw = {**({} if weight_version is None else {"weight_version": weight_version}),
              **({"in_place": True} if in_place else {})}  # only what is asked: a scorer without the options still loads
        try:
            self.scorer.load_weights(path, **kw)
        except LogprobeError as e:
            raise LogprobeError("model_path", f"{path!r} was not loaded: {e}", self._still()) from e
        except torch.OutOfMemoryError:
            raise  # 503: the server, not the checkpoint
        except Exception as e:  # noqa: BLE001 - a file the readers refused (e.g. SafetensorError: truncated)
            log.warning("update_weights_from_disk %r failed: %r", path, e)
            raise LogprobeError("model_path", f"{path!r} was not loaded: {type(e).__name__}: {e}",
                                self._still()) from e
        version = self._scorer_version()
        self._names[version] = str(getattr(self.scorer, "weight_version", version))
        return version

    def _still(self) -> str:
        """What a failed update left served: the old weights, or (written part way in place) nothing."""
        if getattr(getattr(self.scorer, "executor", None), "weights_refusal", None) is not None:
            return "scoring is refused until an update completes"
        return f"weights_version {self._scorer_version()} is still served"

    # -- weights pushed over a collective (SGLang's update_weights_from_distributed) -----------

    def join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, in_place: bool = False) -> None:
        """``Scorer.init_weights_update_group``; blocking (until every rank joined). Scoring goes on.
        The group's receives are bounded by ``weight_sync_timeout``. ``in_place``: each bucket is
        written as it comes (scoring answers 503 until the round completes)."""
        if not hasattr(self.scorer, "init_weights_update_group"):
            raise LogprobeError("backend", "this scorer cannot join a weight update group", "update logprobe")
        kw = dict(in_place=True) if in_place else {}
        self.scorer.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                              group_name=group_name, backend=backend,
                                              receive_timeout=self.weight_sync_timeout, **kw)

    def update_from_group(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                          weight_version: str | None = None) -> tuple[int | None, tuple[str, ...], bool]:
        """Receive every tensor the trainer broadcasts (scoring goes on, on the old weights), then
        apply them all between engine steps, as ``load`` swaps a checkpoint: a request under way
        finishes on the old weights, none is computed on a half-updated model. Returns the new
        version, the buffers it kept (``Scorer.kept_buffers``) and whether the bucket was written in
        place, or (None, (), False) while the buckets received so far do not cover the model (held);
        an ``in_place`` group's bucket is written between engine steps as it comes ((None, (), True)
        until the round's last: scoring answers 503 meanwhile). A
        refused update changes nothing: metadata the model cannot take, a receive that fails or
        times out (the group is then left: the scorer's error says so), a NaN (the group stays)."""
        if not hasattr(self.scorer, "receive_weights_from_distributed"):
            raise LogprobeError("names", "this scorer cannot receive weights over a collective", "update logprobe")
        got = self.scorer.receive_weights_from_distributed(names, dtypes, shapes, group_name, weight_version)
        if got.tensors is None:  # a bucket: held until every weight has come
            return None, (), False
        kept: list[str] = []  # read within the swap: a later update may change the scorer's
        version = self.batcher.exclusive(lambda: self._apply(got, group_name, kept))
        return (version if got.complete else None), tuple(kept), got.in_place

    def _apply(self, got, group_name: str, kept: list[str]) -> int:
        """The swap (its version becomes the batcher's tag); ``kept`` gets the buffers it kept."""
        try:
            if got.in_place:
                self.scorer.apply_received_weights(got.tensors, got.version, in_place=True, complete=got.complete,
                                                   kept=got.kept, group_name=group_name)
            else:
                self.scorer.apply_received_weights(got.tensors, got.version)
        except LogprobeError as e:
            still = "scoring is refused until an update completes" if got.in_place \
                else f"weights_version {self._scorer_version()} is still served"
            raise LogprobeError(e.field, f"the received weights were not applied: {e.problem}", still) from e
        version = self._scorer_version()
        self._names[version] = str(getattr(self.scorer, "weight_version", version))
        kept.extend(getattr(self.scorer, "kept_buffers", ()))
        return version

    def leave_group(self, group_name: str) -> None:
        if not hasattr(self.scorer, "destroy_weights_update_group"):
            raise LogprobeError("group_name", "this scorer has no weight update groups", "update logprobe")
        self.scorer.destroy_weights_update_group(group_name)

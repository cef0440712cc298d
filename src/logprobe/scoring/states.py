"""Hidden states of whole texts and the steering vectors trained from them, as functions of a
``ScoringContext`` and the executor that runs the requests.

Each text is read at its last token, which only sees the text itself:

    ids   : [BOS] The cat sat          capture blocks.{l}.resid_post at "sat", for every l
    state : float32 [len(layers), H]   per text; [len(texts), len(layers), H] for the call
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.request import ScoreRequest
from ..errors import LogprobeError
from ..interp.points import point_layer, resolve_points
from ..interp.specs import request_hooks
from ..interp.vectors import SteeringVector, check_method, direction_from_states
from ..io.text import check_text
from .inputs import check_length
from .options import HookSpecs
from .work import ScoringContext


def last_token_states(context: ScoringContext, executor, texts: Sequence[str], layers: Sequence[int],
                      field: str = "texts") -> torch.Tensor:
    """``Scorer.last_token_states``: ``blocks.{l}.resid_post`` at each text's last token."""
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise LogprobeError(field, "must be a non-empty list of texts")
    at = [f"blocks.{layer}.resid_post" for layer in layers]
    caps, _ = context.hook_specs(HookSpecs(capture=[{"at": at, "positions": "last", "reduce": "last"}]))
    tok = context.tokenizer
    requests = []
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise LogprobeError(f"{field}[{i}]", "must be a non-empty string")
        check_text(t, f"{field}[{i}]")
        ids = tok.encode(t)
        if tok.add_bos:
            ids = [tok.bos_id] + ids
        if len(ids) < 2:  # a request needs a scored token: its row is the last one read
            ids = [tok.prefix_id] + ids
        check_length(len(ids), f"{field}[{i}]", context.max_length)
        _, ca = request_hooks(caps, [], len(ids), len(ids) - 1)
        requests.append(ScoreRequest(ids, len(ids) - 1, capture=ca))
    results = executor.run(requests)
    return torch.stack([torch.stack([v[0] for v in r.captures]) for r in results])


def train_vector(context: ScoringContext, executor, positive: Sequence[str], negative: Sequence[str],
                 layers: Sequence[int] | None = None, method: str = "pca_diff") -> SteeringVector:
    """``Scorer.train_vector``: a direction per layer from the last-token states of both sides."""
    check_method(method)
    L = context.hook_layers
    layers = list(range(1, L)) if layers is None else [int(x) for x in layers]
    if not layers:
        raise LogprobeError("layers", "is empty", "name at least one layer")
    if method == "pca_diff" and len(positive) != len(negative):
        raise LogprobeError("negative", f"has {len(negative)} prompts, positive has {len(positive)}",
                            "pca_diff pairs positive[i] with negative[i]: give equally many")
    names = [resolve_points(f"blocks.{x}.resid_post", L)[0] if L else "" for x in layers]
    pos = last_token_states(context, executor, positive, layers, "positive")  # [n, layers, H]
    neg = last_token_states(context, executor, negative, layers, "negative")
    dirs = {point_layer(n): direction_from_states(pos[:, j], neg[:, j], method) for j, n in enumerate(names)}
    return SteeringVector(dirs, method)

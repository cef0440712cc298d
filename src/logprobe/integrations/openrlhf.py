"""OpenRLHF's reference model computed by logprobe: ``forward(sequences, action_mask, attention_mask)``.

Needs no OpenRLHF import at all (the layout is plain tensors), and ``import logprobe`` imports
nothing of it::

    from logprobe.integrations.openrlhf import LogprobeRefActor

    ref = LogprobeRefActor("path/to/reference", temperature=args.rollout.temperature, device="cuda")
    base_action_log_probs = ref(sequences, action_mask, attention_mask)        # [B, A] float32

What OpenRLHF computes (``openrlhf.models.Actor.forward``, 0.11.2): ``sequences`` /
``attention_mask`` [B, L] (positions ``cumsum(attention_mask) - 1``; or the rows' real tokens packed
back to back with ``packing_samples``, the same numbers), logits divided by the actor's
``temperature``, ``log_probs[:, i]`` = log p(sequences[:, i + 1] | sequences[:, :i + 1]) for
i < L - 1, then ``log_probs[:, -A:] * action_mask`` with ``action_mask`` [B, A]: column j belongs
to sequence column L - A + j. OpenRLHF's rollouts make A = L - 1 (``action_mask =
mask[1:truncate_length]``: every token but the first has a column, 1 on the generated ones)::

    col            0   1   2   3   4   5        action_mask (A = 5: columns 1..5)   out[b]
    row 0          p0  p1  a0  a1  .   .        0 1 1 0 0                           [0, lp(a0|p0 p1), lp(a1|..a0), 0, 0]
    row 1          p0  a0  o0  a1  a2  .        1 0 1 1 0   (o0: an observation)   [lp(a0|p0), 0, lp(a1|..o0), lp(a2|..a1), 0]

That is ``Scorer.logprobs_padded(sequences, attention_mask, action_mask, temperature=T)``: 0 where
``action_mask`` is 0, as OpenRLHF's product leaves it. A 1 in ``action_mask`` on a padding token
(attention 0) is an error here (OpenRLHF would multiply the logits of a padding position).
``packed_seq_lens`` is accepted and unused, as in OpenRLHF (packing is read from
``attention_mask``); ``return_output``, entropy and ring attention are not offered (no logits).
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from ..scorer import Scorer


class LogprobeRefActor:
    """A reference actor whose ``forward`` returns what ``openrlhf.models.Actor.forward`` returns
    for ``(sequences, action_mask, attention_mask)``: [B, A] float32 action log-probs."""

    def __init__(self, model_path: str | None = None, *, temperature: float = 1.0, scorer: Scorer | None = None,
                 **scorer_kwargs) -> None:
        if (model_path is None) == (scorer is None):
            raise LogprobeError("model_path", "give a model path or a Scorer, not both or neither")
        self.scorer = scorer if scorer is not None else Scorer(model_path, **scorer_kwargs)
        self.temperature = temperature

    def forward(self, sequences: torch.Tensor, action_mask: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, return_output: bool = False,
                packed_seq_lens: list[int] | None = None, **unsupported) -> torch.Tensor:
        """[B, A] log-probs of the actions (the module docstring draws the layout)."""
        if action_mask is None:
            raise LogprobeError("action_mask", "is required", "a reference actor returns action log-probs [B, A]")
        if attention_mask is None:
            raise LogprobeError("attention_mask", "is required", "OpenRLHF passes one with every batch")
        if return_output:
            raise LogprobeError("return_output", "is not offered", "logprobe returns log-probs, not logits")
        if given := [k for k, v in unsupported.items() if v is not None and v is not False
                                 and not (isinstance(v, dict | list) and not v)]:
            raise LogprobeError("forward", f"does not take {', '.join(sorted(given))}",
                                "ring attention, entropy and multimodal inputs are not supported")
        return self.scorer.logprobs_padded(sequences, attention_mask, action_mask,
                                           temperature=self.temperature).logprobs

    __call__ = forward

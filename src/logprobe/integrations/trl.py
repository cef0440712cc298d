"""TRL's GRPO trainer with its reference-policy log-probs computed by logprobe.

Importing this module imports TRL (``import logprobe`` never does)::

    from trl import GRPOConfig
    from logprobe.integrations.trl import LogprobeRefGRPOTrainer

    trainer = LogprobeRefGRPOTrainer(
        model="path/to/policy", reward_funcs=reward_fn, train_dataset=prompts,
        args=GRPOConfig(output_dir="out", beta=0.04, temperature=0.7),
        ref_model_path="path/to/reference",              # any model logprobe loads (HF dir, .gguf, known name)
        ref_scorer_kwargs={"device": "cuda", "dtype": "bfloat16"})
    trainer.train()

What TRL computes (``GRPOTrainer._get_per_token_logps_and_entropies`` with its fused LM head,
trl 1.16): ``input_ids`` / ``attention_mask`` [B, L] are the left-padded prompt followed by the
right-padded completion; the last ``logits_to_keep`` = K columns are the completion region; the
answer [B, K] holds at column j log p(input_ids[:, L-K+j] | the real tokens before it) of
``log_softmax(logits / temperature)`` (``GRPOConfig.temperature``), and 0 where
``attention_mask`` is 0 (TRL sets those labels to -100). Example, L = 6, K = 3::

    col         0   1   2 | 3   4   5        attention (last K)   out[b]
    row 0       .   p0  p1| c0  c1  .        1 1 0                [lp(c0|p0 p1), lp(c1|p0 p1 c0), 0]
    row 1       p0  p1  p2| c0  c1  c2       1 1 1                [lp(c0|p0..p2), lp(c1|..c0), lp(c2|..c1)]

That is ``Scorer.logprobs_padded(input_ids, attention_mask, num_response_tokens=K,
temperature=T)``, which this trainer returns in place of TRL's reference forward pass.

How it plugs in: TRL builds a second Hugging Face copy of the policy as ``ref_model`` when
``beta != 0``. This subclass hands TRL ``beta = 0`` during its constructor (so TRL loads no
reference copy, and makes no PEFT "ref" adapter), restores ``beta`` afterwards, and sets
``self.ref_model`` to a :class:`LogprobeReference` holding a ``logprobe.Scorer`` on
``ref_model_path``; ``_get_per_token_logps_and_entropies`` answers for that object and hands
every other model (the policy) to TRL. Refused: ``beta == 0`` (no reference is computed),
``sync_ref_model=True`` (TRL would copy the policy into the reference: use
``Scorer.update_weights`` yourself), multimodal inputs.
"""

from __future__ import annotations

import torch
from trl import GRPOConfig, GRPOTrainer

from ..errors import LogprobeError
from ..scorer import Scorer


class LogprobeReference:
    """The reference policy as TRL sees it: a ``logprobe.Scorer`` in ``GRPOTrainer.ref_model``."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def per_token_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        temperature: float, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, K] log-probs (and entropies) of the last K columns, 0 where attention_mask is 0,
        on ``input_ids``' device (the module docstring draws the layout)."""
        out = self.scorer.logprobs_padded(input_ids, attention_mask, num_response_tokens=int(logits_to_keep),
                                          temperature=float(temperature), entropy=entropy)
        return out.logprobs, out.entropy


def check_reference_args(args: GRPOConfig | None) -> float:
    """The ``beta`` the reference is for; the settings this trainer cannot honour are errors."""
    if args is None or not args.beta:
        raise LogprobeError("args.beta", "is 0: GRPO computes no reference log-probs",
                            "pass GRPOConfig(beta=...) > 0, or use trl.GRPOTrainer")
    if args.sync_ref_model:
        raise LogprobeError("args.sync_ref_model", "is not supported with a logprobe reference",
                            "call trainer.ref_model.scorer.update_weights(...) yourself")
    return args.beta


class LogprobeRefGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose reference log-probs come from ``logprobe.Scorer(ref_model_path,
    **ref_scorer_kwargs)``; every other argument is GRPOTrainer's."""

    def __init__(self, *args, ref_model_path: str, ref_scorer_kwargs: dict | None = None, **kwargs) -> None:
        grpo_args = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        beta = check_reference_args(grpo_args)
        grpo_args.beta = 0.0  # TRL builds no reference model of its own
        try:
            super().__init__(*args, **kwargs)
        finally:
            grpo_args.beta = beta
        self.beta = beta
        self.ref_model = LogprobeReference(Scorer(ref_model_path, **(ref_scorer_kwargs or {})))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        if not isinstance(model, LogprobeReference):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        if given := [k for k, v in multimodal.items() if v is not None]:
            raise LogprobeError("GRPOTrainer inputs", f"carry {', '.join(given)}: multimodal references are not "
                                "supported", "use a text-only dataset")
        logps, entropy = model.per_token_logps(input_ids, attention_mask, logits_to_keep, self.temperature,
                                               compute_entropy)
        return logps, entropy, None

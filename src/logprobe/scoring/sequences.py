"""Token ids (reinforcement learning): ``Scorer.logprobs_job`` and the padded/packed batches as
functions of a ``ScoringContext``.

A sequence's request is its prompt and completion ids back to back, scored from the last prompt
row on, so there is one log-prob per completion token:

    ids  : p0 p1 p2 | c0 c1 c2          ScoreRequest([p0 p1 p2 c0 c1 c2], score_begin=3)
    row 2 -> c0, row 3 -> c1, row 4 -> c2

Padded and packed batches become the same requests through a ``scoring.padded.Plan``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..interp.specs import CaptureSpec, SteerSpec, capture_results, request_hooks
from .inputs import check_length
from .options import HeadOptions, HookSpecs
from .padded import Plan, gather_results, plan_requests
from .results import SequenceLogprobs
from .work import Job, ScoringContext


def logprobs_job(context: ScoringContext, sequences: Sequence[dict], head: HeadOptions = HeadOptions(),
                 hooks: HookSpecs = HookSpecs()) -> Job:
    """``Scorer.logprobs_job``: one request per ``{"prompt_token_ids", "completion_token_ids"}``."""
    head = head.checked()
    if isinstance(sequences, (str, bytes, dict)) or not isinstance(sequences, Sequence) or not sequences:
        raise LogprobeError("sequences", "must be a non-empty list of objects with prompt_token_ids and "
                            "completion_token_ids")
    caps, steers = context.hook_specs(hooks)
    requests = [sequence_request(context, seq, i, head, caps, steers) for i, seq in enumerate(sequences)]
    return Job(requests, lambda results: [sequence_result(r, res, caps) for r, res in zip(requests, results)])


def sequence_result(req: ScoreRequest, r: RequestResult, caps: list[CaptureSpec]) -> SequenceLogprobs:
    return SequenceLogprobs(r.logprobs, r.ranks, r.entropy, r.topk_ids, r.topk_logprobs,
                            capture_results(caps, req.capture, r.captures) if caps else None)


def sequence_request(context: ScoringContext, seq: dict, i: int, head: HeadOptions,
                     caps: list[CaptureSpec] = (), steers: list[SteerSpec] = ()) -> ScoreRequest:
    """Validate sequence ``i`` and turn it into a request (``head`` already checked)."""
    if not isinstance(seq, dict):
        raise LogprobeError(f"sequences[{i}]", "must be an object with prompt_token_ids and completion_token_ids")
    prompt = context.check_ids(seq.get("prompt_token_ids"), f"sequences[{i}].prompt_token_ids")
    completion = context.check_ids(seq.get("completion_token_ids"), f"sequences[{i}].completion_token_ids")
    if not prompt:
        raise LogprobeError(f"sequences[{i}].prompt_token_ids", "is empty: the first completion token needs "
                            "a context", "prepend the BOS (or EOS) token id")
    if not completion:
        raise LogprobeError(f"sequences[{i}].completion_token_ids", "is empty", "give at least one token")
    check_length(len(prompt) + len(completion), f"sequences[{i}]", context.max_length)
    st, ca = request_hooks(list(caps), list(steers), len(prompt) + len(completion), len(prompt),
                           f"sequences[{i}]: ", deterministic=context.deterministic)
    return ScoreRequest(prompt + completion, len(prompt), head.temperature, head.top_k, head.entropy, st, ca)


def aligned_job(context: ScoringContext, plan: Plan, input_ids: torch.Tensor, head: HeadOptions) -> Job:
    """The requests of a padded or packed ``plan``; the answer is in the trainer's layout, on
    ``input_ids``' device (``scoring.padded.gather_results``)."""
    head = head.checked()
    if not isinstance(head.entropy, bool):
        raise LogprobeError("entropy", f"must be true or false, got {head.entropy!r}")
    requests = plan_requests(plan, input_ids, context.vocab_size, context.max_length, head)
    device = input_ids.device
    return Job(requests, lambda results: gather_results(results, plan, device, head.entropy, head.top_k))

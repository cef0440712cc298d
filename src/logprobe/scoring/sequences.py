"""Token ids (reinforcement learning): ``Scorer.logprobs_job`` and the padded/packed batches as
functions of a scorer.

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
from .inputs import check_length, check_options
from .job import Job, ScorerParts
from .padded import Plan, gather_results, plan_requests
from .results import SequenceLogprobs


def logprobs_job(scorer: ScorerParts, sequences: Sequence[dict], temperature: float = 1.0, top_k: int = 0,
                 entropy: bool = False, capture: Sequence[dict] | None = None,
                 steer: Sequence[dict] | None = None) -> Job:
    """``Scorer.logprobs_job``: one request per ``{"prompt_token_ids", "completion_token_ids"}``."""
    temperature, top_k = check_options(temperature, top_k)
    if isinstance(sequences, (str, bytes, dict)) or not isinstance(sequences, Sequence) or not sequences:
        raise LogprobeError("sequences", "must be a non-empty list of objects with prompt_token_ids and "
                            "completion_token_ids")
    caps, steers = scorer.hook_specs(capture, steer)
    requests = [sequence_request(scorer, seq, i, temperature, top_k, entropy, caps, steers)
                for i, seq in enumerate(sequences)]
    return Job(requests, lambda results: [sequence_result(r, res, caps) for r, res in zip(requests, results)])


def sequence_result(req: ScoreRequest, r: RequestResult, caps: list[CaptureSpec]) -> SequenceLogprobs:
    return SequenceLogprobs(r.logprobs, r.ranks, r.entropy, r.topk_ids, r.topk_logprobs,
                            capture_results(caps, req.capture, r.captures) if caps else None)


def sequence_request(scorer: ScorerParts, seq: dict, i: int, temperature: float, top_k: int, entropy: bool,
                     caps: list[CaptureSpec] = (), steers: list[SteerSpec] = ()) -> ScoreRequest:
    """Validate sequence ``i`` and turn it into a request (``temperature`` / ``top_k`` already checked)."""
    if not isinstance(seq, dict):
        raise LogprobeError(f"sequences[{i}]", "must be an object with prompt_token_ids and completion_token_ids")
    prompt = scorer.check_ids(seq.get("prompt_token_ids"), f"sequences[{i}].prompt_token_ids")
    completion = scorer.check_ids(seq.get("completion_token_ids"), f"sequences[{i}].completion_token_ids")
    if not prompt:
        raise LogprobeError(f"sequences[{i}].prompt_token_ids", "is empty: the first completion token needs "
                            "a context", "prepend the BOS (or EOS) token id")
    if not completion:
        raise LogprobeError(f"sequences[{i}].completion_token_ids", "is empty", "give at least one token")
    check_length(len(prompt) + len(completion), f"sequences[{i}]", scorer.info.max_length)
    st, ca = request_hooks(list(caps), list(steers), len(prompt) + len(completion), len(prompt),
                           f"sequences[{i}]: ", exact_sums=scorer.config.deterministic)
    return ScoreRequest(prompt + completion, len(prompt), temperature, top_k, entropy, st, ca)


def aligned_job(scorer: ScorerParts, plan: Plan, input_ids: torch.Tensor, temperature: float, entropy: bool,
                top_k: int) -> Job:
    """The requests of a padded or packed ``plan``; the answer is in the trainer's layout, on
    ``input_ids``' device (``scoring.padded.gather_results``)."""
    temperature, top_k = check_options(temperature, top_k)
    if not isinstance(entropy, bool):
        raise LogprobeError("entropy", f"must be true or false, got {entropy!r}")
    requests = plan_requests(plan, input_ids, scorer.info.vocab_size, scorer.info.max_length, temperature, top_k,
                             entropy)
    device = input_ids.device
    return Job(requests, lambda results: gather_results(results, plan, device, entropy, top_k))

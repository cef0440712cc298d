"""Text continuations: ``Scorer.score_job`` and ``Scorer.loglikelihood_job`` as functions of a
``ScoringContext``.

Prompt and continuation are encoded jointly and split by ``scoring.contract``; the request scores
the continuation's tokens from the row of the last prompt token on:

    tokens : [The] [capital] [of] [France] [is] | [ĠParis]      score_begin = 5
    row 4 -> log p(ĠParis | The capital of France is)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..interp.specs import CaptureSpec, capture_results, request_hooks
from ..io.text import check_text
from ..tokenizer import Tokenizer
from .contract import split_continuation
from .inputs import check_length
from .options import HeadOptions, HookSpecs
from .results import ContinuationScore
from .stats import exp_or_inf
from .work import Job, ScoringContext


def score_job(context: ScoringContext, prompt: str, continuations: str | Sequence[str],
              head: HeadOptions = HeadOptions(), hooks: HookSpecs = HookSpecs(), images=None) -> Job:
    """``Scorer.score_job``: one request per continuation after ``prompt``. ``images`` (a model with
    a vision tower): the prompt's, one placeholder each in it (``scoring.images``); each request
    has them, their tokens expanded in its context (the images processed once for all)."""
    if isinstance(continuations, str):
        continuations = [continuations]
    if not isinstance(prompt, str):
        raise LogprobeError("prompt", f"must be a string, got {type(prompt).__name__}")
    check_text(prompt, "prompt")
    if not continuations:
        raise LogprobeError("continuations", "is empty", "give at least one continuation")
    head = head.checked()
    caps, steers = context.hook_specs(hooks)
    given = None if images is None else prompt_images(context, prompt, images)
    requests, texts = [], []
    n_spaces = len(prompt) - len(prompt.rstrip())
    for i, c in enumerate(continuations):
        if not isinstance(c, str):
            raise LogprobeError("continuations", f"must be strings, got {type(c).__name__}")
        check_text(c, f"continuations[{i}]")
        ctx, cont = split(context.tokenizer, prompt, c)
        img = None
        if given is not None:
            ctx, img = with_images(context, ctx, cont, given, f"continuations[{i}]")
        check_length(len(ctx) + len(cont), "prompt + continuation", context.max_length)
        st, ca = request_hooks(caps, steers, len(ctx) + len(cont), len(ctx),
                               f"continuations[{i}]: " if len(continuations) > 1 else "",
                               deterministic=context.deterministic)
        requests.append(ScoreRequest(ctx + cont, len(ctx), head.temperature, head.top_k, head.entropy, st, ca,
                                     images=img))
        texts.append((prompt[len(prompt) - n_spaces:] if n_spaces else "") + c)  # the moved whitespace
    tokenizer = context.tokenizer
    return Job(requests, lambda results: [continuation_score(tokenizer, t, r, res, caps)
                                          for t, r, res in zip(texts, requests, results)])


def prompt_images(context: ScoringContext, prompt: str, images) -> tuple:
    """(pixel values, grids) of a text prompt's images, one placeholder each in it."""
    reader = context.check_images("images")
    if not isinstance(images, (list, tuple)) or not images:
        raise LogprobeError("images", "must be a non-empty list of images")
    mark = reader.placeholder
    if prompt.count(mark) != len(images):
        raise LogprobeError("images", f"{len(images)} images for {prompt.count(mark)} {mark} placeholders in the "
                            "prompt", f"write {mark} once per image, where it stands")
    return reader.patches(list(images), "images")


def with_images(context: ScoringContext, ctx: list[int], cont: list[int], given: tuple, field: str):
    """A continuation's context ids with each placeholder expanded to its image's tokens, and the
    request's ``ImageInputs``: (ids, images). Only text is scored: a placeholder in the
    continuation is refused by name."""
    reader = context.images
    pixels, grids = given
    marks = {reader.image_token_id, reader.tokenizer.hf.convert_tokens_to_ids(reader.placeholder)}
    if marks & set(cont):
        raise LogprobeError(field, f"holds the image placeholder {reader.placeholder}: only text is scored",
                            "put the images in the prompt")
    ctx = reader.expand(ctx, grids, "images")
    return ctx, reader.inputs(ctx + cont, pixels, grids, "images")


def loglikelihood_job(context: ScoringContext, pairs: Sequence[tuple[str, str]]) -> Job:
    """``Scorer.loglikelihood_job``: ``(log p(continuation | context), is_greedy)`` per pair."""
    requests = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise LogprobeError(f"pairs[{i}]", "must be a (context, continuation) pair of strings")
        check_text(pair[0], f"pairs[{i}][0]"), check_text(pair[1], f"pairs[{i}][1]")
        ctx, cont = split(context.tokenizer, pair[0], pair[1])
        check_length(len(ctx) + len(cont), f"pairs[{i}]", context.max_length)
        requests.append(ScoreRequest(ctx + cont, len(ctx)))
    return Job(requests, lambda results: [(float(r.logprobs.double().sum()), bool((r.ranks == 0).all()))
                                          for r in results])


def split(tokenizer: Tokenizer, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids under ``tokenizer`` (``scoring.contract.split_continuation``)."""
    tok = tokenizer
    return split_continuation(prompt, continuation, tok.encode, tok.prefix_id, tok.add_bos, tok.bos_id)


def continuation_score(tokenizer: Tokenizer, text: str, req: ScoreRequest, res: RequestResult,
                       caps: list[CaptureSpec] = ()) -> ContinuationScore:
    """One continuation's answer from its request and result; ``text`` as the caller gave it."""
    ids = req.tokens[req.score_begin:]
    lps = res.logprobs.tolist()
    total = float(res.logprobs.double().sum())
    top = None
    if res.topk_ids is not None:
        texts = tokenizer.token_texts(res.topk_ids.flatten().tolist())
        k = res.topk_ids.shape[1]
        top = [[(int(i), texts[r * k + c], float(lp)) for c, (i, lp) in enumerate(zip(ids_row, lp_row))]
               for r, (ids_row, lp_row) in enumerate(zip(res.topk_ids.tolist(), res.topk_logprobs.tolist()))]
    return ContinuationScore(
        continuation=text, log_prob=total, prob=exp_or_inf(total), perplexity=exp_or_inf(-total / len(ids)),
        num_tokens=len(ids), is_greedy=bool((res.ranks == 0).all()), tokens=tokenizer.token_texts(ids),
        token_ids=ids, token_logprobs=lps, entropy=res.entropy.tolist() if res.entropy is not None else None,
        top_k=top, captures=capture_results(list(caps), req.capture, res.captures) if caps else None)

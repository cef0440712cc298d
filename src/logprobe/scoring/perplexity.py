"""Perplexity: ``Scorer.perplexity_job`` as a function of a ``ScoringContext``.

Each text is one token stream (with the prefix token first when ``prefix`` is on), cut into
windows by ``scoring.windows``; each window is one request, and a text's NLLs are its windows'
scored log-probs in order. Hook positions count the text's own tokens and are moved into each
window's local positions:

    stream  : [BOS] t0 t1 t2 t3 t4          steer "positions": [1, 2] -> stream positions 2, 3
    windows : [BOS t0 t1 t2] [t1 t2 t3 t4]  (sliding, context 4, stride 2; begins 0 and 2)
    steered : window 0 at 2, 3; window 1 at 0, 1 (every window that feeds the token)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..engine.delivery import join_pieces
from ..engine.request import CaptureAt, ScoreRequest, SteerAt
from ..errors import LogprobeError
from ..interp.specs import capture_results, request_hooks
from ..io.text import check_text
from .inputs import check_length
from .options import HookSpecs, Windows
from .results import PerplexityResult
from .stats import count_words, exp_or_inf, mean_and_stderr
from .windows import make_windows
from .work import Job, ScoringContext


def perplexity_job(context: ScoringContext, texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                   windows: Windows = Windows(), hooks: HookSpecs = HookSpecs(),
                   return_token_nlls: bool = False) -> Job:
    """``Scorer.perplexity_job``: the windows of every text as requests, one ``PerplexityResult``."""
    caps, steers = context.hook_specs(hooks)
    streams, raw_texts = perplexity_streams(context, texts, windows.max_tokens)
    w = windows.resolved(context.max_length)
    check_length(w.context_length, "context_length", context.max_length)
    requests, owners = [], []
    text_hooks = []  # per text: its whole-stream CaptureAt and prefix offset, to rejoin the windows' pieces
    for t, ids in enumerate(streams):
        name = "texts" if len(streams) == 1 and texts and isinstance(texts[0], int) else f"texts[{t}]"
        reqs, w_captures, text_hook = _text_requests(context, t, ids, name, len(streams), w, caps, steers)
        requests += reqs
        owners += [(t, wc) for wc in w_captures]
        text_hooks.append(text_hook)
    if (scored := sum(r.num_scored for r in requests)) < 2:  # one NLL has no standard error (nan)
        raise LogprobeError(name if len(streams) == 1 else "texts", f"gives only {scored} scored token: a "
                            "perplexity and its standard error need at least 2", "give a longer text (or more texts)")
    finish = lambda results: perplexity_result(  # noqa: E731
        results, owners, len(streams), raw_texts, w.policy, w.context_length, w.stride, w.max_tokens,
        return_token_nlls, caps, text_hooks)
    return Job(requests, finish)


def _text_requests(context: ScoringContext, t: int, ids: list[int], name: str, n_streams: int, w: Windows,
                   caps, steers):
    """Text ``t``'s window requests under resolved windows ``w``, each window's ``CaptureAt``s, and
    ``(text CaptureAt, offset)``."""
    tok = context.tokenizer
    n_text = len(ids)
    if w.prefix:
        ids = [tok.prefix_id] + ids
    elif tok.add_bos:
        ids = [tok.bos_id] + ids
    off = len(ids) - n_text
    if len(ids) < 2:  # a one-token stream predicts nothing
        raise LogprobeError(name, f"has {n_text} token{'s' * (n_text != 1)}: perplexity needs at least one "
                            "scored token (the first token has no context)",
                            "give a longer text" + ("" if w.prefix else " or set prefix true"))
    st, ca = request_hooks(caps, steers, n_text, 0, f"texts[{t}]: " if n_streams > 1 else "",
                           need_prompt=False, offset=off, deterministic=context.deterministic)
    try:
        windows = make_windows(w.policy, len(ids), w.context_length, w.stride)
    except LogprobeError as e:
        raise (LogprobeError(name, e.problem, e.fix) if e.field == "text" else e) from None
    requests, w_captures = [], []
    for wi, win in enumerate(windows):
        toks = ids[win.begin:win.end]
        if w.policy == "llama.cpp" and tok.add_bos:
            toks = [tok.bos_id] + toks[1:]  # llama-perplexity puts BOS first in every chunk
        w_steer = tuple(SteerAt(s.point, local, s.op, s.vector, s.coeff) for s in st
                        if (local := tuple(k - win.begin for k in s.positions if win.begin <= k < win.end)))
        lo = 0 if wi == 0 else win.score_begin  # tokens no window scores are read in the first
        w_capture = tuple(CaptureAt(c.point, tuple(k - win.begin for k in c.positions if lo <= k < win.end),
                                    c.kind, c.vector) for c in ca)
        requests.append(ScoreRequest(toks, win.score_begin - win.begin, steer=w_steer,
                                     capture=tuple(c for c in w_capture if c.positions)))
        w_captures.append(w_capture)
    return requests, w_captures, (ca, off)


def perplexity_result(results, owners, n_streams, raw_texts, policy, context_length, stride, max_tokens,
                      return_token_nlls, caps=(), text_hooks=()) -> PerplexityResult:
    """The answer of ``perplexity_job`` from its windows' results; ``owners[i]`` is ``(text,
    window CaptureAt)`` of request i."""
    per_text: list[list[float]] = [[] for _ in range(n_streams)]
    pieces = [[[] for _ in text_hooks[t][0]] for t in range(n_streams)] if caps else None
    for (t, w_capture), r in zip(owners, results):
        per_text[t].extend((-r.logprobs.double()).tolist())
        if pieces is not None:
            got = iter(r.captures or ())
            for k, c in enumerate(w_capture):
                if c.positions:
                    pieces[t][k].append(next(got))
    captures = None
    if pieces is not None:
        captures = [capture_results(list(caps), ca, [join_pieces(ps, c.kind) for ps, c in zip(pieces[t], ca)], off)
                    for t, (ca, off) in enumerate(text_hooks)]
    nlls = [x for text_nlls in per_text for x in text_nlls]
    mean, se = mean_and_stderr(nlls)
    total = math.fsum(nlls)
    out = PerplexityResult(
        perplexity=exp_or_inf(mean), perplexity_stderr=exp_or_inf(mean) * se, nll_mean=mean, nll_stderr=se,
        num_tokens=len(nlls), num_windows=len(results), policy=policy, context_length=context_length,
        stride=stride if policy == "sliding" else None,
        token_nlls=per_text if return_token_nlls else None, captures=captures)
    if raw_texts is not None and max_tokens is None:
        out.num_words = sum(count_words(t) for t in raw_texts)
        out.num_bytes = sum(len(t.encode("utf-8")) for t in raw_texts)
        out.word_perplexity = exp_or_inf(total / out.num_words)
        out.byte_perplexity = exp_or_inf(total / out.num_bytes)
        out.bits_per_byte = total / out.num_bytes / math.log(2)
    return out


def perplexity_streams(context: ScoringContext, texts, max_tokens) -> tuple[list[list[int]], list[str] | None]:
    """Token streams of ``texts`` (text, texts, ids, or lists of ids), cut to ``max_tokens``, and the
    raw texts (None for ids: no words or bytes to count)."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, Sequence) or isinstance(texts, bytes) or len(texts) == 0:
        raise LogprobeError("texts", "must be a non-empty text, list of texts, or token ids")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise LogprobeError("max_tokens", f"must be an integer >= 2, got {max_tokens!r}")
    if all(isinstance(t, str) for t in texts):
        for i, t in enumerate(texts):
            if not t.strip():
                raise LogprobeError(f"texts[{i}]", "is empty", "give some text to score")
            check_text(t, f"texts[{i}]")
        streams = context.tokenizer.encode_batch(list(texts))
        raw = list(texts)
    elif all(isinstance(t, int) for t in texts):
        streams, raw = [context.check_ids(texts, "texts")], None
    else:
        streams = [context.check_ids(t, f"texts[{i}]") for i, t in enumerate(texts)]
        raw = None
    if max_tokens is not None:
        streams = [s[:max_tokens] for s in streams]
    return streams, raw

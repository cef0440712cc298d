"""OpenAI ``/v1/completions`` for scoring: prompt log-probs (``echo``) and at most one greedy token.

The reply for ``prompt = "The capital of France is"``, ``echo: true``, ``max_tokens: 1``,
``logprobs: 1`` (tokens of the default model, which adds no BOS):

    tokens         : "The"  " capital"  " of"   " France"  " is"   " Paris"   <- the last one is generated
    token_logprobs : null   -11.539     -0.338  -2.439     -0.451  -0.258
    top_logprobs   : null   {"-": -0.865, " capital": -11.539}  ...          {" Paris": -0.258}
    text_offset    : 0      3           11      14         21      24
    row that scores:        0           1       2          3       4   (row i has read tokens 0..i)

The first prompt token has no context, hence ``null`` (OpenAI's convention). A tokenizer that adds
BOS puts it first (for text prompts): then every text token is scored. The generated token is
the argmax of the last prompt row (greedy, whatever ``temperature``); lm-evaluation-harness
drops it and sums ``token_logprobs[ctxlen:-1]``. ``top_logprobs[i]`` holds the ``logprobs`` most
likely tokens of position i **and** the scored token, with the scored token's own value, so
"scored == max(top)" holds exactly when the scored token is the argmax.
``text_offset[i]`` is the character offset of ``tokens[i]`` in the concatenation of ``tokens``.

vLLM's ``prompt_logprobs: k`` (with or without ``echo``) adds ``choices[i].prompt_logprobs``, one
entry per prompt token: ``null`` for the first, then ``{"<token id>": {"logprob", "rank",
"decoded_token"}}`` holding the prompt token itself first (its rank: 1 + how many tokens score
strictly higher, vLLM's rank when there are no ties) and the k most likely tokens (ranks 1..k);
k or k + 1 keys. What this relies on (vLLM's OpenAI server, not imported): the choice's
``prompt_logprobs: list[dict[int, Logprob] | None]``, JSON keys the ids as strings, ``Logprob`` =
``{logprob, rank, decoded_token}``, the prompt token inserted before the top-k (a duplicate keeps
one key), rank = how many vocabulary entries score at least as high (1-based). Where the top-k
value of a token and its own value differ in the last float32 bits (they are computed apart), the
token's own value is kept. For the prompt above, ``prompt_logprobs: 1``, entry 1 (row 0 scores " capital"):
``{"3575": {"logprob": -11.539, "rank": 2923, "decoded_token": " capital"}, "29": {"logprob": -0.866,
"rank": 1, "decoded_token": "-"}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..io.text import check_text
from ..scorer import Job, Scorer
from .schemas import CompletionRequest


@dataclass(slots=True)
class _Choice:
    ids: list[int]  # the prompt's tokens
    text: str  # the prompt as text
    request: int | None  # index of its ScoreRequest, None when nothing needs the model
    score_begin: int  # first token whose log-prob the request returns


def check_completion_options(body: CompletionRequest, max_top_logprobs: int) -> None:
    """Refuse what a scoring server cannot do, rather than silently doing something else."""
    if body.max_tokens not in (0, 1):
        raise LogprobeError("max_tokens", f"is {body.max_tokens}; this server scores text and generates at most "
                            "one token", "use max_tokens 0 (prompt log-probs only) or 1 (plus one greedy token)")
    if not body.echo and body.max_tokens == 0 and body.prompt_logprobs is None:
        raise LogprobeError("echo", "is false with max_tokens 0: there would be nothing to return",
                            "set echo true (or prompt_logprobs) for the prompt's log-probs")
    if body.n != 1 or body.best_of not in (None, 1):
        raise LogprobeError("n" if body.n != 1 else "best_of", "must be 1 (one greedy token at most)")
    if body.stream:
        raise LogprobeError("stream", "is not supported", "set stream false")
    if body.logit_bias:
        raise LogprobeError("logit_bias", "is not supported: it would change the log-probs", "leave it out")
    if body.presence_penalty or body.frequency_penalty:
        raise LogprobeError("presence_penalty" if body.presence_penalty else "frequency_penalty",
                            "is not supported", "leave it at 0")
    if body.suffix:
        raise LogprobeError("suffix", "is not supported", "leave it out")
    if body.logprobs is not None and body.logprobs > max_top_logprobs:
        raise LogprobeError("logprobs", f"{body.logprobs} is above this server's cap of {max_top_logprobs}",
                            f"ask for at most {max_top_logprobs} alternatives (the scored token is always "
                            "included), or use /v1/score or /v1/logprobs with top_k")
    if body.prompt_logprobs is not None and body.prompt_logprobs > max_top_logprobs:
        raise LogprobeError("prompt_logprobs", f"{body.prompt_logprobs} is above this server's cap of "
                            f"{max_top_logprobs}", f"ask for at most {max_top_logprobs} (the prompt token is "
                            "always included)")


def prompt_token_ids(prompt, scorer: Scorer, field: str = "prompt",
                     texts_wanted: bool = True) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt; text prompts get BOS when the model's tokenizer adds one.
    ``texts_wanted=False``: id prompts are not decoded (their text is ""; SGLang's /generate
    never returns it, and decoding a long prompt costs more than checking it)."""
    tok = scorer.tokenizer
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    ids_list, texts = [], []
    for i, p in enumerate(prompts):
        name = field if len(prompts) == 1 else f"{field}[{i}]"
        if isinstance(p, str):
            if not p:
                raise LogprobeError(name, "is empty", "give some text")
            check_text(p, name)
            ids = ([tok.bos_id] if tok.add_bos else []) + tok.encode(p)
            texts.append(p)
        else:
            if not p:
                raise LogprobeError(name, "is an empty list of token ids", "give at least one token id")
            ids = scorer.context.check_ids(p, name)
            texts.append(tok.decode(ids) if texts_wanted else "")
        ids_list.append(ids)
    return ids_list, texts


def completion_job(body: CompletionRequest, scorer: Scorer, model_name: str, max_top_logprobs: int) -> Job:
    check_completion_options(body, max_top_logprobs)
    for field in ("logprobs", "prompt_logprobs"):  # before the batch, not in the head
        if (getattr(body, field) or 0) > scorer.info.vocab_size:
            raise LogprobeError(field, f"{getattr(body, field)} is more than the model's {scorer.info.vocab_size} "
                                "tokens", f"ask for at most {scorer.info.vocab_size}")
    ids_list, texts = prompt_token_ids(body.prompt, scorer)
    gen = body.max_tokens == 1
    want_lp = body.logprobs is not None
    k = body.logprobs or 0
    pk = body.prompt_logprobs
    requests: list[ScoreRequest] = []
    choices: list[_Choice] = []
    many = len(ids_list) > 1
    for i, (ids, text) in enumerate(zip(ids_list, texts)):
        n = len(ids)
        if n + gen > scorer.info.max_length:
            raise LogprobeError(f"prompt[{i}]" if many else "prompt", f"{n} tokens (+{int(gen)} generated) exceed "
                                f"the model's context of {scorer.info.max_length}", "shorten the prompt")
        echo_rows = (body.echo and want_lp or pk is not None) and n >= 2
        if not gen and not echo_rows:
            choices.append(_Choice(ids, text, None, n))
            continue
        # a generated token needs the last prompt row: feed it by appending a placeholder target
        # (token 0) whose log-prob is discarded; the greedy token is that row's top-1
        tokens = ids + [0] if gen else ids
        score_begin = 1 if echo_rows else n
        top_k = max(k if want_lp else 0, pk or 0, 1 if gen else 0)
        choices.append(_Choice(ids, text, len(requests), score_begin))
        requests.append(ScoreRequest(tokens, score_begin, 1.0, top_k))

    def finish(results: list[RequestResult]) -> dict:
        out, completion_tokens = [], 0
        for i, c in enumerate(choices):
            res = results[c.request] if c.request is not None else None
            gen_id = int(res.topk_ids[-1, 0]) if gen else None
            completion_tokens += int(gen)
            text = (c.text if body.echo else "") + (scorer.tokenizer.decode([gen_id]) if gen else "")
            logprobs = _logprobs(c, res, gen_id, body.echo, k, scorer) if want_lp else None
            out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": "length"})
            if pk is not None:
                out[-1]["prompt_logprobs"] = prompt_logprobs(c, res, pk, scorer)
        prompt_tokens = sum(len(c.ids) for c in choices)
        cached = sum(results[c.request].cached_tokens for c in choices
                     if c.request is not None and results[c.request] is not None)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": out,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    return Job(requests, finish)


def _logprobs(c: _Choice, res: RequestResult | None, gen_id: int | None, echo: bool, k: int,
              scorer: Scorer) -> dict:
    ids: list[int] = []  # the returned tokens
    lps: list[float | None] = []
    rows: list[int | None] = []  # result row of each returned token (None: the unscored first token)
    if echo:
        scored = res.logprobs.tolist() if res is not None else []
        ids, lps, rows = [c.ids[0]], [None], [None]
        for j in range(1, len(c.ids)):  # token j is scored by result row j - score_begin
            ids.append(c.ids[j])
            lps.append(scored[j - c.score_begin])
            rows.append(j - c.score_begin)
    if gen_id is not None:
        r = len(c.ids) - c.score_begin  # the last prompt row predicts the generated token
        ids.append(gen_id)
        lps.append(float(res.topk_logprobs[r, 0]))
        rows.append(r)
    top_ids = res.topk_ids[:, :k].tolist() if k and res is not None else None
    top_lps = res.topk_logprobs[:, :k].tolist() if k and res is not None else None
    vocab = sorted(set(ids) | ({i for row in top_ids for i in row} if top_ids else set()))
    name = dict(zip(vocab, scorer.tokenizer.token_texts(vocab)))
    tops: list[dict[str, float] | None] = []
    for t, lp, r in zip(ids, lps, rows):
        if r is None:
            tops.append(None)
            continue
        top = {name[i]: v for i, v in zip(top_ids[r], top_lps[r]) if i != t} if top_ids else {}
        # the scored token with its own exact value, so "scored == max(top)" iff it is the argmax
        top[name[t]] = lp
        tops.append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
    texts = [name[i] for i in ids]
    offsets, pos = [], 0 if echo else len(c.text)
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(c: _Choice, res: RequestResult | None, k: int, scorer: Scorer) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: entry j (token ``ids[j]``, scored by result row j - 1) maps
    ``str(id)`` to ``{"logprob", "rank", "decoded_token"}`` for the prompt token (first) and the k
    most likely; the first entry is ``None``."""
    if res is None:  # a one-token prompt: nothing scores it
        return [None]
    lps, ranks = res.logprobs.tolist(), res.ranks.tolist()
    top_ids = res.topk_ids[:, :k].tolist() if k else [[] for _ in lps]
    top_lps = res.topk_logprobs[:, :k].tolist() if k else [[] for _ in lps]
    vocab = sorted(set(c.ids) | {i for row in top_ids for i in row})
    name = dict(zip(vocab, scorer.tokenizer.token_texts(vocab)))
    out: list[dict | None] = [None]
    for j in range(1, len(c.ids)):
        r, t = j - c.score_begin, c.ids[j]
        entry = {str(t): {"logprob": lps[r], "rank": ranks[r] + 1, "decoded_token": name[t]}}
        for rank, (i, v) in enumerate(zip(top_ids[r], top_lps[r]), 1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": name[i]})
        out.append(entry)
    return out

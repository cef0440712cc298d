"""OpenAI ``/v1/chat/completions`` for scoring: the final assistant message of ``messages`` under
the model's chat template (``Scorer.score_chat``'s tokens), answered as vLLM answers a
prompt-logprob chat request (``max_tokens: 0``; vLLM's ``echo`` and ``prompt_logprobs``).

The conversation is rendered whole (``add_generation_prompt`` false: the last message is the
assistant's) and scored as one request:

    template ids : c0 ... cn | a0 ... am          (a: the final assistant message, its end-of-turn marker, ...)
    prompt_logprobs: k   -> "prompt_logprobs" (top level, as vLLM's chat reply): null for c0, then per
                            token {"<id>": {"logprob", "rank", "decoded_token"}}: the token itself
                            first (rank: 1 + how many tokens score strictly higher), then the k most
                            likely (ranks 1..k)
    echo + logprobs      -> choices[0].message.content = the last message's content (vLLM's echo), and
                            choices[0].logprobs.content = one OpenAI entry {token, logprob, bytes,
                            top_logprobs: the top_logprobs most likely} per scored token a0 ... am
                            (what Scorer.score_chat returns), since nothing is generated

``usage.prompt_tokens`` counts the template's tokens; ``completion_tokens`` is 0.

Image parts (``image_url``, ``image``) in the messages before the last, on a model with a vision
tower, are read by ``server.images`` (its limits) and scored as ``Scorer.score_chat`` scores them:
each image's tokens in the prompt, the last message's log-probs given them. ``prompt_logprobs``
with images is refused (image tokens carry no log-prob).
"""

from __future__ import annotations

import time
import uuid

from ..engine.request import ScoreRequest
from ..errors import LogprobeError
from ..scorer import Job, Scorer
from ..scoring.chat import chat_inputs, content_text
from .config import ServerConfig
from .images import ImageBudget, chat_images
from .schemas_chat import ChatCompletionRequest


def check_chat_options(body: ChatCompletionRequest, max_top_logprobs: int, vocab_size: int) -> None:
    """Refuse what a scoring server cannot do, rather than silently doing something else."""
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if limit != 0:
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise LogprobeError(field, f"is {limit}; this server scores the last message and generates nothing",
                            "set max_tokens 0, with echo and logprobs (or prompt_logprobs)")
    if not (body.echo and body.logprobs) and body.prompt_logprobs is None:
        raise LogprobeError("echo" if not body.echo else "logprobs", "with max_tokens 0 there would be nothing to "
                            "return", "set echo and logprobs true (the last message's log-probs), or prompt_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise LogprobeError("top_logprobs", "needs logprobs true", "set logprobs true")
    for field in ("add_generation_prompt", "continue_final_message"):
        if getattr(body, field):
            raise LogprobeError(field, "must be false: the last message is scored whole, nothing is generated",
                                "leave it out")
    if body.n != 1:
        raise LogprobeError("n", "must be 1")
    if body.stream:
        raise LogprobeError("stream", "is not supported", "set stream false")
    for field in ("top_logprobs", "prompt_logprobs"):
        k = getattr(body, field) or 0
        if k > min(max_top_logprobs, vocab_size):
            raise LogprobeError(field, f"{k} is above this server's cap of {min(max_top_logprobs, vocab_size)}",
                                f"ask for at most {min(max_top_logprobs, vocab_size)}")


def chat_completion_job(body: ChatCompletionRequest, scorer: Scorer, model_name: str, max_top_logprobs: int,
                        config: ServerConfig | None = None) -> Job:
    """``config``: the image limits (``server.images``; None: the defaults)."""
    check_chat_options(body, max_top_logprobs, scorer.info.vocab_size)
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else [p.model_dump(exclude_none=True) for p in m.content]} for m in body.messages]
    messages = chat_images(messages, scorer.context, ImageBudget(config or ServerConfig()))
    prompt, scored, images = chat_inputs(scorer.context, messages)
    if images is not None and body.prompt_logprobs is not None:
        raise LogprobeError("prompt_logprobs", "with images: image tokens carry no log-prob, and only the text "
                            "after the last image is scored", "use echo and logprobs (the last message's log-probs)")
    ids = prompt + scored
    if len(ids) > scorer.info.max_length:
        raise LogprobeError("messages", f"{len(ids)} tokens exceed the model's context of {scorer.info.max_length}",
                            "shorten the conversation")
    pk, k = body.prompt_logprobs, (body.top_logprobs or 0) if body.logprobs else 0
    begin = 1 if pk is not None else len(prompt)
    req = ScoreRequest(ids, begin, 1.0, max(pk or 0, k), images=images)
    tok = scorer.tokenizer

    def finish(results) -> dict:
        res = results[0]
        lps, ranks = res.logprobs.tolist(), res.ranks.tolist()
        top_ids = res.topk_ids.tolist() if res.topk_ids is not None else [[] for _ in lps]
        top_lps = res.topk_logprobs.tolist() if res.topk_logprobs is not None else [[] for _ in lps]
        vocab = sorted(set(ids) | {i for row in top_ids for i in row})
        name = dict(zip(vocab, tok.token_texts(vocab)))
        content = None
        if body.echo and body.logprobs:
            content = []
            for j in range(len(prompt), len(ids)):
                r = j - begin
                alts = [{"token": name[i], "logprob": v, "bytes": list(name[i].encode())}
                        for i, v in zip(top_ids[r][:k], top_lps[r][:k])]
                content.append({"token": name[ids[j]], "logprob": lps[r], "bytes": list(name[ids[j]].encode()),
                                "top_logprobs": alts})
        choice = {"index": 0, "message": {"role": "assistant", "content": content_text(messages[-1]["content"]) if body.echo else ""},
                  "logprobs": None if content is None else {"content": content}, "finish_reason": "length"}
        out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
               "model": model_name, "choices": [choice],
               "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                         "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}}
        if pk is not None:
            entries: list[dict | None] = [None]
            for j in range(1, len(ids)):
                r, t = j - begin, ids[j]
                entry = {str(t): {"logprob": lps[r], "rank": ranks[r] + 1, "decoded_token": name[t]}}
                for rank, (i, v) in enumerate(zip(top_ids[r][:pk], top_lps[r][:pk]), 1):
                    entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": name[i]})
                entries.append(entry)
            out["prompt_logprobs"] = entries
        return out

    return Job([req], finish)

"""SGLang's ``POST /generate``, for scoring (``max_new_tokens`` 0): the input's log-probs.

What this relies on (SGLang's HTTP API as its RL clients use it; no SGLang code is imported):
slime's on-policy distillation POSTs ``{"input_ids": tokens, "sampling_params": {"temperature": 0,
"max_new_tokens": 0, "skip_special_tokens": false}, "return_logprob": true, "logprob_start_len": 0}``
and reads ``[e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]]`` (the first entry is
``None``). SGLang's scheduler builds that list as ``[None] + logprobs[:-1]`` over the input from
``logprob_start_len`` on (its comment: "Always pad the first one with None"), with the token ids
``input_ids[logprob_start_len:]``; ``logprob_start_len`` -1 (the default) means the last input
token only; ``logprob_start_len >= len(input_ids)`` is an error. Each entry is ``[logprob,
token_id, text]``, text ``None`` unless ``return_text_in_logprobs``. With ``top_logprobs_num`` n >
0, ``input_top_logprobs`` holds, per entry, ``None`` for the first and the n most likely
``[logprob, token_id, text]`` of the row that scores it. A temperature below 1e-6 is greedy in
SGLang's ``SamplingParams`` (temperature set to 1); otherwise the log-probs are
``log_softmax(logits / temperature)``. A list of inputs (batch) is answered by a list of replies.
``meta_info.weight_version`` is SGLang's (a string); ``weights_version`` (an int) is logprobe's.
``return_routed_experts`` (server started with ``--enable-return-routed-experts``; MoE models):
``meta_info.routed_experts`` is SGLang's R3 encoding, base64 of the int32 (little-endian) array
[len(input_ids) - 1, num_hidden_layers, k]: row j is token j's experts (every token fed; the last
token is only a target), a row per hidden layer with zeros in the dense blocks, as SGLang's
capturer fills its buffer (``scoring.sequences.sglang_routed_experts``; DeepSeek-V3's first dense
blocks, Qwen-MoE's ``mlp_only_layers``); clients decode it with
``np.frombuffer(base64.b64decode(s), dtype=np.int32).reshape(-1, num_hidden_layers, k)``.

Worked example, ``input_ids = [a, b, c, d]``, ``logprob_start_len = 1``:

    entry            0               1                  2
    token            b               c                  d
    logprob          null            log p(c | a b)     log p(d | a b c)
    scored by row    -               1 (has read a b)   2
    engine request   ScoreRequest([a, b, c, d], score_begin=2): result row j scores entry j + 1

so ``input_token_logprobs == [[None, b, None], [lp_c, c, None], [lp_d, d, None]]``; with
``logprob_start_len = 0`` it would start with ``[None, a, None]`` and score b, c and d.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..scorer import Job, Scorer
from ..scoring.sequences import encode_routed_experts, sglang_routed_experts
from .config import ServerConfig
from .images import ImageBudget, renamed
from .openai_compat import prompt_token_ids
from .schemas_rl import GenerateRequest, SamplingParams

SAMPLING_EPS = 1e-6  # SGLang: a temperature below it is greedy, with temperature 1


@dataclass(slots=True)
class _Item:
    ids: list[int]  # the input's tokens
    start: int  # first returned position (logprob_start_len resolved)
    logprob: bool  # return_logprob
    top: int  # top_logprobs_num
    request: int | None  # index of its ScoreRequest; None when nothing needs the model
    rid: str
    routed: bool = False  # return_routed_experts


def batched(body: GenerateRequest) -> bool:
    """A list of texts or of token-id lists is a batch (a list of replies)."""
    return isinstance(body.text, list) or isinstance(body.input_ids[0] if body.input_ids else None, list)


def per_item(value, n: int, field: str, many: bool) -> list:
    """One value for every item, or a list of ``n`` (only for a batch)."""
    if not isinstance(value, list):
        return [value] * n
    if not many or len(value) != n:
        inputs = f"{n} inputs" if many and n > 1 else "a single input"
        raise LogprobeError(field, f"is a list of {len(value)} for {inputs}", "give one value, or one per input of a batch")
    return value


def temperature(params: SamplingParams | None) -> float:
    t = params.temperature if params is not None else 1.0
    return 1.0 if t < SAMPLING_EPS else t


def generate_job(body: GenerateRequest, scorer: Scorer, max_top_logprobs: int,
                 routed_experts: bool = False, config: ServerConfig | None = None) -> tuple[Job, list[str]]:
    """The engine requests of a ``/generate`` body and how to answer it (one dict, or a list), and
    for each request the body item it scores (``input_ids[2]``), for errors. ``config``: the image
    limits (None: the defaults)."""
    if (body.input_ids is None) == (body.text is None):
        raise LogprobeError("input_ids", "give exactly one of input_ids and text")
    many = batched(body)
    field = "text" if body.text is not None else "input_ids"
    ids_list, _ = prompt_token_ids(body.text if body.text is not None else body.input_ids, scorer, field,
                                   texts_wanted=False)
    n = len(ids_list)
    logprob = per_item(body.return_logprob, n, "return_logprob", many)
    starts = per_item(body.logprob_start_len, n, "logprob_start_len", many)
    tops = per_item(body.top_logprobs_num, n, "top_logprobs_num", many)
    rids = per_item(body.rid, n, "rid", many)
    temps = [temperature(p) for p in per_item(body.sampling_params, n, "sampling_params", many)]
    routed = per_item(body.return_routed_experts, n, "return_routed_experts", many)
    images = image_items(body.image_data, n, many)
    budget = ImageBudget(config or ServerConfig())
    if any(routed):
        if not routed_experts:
            raise LogprobeError("return_routed_experts", "is off on this server",
                                "start it with --enable-return-routed-experts")
        scorer.context.check_routing("return_routed_experts")
    items: list[_Item] = []
    requests: list[ScoreRequest] = []
    for i, ids in enumerate(ids_list):
        at = f"[{i}]" if many else ""
        img = None
        if images[i] is not None:
            ids, img = with_images(ids, images[i], scorer, budget)
        start = _start(starts[i], len(ids), _name(body, "logprob_start_len", at))
        top = _top(tops[i], scorer, max_top_logprobs, _name(body, "top_logprobs_num", at))
        if len(ids) > scorer.info.max_length:
            raise LogprobeError(f"{field}{at}", f"{len(ids)} tokens exceed the model's context of "
                                f"{scorer.info.max_length}", "shorten the input")
        route = bool(routed[i]) and len(ids) > 1
        need = (logprob[i] and start + 1 < len(ids)) or route  # a scored entry after the first (null) one
        if img is not None and need and start < int(img.token_index[-1]):
            last = int(img.token_index[-1])
            raise LogprobeError(_name(body, "logprob_start_len", at), f"is {starts[i]}: the entries after it would "
                                f"score image tokens (the last at position {last} of the {len(ids)} ids, images "
                                "expanded): only the text after the last image is scored",
                                f"use logprob_start_len >= {last}, or -1 (the last token)")
        items.append(_Item(ids, start, logprob[i], top, len(requests) if need else None,
                           rids[i] if rids[i] is not None else uuid.uuid4().hex, bool(routed[i])))
        if need:
            requests.append(ScoreRequest(ids, min(start + 1, len(ids) - 1), temps[i], top, route=route, images=img))

    def finish(results: list[RequestResult]) -> dict | list[dict]:
        texts = _token_texts(items, results, scorer) if body.return_text_in_logprobs else None
        out = [_reply(it, results[it.request] if it.request is not None else None, texts, scorer) for it in items]
        return out if many else out[0]

    owners = [f"{field}[{i}]" if many else field for i, it in enumerate(items) if it.request is not None]
    return Job(requests, finish), owners


def image_items(value, n: int, many: bool) -> list[tuple[str, list[tuple[str, str]]] | None]:
    """SGLang's ``image_data`` per input: (its field, [(image, the image's field)]), or None (no
    images). One input: an image or a list of them; a batch: one entry per input (an image, a
    list, or null).

        >>> image_items(["a", None], 2, True)
        [('image_data[0]', [('a', 'image_data[0]')]), None]
        >>> image_items(["a", "b"], 1, False)
        [('image_data', [('a', 'image_data[0]'), ('b', 'image_data[1]')])]
    """
    if value is None:
        return [None] * n
    if not many:
        if isinstance(value, str):
            return [("image_data", [(value, "image_data")])]
        if any(not isinstance(x, str) for x in value):
            raise LogprobeError("image_data", "is a list of lists for a single input",
                                "give the input's images as one list of strings")
        return [("image_data", [(x, f"image_data[{k}]") for k, x in enumerate(value)])]
    if not isinstance(value, list) or len(value) != n:
        raise LogprobeError("image_data", f"must be a list of {n} entries, one per input of the batch (an image, "
                            "a list of images, or null)")
    out: list = []
    for i, x in enumerate(value):
        base = f"image_data[{i}]"
        out.append(None if x is None else (base, [(x, base)] if isinstance(x, str)
                                           else [(y, f"{base}[{k}]") for k, y in enumerate(x)]))
    return out


def with_images(ids: list[int], images: tuple[str, list[tuple[str, str]]], scorer: Scorer, budget: ImageBudget):
    """An input's ids (the image token once per image, or expanded) with its images -> (ids
    expanded, ``ImageInputs``); errors name the ``image_data`` items."""
    base, items = images
    reader = scorer.context.check_images(base)
    data = [budget.read(v, field, bare_base64=True) for v, field in items]
    with renamed("_.images", base):
        ids, pixels, grids = reader.prompt_ids(ids, data, "_")
        return ids, reader.inputs(ids, pixels, grids, "_")


def _name(body: GenerateRequest, field: str, at: str) -> str:
    """``field[i]`` when the body gave one value per item, else ``field``."""
    return field + (at if isinstance(getattr(body, field), list) else "")


def _start(k: int, n: int, field: str) -> int:
    """``logprob_start_len`` as a position: -1 is the last input token (SGLang's default)."""
    if k == -1:
        return n - 1
    if not 0 <= k < n:
        raise LogprobeError(field, f"is {k}, outside [0, {n}) for an input of {n} tokens (or -1: the last token)",
                            "use a position of the input")
    return k


def _top(k: int, scorer: Scorer, cap: int, field: str) -> int:
    if k < 0:
        raise LogprobeError(field, f"is {k}", "use 0 (none) or more")
    if k > min(cap, scorer.info.vocab_size):
        raise LogprobeError(field, f"{k} is above this server's cap of {min(cap, scorer.info.vocab_size)}",
                            f"ask for at most {min(cap, scorer.info.vocab_size)}")
    return k


def _token_texts(items: list[_Item], results: list[RequestResult], scorer: Scorer) -> dict[int, str]:
    """id -> the token decoded alone, for every id a reply shows."""
    vocab = {t for it in items for t in it.ids[it.start:]}
    for r in results:
        if r.topk_ids is not None:
            vocab.update(r.topk_ids.flatten().tolist())
    vocab = sorted(vocab)
    return dict(zip(vocab, scorer.tokenizer.token_texts(vocab)))


def _reply(it: _Item, res: RequestResult | None, texts: dict[int, str] | None, scorer: Scorer) -> dict:
    """One item's reply; entry j is token ``ids[start + j]``, scored by result row j - 1; routed
    experts in SGLang's layout (a row per hidden layer)."""
    meta = {"id": it.rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(it.ids),
            "completion_tokens": 0, "cached_tokens": res.cached_tokens if res is not None else 0}
    if it.logprob:
        name = (lambda t: texts[t]) if texts is not None else (lambda t: None)  # noqa: E731
        scored = res.logprobs.tolist() if res is not None else []
        tokens = it.ids[it.start:]
        meta["input_token_logprobs"] = [[None if j == 0 else scored[j - 1], t, name(t)] for j, t in enumerate(tokens)]
        meta["output_token_logprobs"] = []
        if it.top > 0:
            ids = res.topk_ids[:, :it.top].tolist() if res is not None else []
            lps = res.topk_logprobs[:, :it.top].tolist() if res is not None else []
            meta["input_top_logprobs"] = [None] + [[[v, t, name(t)] for v, t in zip(lps[r], ids[r])]
                                                   for r in range(len(tokens) - 1)]
            meta["output_top_logprobs"] = []
    if it.routed:
        meta["routed_experts"] = encode_routed_experts(
            sglang_routed_experts(scorer.context, res.routed_experts) if res is not None else _no_rows())
    return {"text": "", "output_ids": [], "meta_info": meta}


def _no_rows():
    import torch

    return torch.empty(0, dtype=torch.int32)

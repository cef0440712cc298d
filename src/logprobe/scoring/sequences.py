"""Token ids (reinforcement learning): ``Scorer.logprobs_job`` and the padded/packed batches as
functions of a ``ScoringContext``.

A sequence's request is its prompt and completion ids back to back, scored from the last prompt
row on, so there is one log-prob per completion token:

    ids  : p0 p1 p2 | c0 c1 c2          ScoreRequest([p0 p1 p2 c0 c1 c2], score_begin=3)
    row 2 -> c0, row 3 -> c1, row 4 -> c2

Padded and packed batches become the same requests through a ``scoring.padded.Plan``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ..engine.request import ImageInputs, RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..interp.specs import CaptureSpec, SteerSpec, capture_results, request_hooks
from .inputs import check_length, check_no_media
from .options import HeadOptions, HookSpecs
from .padded import Plan, gather_results, plan_requests
from .results import SequenceLogprobs
from .work import Job, ScoringContext


def logprobs_job(context: ScoringContext, sequences: Sequence[dict], head: HeadOptions = HeadOptions(),
                 hooks: HookSpecs = HookSpecs(), return_routed_experts: bool = False) -> Job:
    """``Scorer.logprobs_job``: one request per ``{"prompt_token_ids", "completion_token_ids"}``
    (and optionally ``"routed_experts"``: the experts to force, see ``routed_experts``)."""
    head = head.checked()
    if isinstance(sequences, (str, bytes, dict)) or not isinstance(sequences, Sequence) or not sequences:
        raise LogprobeError("sequences", "must be a non-empty list of objects with prompt_token_ids and "
                            "completion_token_ids")
    if not isinstance(return_routed_experts, bool):
        raise LogprobeError("return_routed_experts", f"must be true or false, got {return_routed_experts!r}")
    if return_routed_experts:
        context.check_routing("return_routed_experts")
    caps, steers = context.hook_specs(hooks)
    with context.images.one_call() if context.images is not None else nullcontext():
        requests = [sequence_request(context, seq, i, head, caps, steers, return_routed_experts)
                    for i, seq in enumerate(sequences)]
    return Job(requests, lambda results: [sequence_result(r, res, caps) for r, res in zip(requests, results)])


def sequence_result(req: ScoreRequest, r: RequestResult, caps: list[CaptureSpec]) -> SequenceLogprobs:
    return SequenceLogprobs(r.logprobs, r.ranks, r.entropy, r.topk_ids, r.topk_logprobs,
                            capture_results(caps, req.capture, r.captures) if caps else None,
                            r.routed_experts.to(torch.int32) if req.route else None)


def sequence_request(context: ScoringContext, seq: dict, i: int, head: HeadOptions,
                     caps: list[CaptureSpec] = (), steers: list[SteerSpec] = (), route: bool = False) -> ScoreRequest:
    """Validate sequence ``i`` and turn it into a request (``head`` already checked)."""
    if not isinstance(seq, dict):
        raise LogprobeError(f"sequences[{i}]", "must be an object with prompt_token_ids and completion_token_ids")
    images = None
    if "images" in seq:
        check_no_media({k: v for k, v in seq.items() if k != "images"}, f"sequences[{i}]")
        prompt, completion, images = image_sequence(context, seq, f"sequences[{i}]")
    else:
        check_no_media(seq, f"sequences[{i}]")
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
    forced = seq.get("routed_experts")
    if forced is not None:
        forced = routed_experts(context, forced, len(prompt) + len(completion), f"sequences[{i}].routed_experts")
    return ScoreRequest(prompt + completion, len(prompt), head.temperature, head.top_k, head.entropy, st, ca,
                        route, forced, images)


def image_sequence(context: ScoringContext, seq: dict, f: str) -> tuple[list[int], list[int], ImageInputs]:
    """A sequence with ``"images"`` (a model with a vision tower): ``"prompt"`` text with one image
    placeholder per image (``scoring.images``), or ``"prompt_token_ids"`` holding the placeholder's
    id once per image (expanded here) or already expanded (as a processor returns them: each
    image's t * h * w / m² ids); ``"completion"`` text or ``"completion_token_ids"`` (text only:
    the scored tokens carry no image) -> (prompt ids, completion ids, ``ImageInputs``)."""
    reader = context.check_images(f"{f}.images")
    prompt = seq.get("prompt")
    if "prompt_token_ids" not in seq and not isinstance(prompt, str):
        raise LogprobeError(f"{f}.prompt", "with images the prompt is text, with the placeholder "
                            f"{reader.placeholder} where each image stands (or prompt_token_ids)")
    if isinstance(seq.get("completion"), str):
        completion = context.tokenizer.encode(seq["completion"])
    else:
        completion = context.check_ids(seq.get("completion_token_ids"), f"{f}.completion_token_ids")
    if reader.image_token_id in completion or reader.fmt.marker in completion:
        raise LogprobeError(f"{f}.completion", f"holds the image placeholder {reader.placeholder}: only text is "
                            "scored (an image token carries no log-prob)", "put the images in the prompt")
    if "prompt_token_ids" in seq:
        ids = context.check_ids(seq["prompt_token_ids"], f"{f}.prompt_token_ids")
        ids, pixels, grids = reader.prompt_ids(ids, seq["images"], f)
    else:
        text, pixels, grids = reader.prompt(prompt, seq["images"], f)
        tok = context.tokenizer
        ids = ([tok.bos_id] if tok.add_bos else []) + tok.encode(text)
    return ids, completion, reader.inputs(ids + completion, pixels, grids, f)


def routed_experts(context: ScoringContext, value, length: int, field: str) -> torch.Tensor:
    """A sequence's ``routed_experts`` to force (R3) -> int64 [length - 1, L, k]: row j is token j's
    experts at each of the L MoE layers (every token fed: the last token is only a target), ids in
    the model's numbering. A list of lists, a numpy array or a tensor; a base64 string of int32
    (SGLang's ``meta_info.routed_experts``) is decoded first. Two layouts are taken: logprobe's
    own [length - 1, L, k], and SGLang's [length - 1, num_hidden_layers, k] with zeros in the dense
    blocks (their rows must be zero: any other id there means the routing is of another model).
    A token's k experts must differ (a router never names one twice). DeepSeek-V3 with one dense
    first block of 4, k = 2: [[[0, 0], [3, 5], [1, 2], [7, 4]], ...] is SGLang's for
    [[[3, 5], [1, 2], [7, 4]], ...]."""
    layers, k, num_experts = context.check_routing(field)
    blocks = context.route_blocks or tuple(range(layers))
    total = max(context.num_blocks, layers)
    flat = isinstance(value, str)
    if flat:
        value = decode_routed_experts(value, k, field)  # [n, k]: rows and layers read off its size
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise LogprobeError(field, f"is not an array of expert ids: {e}", "give [tokens][layers][k] integers") from e
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise LogprobeError(field, f"holds {t.dtype}, not integers", "give expert ids as integers")
    t = _routes_shaped(t, flat, length - 1, layers, total, k, field).long()
    if t.shape[1] != layers:  # SGLang's layout: a row per block
        t = _moe_rows(t, blocks, field)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
        raise LogprobeError(field, f"holds expert ids outside [0, {num_experts})", "use the model's expert numbering")
    _refuse_repeats(t, blocks, field)
    return t


def _routes_shaped(t: torch.Tensor, flat: bool, rows: int, layers: int, total: int, k: int, field: str
                   ) -> torch.Tensor:
    """``t`` as [rows, layers, k], or SGLang's [rows, total, k] when the model has dense blocks;
    ``flat``: a decoded base64 array [n, k], shaped by its size."""
    shapes = [(rows, layers, k)] + ([(rows, total, k)] if total != layers else [])
    if flat:  # decoded base64: whole rows of k ids
        for shape in shapes:
            if t.shape[0] == shape[0] * shape[1]:
                return t.reshape(shape)
    elif tuple(t.shape) in shapes:
        return t
    got = f"{t.shape[0]} rows of {k} ids" if flat else f"shape {list(t.shape)}"
    sglang = (f", or SGLang's {list(shapes[1])} (a row per hidden layer, zeros in the {total - layers} dense "
              "ones)") if len(shapes) > 1 else ""
    raise LogprobeError(field, f"has {got}; this sequence needs {list(shapes[0])} (one row per token fed: prompt "
                        f"and completion but the last token; {layers} MoE layers; {k} experts per token){sglang}",
                        "return the routing of exactly this sequence")


def _moe_rows(t: torch.Tensor, blocks: tuple[int, ...], field: str) -> torch.Tensor:
    """SGLang's [rows, blocks, k] -> the MoE blocks' rows [rows, L, k]. A dense block's ids must be
    0, as SGLang's capturer leaves them: any other value is the routing of another model."""
    dense = [b for b in range(t.shape[1]) if b not in set(blocks)]
    bad = t[:, dense].ne(0).any(-1).nonzero()  # [n, 2]: (token, index into dense)
    if len(bad):
        j, d = bad[0].tolist()
        raise LogprobeError(field, f"token {j} has experts {t[j, dense[d]].tolist()} at layer {dense[d]}, a dense "
                            "block (no router): SGLang's layout holds zeros there",
                            f"send the routing of this model (dense blocks {dense}: zeros in SGLang's layout)")
    return t[:, list(blocks)]


def _refuse_repeats(t: torch.Tensor, blocks: tuple[int, ...], field: str) -> None:
    """A token's k experts at one layer must differ: the router's top-k never repeats one, and a
    repeated id would run that expert twice (its weight counted twice)."""
    s = t.sort(dim=-1).values  # [rows, L, k]
    same = s[..., 1:] == s[..., :-1]  # [rows, L, k - 1]
    hit = same.any(-1).nonzero()  # [n, 2]: (token, MoE layer)
    if len(hit):
        j, m = hit[0].tolist()
        e = int(s[j, m, 1:][same[j, m]][0])
        raise LogprobeError(field, f"names expert {e} twice for token {j} at MoE layer {m} (hidden layer "
                            f"{blocks[m]}): {t[j, m].tolist()}",
                            "give each token k different experts at every layer, as the router chooses them")


def decode_routed_experts(text: str, k: int, field: str = "routed_experts"):
    """SGLang's ``meta_info.routed_experts``: base64 of int32 (little-endian) -> [-1, k] (how many
    rows and layers: the caller knows)."""
    import numpy as np

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise LogprobeError(field, f"is not base64: {e}", "send SGLang's base64 string or a list") from e
    if len(raw) % (4 * k):
        raise LogprobeError(field, f"{len(raw)} bytes are not whole rows of {k} int32")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, k).copy()


def sglang_routed_experts(context: ScoringContext, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, L, k] (a row per MoE layer) -> SGLang's layout, int32 [tokens, num_hidden_layers,
    k]: a row per block, zeros in the dense ones (SGLang's capturer writes each MoE layer's row of
    a zeroed buffer); the same array when every block is MoE. DeepSeek-V3 with one dense first
    block of 4: [[[3, 5], [1, 2], [7, 4]]] -> [[[0, 0], [3, 5], [1, 2], [7, 4]]]."""
    blocks = list(context.route_blocks) or list(range(ids.shape[1]))
    out = torch.zeros(ids.shape[0], max(context.num_blocks, ids.shape[1]), ids.shape[2], dtype=torch.int32)
    out[:, blocks] = ids.to(torch.int32)
    return out


def encode_routed_experts(ids: torch.Tensor) -> str:
    """[tokens, layers, k] expert ids -> base64 of int32 little-endian, as SGLang's
    ``meta_info.routed_experts`` (decode: ``np.frombuffer(base64.b64decode(s), np.int32).reshape(-1, L, k)``)."""
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(ids.cpu().numpy(), dtype="<i4").tobytes()).decode("ascii")


def aligned_job(context: ScoringContext, plan: Plan, input_ids: torch.Tensor, head: HeadOptions) -> Job:
    """The requests of a padded or packed ``plan``; the answer is in the trainer's layout, on
    ``input_ids``' device (``scoring.padded.gather_results``)."""
    head = head.checked()
    if not isinstance(head.entropy, bool):
        raise LogprobeError("entropy", f"must be true or false, got {head.entropy!r}")
    requests = plan_requests(plan, input_ids, context.vocab_size, context.max_length, head)
    device = input_ids.device
    return Job(requests, lambda results: gather_results(results, plan, device, head.entropy, head.top_k))

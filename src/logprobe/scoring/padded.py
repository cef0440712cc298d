"""RL trainers' tensor layouts -> scoring requests -> tensors in the same layout. Pure functions.

Trainers hand over padded batches; logprobe scores packed requests (no compute on padding) and
writes each answer back where the trainer expects it. The shift is the one of every causal LM:
**the value at a token's place is log p(that token | the real tokens before it in its row)**; the
first real token of a row has no context, so it can never be scored.

Padded layout (verl, TRL, OpenRLHF): ``input_ids`` / ``attention_mask`` [bs, L], the last R
columns are the response region, ``response_mask`` [bs, R] marks the tokens to score (default:
``attention_mask[:, -R:]``). Output column j belongs to input column L - R + j. Example, L = 7,
R = 3 (``.`` = padding, attention 0):

    col             0   1   2   3 | 4   5   6        response_mask   out[b] (3 columns)
    row 0 ids       .   .   p0  p1| r0  r1  .        1 1 0           [lp(r0|p0 p1), lp(r1|p0 p1 r0), 0]
    row 1 ids       p0  p1  p2  p3| r0  r1  r2       1 0 1           [lp(r0|p0..p3), 0, lp(r2|p0..p3 r0 r1)]
    row 2 ids       .   .   .   p0| r0  .   .        0 0 0           [0, 0, 0]          (no request)

    request of row 0: tokens [p0 p1 r0 r1], score_begin 2 (two real tokens before the first scored)
    request of row 1: tokens [p0 p1 p2 p3 r0 r1 r2], score_begin 4; r1 is fed and scored by the
                      engine, but its column is masked: it is dropped, and out[1, 1] stays 0

A request holds a row's real tokens up to its last scored one (later tokens cannot change earlier
predictions); positions count real tokens only (position_ids = cumsum(attention_mask) - 1, as
verl and OpenRLHF compute them), so padding anywhere in a row changes no number.

Packed (THD) layout: ``input_ids`` [T] holds sequences back to back, sequence i is
``input_ids[cu_seqlens[i]:cu_seqlens[i + 1]]``, and its tokens from index ``score_start[i]`` on
are scored (1 <= score_start[i] <= its length; equal to the length: none). Output [T]:

    index            0   1   2   3 | 4   5   6          cu_seqlens [0, 4, 7], score_start [2, 1]
    ids              a0  a1  a2  a3| b0  b1  b2
    out              0   0   lp(a2|a0 a1)  lp(a3|a0..a2) | 0  lp(b1|b0)  lp(b2|b0 b1)

Both layouts become a ``Plan``: flat indices of each request's tokens, its ``score_begin``, and
for every value the engine returns (requests in order, each from its ``score_begin`` on) the flat
output index it goes to, or -1 where the token is fed but masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from .options import HeadOptions


@dataclass(slots=True)
class AlignedLogprobs:
    """Answers in the caller's layout ([bs, R] padded, [T] packed), float32, 0 where not scored."""

    logprobs: torch.Tensor  # [*shape] float32
    entropy: torch.Tensor | None = None  # [*shape] float32
    topk_ids: torch.Tensor | None = None  # [*shape, k] int64
    topk_logprobs: torch.Tensor | None = None  # [*shape, k] float32


@dataclass(frozen=True, slots=True)
class Plan:
    """Requests as flat indices into ``input_ids.reshape(-1)``, and where their answers go."""

    index: torch.Tensor  # [F] int64: every request's tokens, request after request
    lengths: list[int]  # per request: how many of ``index`` are its tokens
    score_begin: list[int]  # per request: its first scored token (>= 1)
    dest: torch.Tensor  # [N] int64: flat output index of each engine value, -1 = dropped
    in_shape: tuple[int, ...]  # the shape input_ids must have: (bs, L) or (T,)
    out_shape: tuple[int, ...]  # (bs, R) or (T,)
    names: list[str]  # per request: what an error about it calls it ("input_ids[3]")


def _int_tensor(x, name: str, ndim: int, allow_bool: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise LogprobeError(name, f"must be a torch tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or (x.dtype == torch.bool and not allow_bool):
        raise LogprobeError(name, f"must hold integers, got dtype {str(x.dtype).removeprefix('torch.')}")
    if x.dim() != ndim:
        raise LogprobeError(name, f"must be {ndim}-D, got shape {tuple(x.shape)}")
    return x.detach().cpu()


def _mask(x, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    m = _int_tensor(x, name, 2, allow_bool=True)
    if shape is not None and tuple(m.shape) != shape:
        raise LogprobeError(name, f"has shape {tuple(m.shape)}, expected {shape}")
    if m.dtype != torch.bool and ((m != 0) & (m != 1)).any():
        raise LogprobeError(name, "must hold only 0 and 1")
    return m.bool()


def _first_bad(bad: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in bad.nonzero()[0])


def plan_padded(attention_mask: torch.Tensor, response_mask: torch.Tensor | None = None,
                num_response_tokens: int | None = None) -> Plan:
    """The plan of a padded batch (see the module docstring for the drawing).

    R = ``response_mask.shape[1]`` or ``num_response_tokens`` (TRL's ``logits_to_keep``); the
    scored tokens are ``response_mask`` (default ``attention_mask[:, -R:]``) on the last R
    columns. A scored token must be real (attention 1) and have a real token before it."""
    A = _mask(attention_mask, "attention_mask")  # [bs, L]
    bs, L = A.shape
    if response_mask is None and num_response_tokens is None:
        raise LogprobeError("response_mask", "give response_mask [bs, R] or num_response_tokens R",
                            "the last R columns are the response region")
    if num_response_tokens is not None and (isinstance(num_response_tokens, bool)
                                            or not isinstance(num_response_tokens, int)
                                            or not 1 <= num_response_tokens <= L):
        raise LogprobeError("num_response_tokens", f"must be an integer in [1, {L}], got {num_response_tokens!r}")
    if response_mask is not None:
        M = _int_tensor(response_mask, "response_mask", 2, allow_bool=True)
        R = M.shape[1]
        if num_response_tokens is not None and num_response_tokens != R:
            raise LogprobeError("num_response_tokens", f"{num_response_tokens} differs from response_mask's "
                                f"{R} columns", "give one of them")
        if not 1 <= R <= L:
            raise LogprobeError("response_mask", f"has {R} columns, attention_mask has {L}",
                                "the response region is the last R <= L columns")
        M = _mask(M, "response_mask", (bs, R))
    else:
        R = num_response_tokens
        M = A[:, L - R:]
    S = torch.zeros(bs, L, dtype=torch.bool)  # [bs, L] scored tokens
    S[:, L - R:] = M
    if (bad := S & ~A).any():
        b, c = _first_bad(bad)
        raise LogprobeError(f"response_mask[{b}][{c - (L - R)}]", "marks a padding token (attention_mask 0) "
                            "to score", "mask only real tokens")
    col = torch.arange(L)
    first = torch.where(S, col, L).amin(1)  # [bs], L where nothing is scored
    last = torch.where(S, col, -1).amax(1)  # [bs], -1 where nothing is scored
    fed = A & (col <= last[:, None])  # [bs, L] the tokens of each row's request
    before = (A & (col < first[:, None])).sum(1)  # [bs] real tokens before the first scored one
    has = S.any(1)  # [bs]
    if (bad := has & (before == 0)).any():
        b = int(bad.nonzero()[0])
        raise LogprobeError(f"response_mask[{b}]" if response_mask is not None else f"attention_mask[{b}]",
                            f"scores the row's first real token (column {int(first[b])}), which has no context",
                            "a scored token needs at least one real token before it")
    span = fed & (col >= first[:, None])  # [bs, L] what the engine returns a value for
    sb, sc = span.nonzero(as_tuple=True)  # row-major: requests in order, tokens in order
    dest = torch.where(S[sb, sc], sb * R + sc - (L - R), -1)  # [N]
    rows = has.nonzero().squeeze(1)  # [n]
    return Plan(fed.reshape(-1).nonzero().squeeze(1), fed.sum(1)[rows].tolist(), before[rows].tolist(), dest,
                (bs, L), (bs, R), [f"input_ids[{b}]" for b in rows.tolist()])


def plan_packed(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, score_start: torch.Tensor) -> Plan:
    """The plan of a packed batch ``input_ids`` [T]: sequence i is tokens cu_seqlens[i] ..
    cu_seqlens[i+1] - 1, scored from its index ``score_start[i]`` on (see the module docstring)."""
    num_tokens = _int_tensor(input_ids, "input_ids", 1).shape[0]
    cu = _int_tensor(cu_seqlens, "cu_seqlens", 1).long()  # [n + 1]
    ss = _int_tensor(score_start, "score_start", 1).long()  # [n]
    if len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise LogprobeError("cu_seqlens", f"must start at 0 and end at len(input_ids) = {num_tokens}, got "
                            f"{cu.tolist()[:4]}{'...' if len(cu) > 4 else ''}")
    lens = cu.diff()  # [n]
    if (lens < 1).any():
        raise LogprobeError(f"cu_seqlens[{int((lens < 1).nonzero()[0]) + 1}]", "makes an empty or negative-length "
                            "sequence", "cu_seqlens must increase")
    if len(ss) != len(lens):
        raise LogprobeError("score_start", f"has {len(ss)} entries for {len(lens)} sequences")
    if (bad := (ss < 1) | (ss > lens)).any():
        i = int(bad.nonzero()[0])
        raise LogprobeError(f"score_start[{i}]", f"must be in [1, {int(lens[i])}] (the sequence's length), got "
                            f"{int(ss[i])}", "index 0 has no context: the first scorable token is index 1")
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T] which sequence each token is in
    local = torch.arange(num_tokens) - cu[seq]  # [T] index inside its sequence
    has = ss < lens  # [n]
    fed = has[seq]  # [T]
    scored = local >= ss[seq]  # [T]
    rows = has.nonzero().squeeze(1)
    return Plan(fed.nonzero().squeeze(1), lens[rows].tolist(), ss[rows].tolist(), scored.nonzero().squeeze(1),
                (num_tokens,), (num_tokens,), [f"sequence {i}" for i in rows.tolist()])


def plan_requests(plan: Plan, input_ids: torch.Tensor, vocab_size: int, max_length: int,
                  head: HeadOptions = HeadOptions()) -> list[ScoreRequest]:
    """The plan's requests over ``input_ids`` (any shape whose flat order the plan indexes): the
    ``ScoreRequest(prompt + completion, len(prompt), ...)`` that ``Scorer.logprobs`` builds."""
    ids = _int_tensor(input_ids, "input_ids", len(plan.in_shape))
    if tuple(ids.shape) != plan.in_shape:
        raise LogprobeError("input_ids", f"has shape {tuple(ids.shape)}, the masks describe {plan.in_shape}")
    flat = ids.reshape(-1)[plan.index]  # [F] the tokens that are fed
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        k = int(((flat < 0) | (flat >= vocab_size)).nonzero()[0])
        where = plan.names[int(torch.searchsorted(torch.tensor(plan.lengths).cumsum(0), k, right=True))]
        raise LogprobeError("input_ids", f"{where} holds token id {int(flat[k])}, outside the vocabulary "
                            f"[0, {vocab_size})", "pass the model's own token ids")
    for name, n in zip(plan.names, plan.lengths):
        if n > max_length:
            raise LogprobeError("input_ids", f"{name} has {n} real tokens up to its last scored one, beyond the "
                                f"model's context of {max_length}", "shorten it")
    tokens = flat.tolist()
    out, start = [], 0
    for n, sb in zip(plan.lengths, plan.score_begin):
        out.append(ScoreRequest(tokens[start:start + n], sb, head.temperature, head.top_k, head.entropy))
        start += n
    return out


def scatter(values: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``values`` [N, *extra] (the engine's, requests in order) -> [*plan.out_shape, *extra], zeros
    where nothing is scored or the token is masked."""
    numel = 1
    for d in plan.out_shape:
        numel *= d
    out = values.new_zeros(numel, *values.shape[1:])  # [prod(out_shape), *extra]
    keep = plan.dest >= 0
    out[plan.dest[keep]] = values[keep]
    return out.view(*plan.out_shape, *values.shape[1:])


def gather_results(results: list[RequestResult], plan: Plan, device: torch.device | str, entropy: bool = False,
                   top_k: int = 0) -> AlignedLogprobs:
    """Concatenate the requests' results and scatter them into the plan's layout on ``device``."""
    if results and results[0].topk_ids is not None:
        top_k = results[0].topk_ids.shape[1]  # the head's k (at most the vocabulary)

    def field(name: str, dtype: torch.dtype, extra: tuple[int, ...] = ()) -> torch.Tensor:
        parts = [getattr(r, name) for r in results]
        values = torch.cat(parts) if parts else torch.zeros(0, *extra, dtype=dtype)  # [N, *extra]
        return scatter(values, plan).to(device)

    return AlignedLogprobs(field("logprobs", torch.float32),
                           field("entropy", torch.float32) if entropy else None,
                           field("topk_ids", torch.int64, (top_k,)) if top_k else None,
                           field("topk_logprobs", torch.float32, (top_k,)) if top_k else None)

"""The public API: ``Scorer`` scores continuations, sequences of token ids and perplexity.

Every method states which rows predict which tokens; see ``scoring.contract`` for the full
contract and ``scoring.windows`` for how perplexity windows overlap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig
from .engine.request import CaptureAt, RequestResult, ScoreRequest, SteerAt
from .engine.runner import Engine
from .errors import LogprobeError
from .interp.points import point_layer, resolve_points
from .interp.specs import (
    CaptureSpec,
    SteerSpec,
    capture_results,
    parse_capture,
    parse_steer,
    request_hooks,
)
from .interp.vectors import SteeringVector, check_method, direction_from_states
from .io.text import check_text
from .loading import LoadedModel, load_model
from .scoring.contract import split_continuation
from .scoring.padded import AlignedLogprobs, Plan, gather_results, plan_packed, plan_padded, plan_requests
from .scoring.results import ContinuationScore, PerplexityResult, SequenceLogprobs
from .scoring.stats import count_words, mean_and_stderr
from .scoring.windows import make_windows

MIN_TEMPERATURE = 1e-30  # below it, logits / temperature can overflow float32 (NaN log-probs)


def _exp(x: float) -> float:
    """``math.exp``, but inf (then ``null`` in JSON) where the result exceeds float64, not OverflowError."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(slots=True)
class Job:
    """Engine requests and how to turn their results into the method's answer.

    ``Scorer.score(...)`` is ``job = Scorer.score_job(...)`` then ``job.finish(engine.run(job.requests))``;
    the server runs the requests of many jobs in shared batches and finishes each job on its own.
    """

    requests: list[ScoreRequest]
    finish: Callable[[list[RequestResult]], Any]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_inputs for r in self.requests)


class Scorer:
    """Exact log-probabilities of given text.

    >>> s = Scorer()                       # SmolLM2-135M-Instruct Q4_1, CPU float32
    >>> [r.continuation for r in s.score("The capital of France is", [" Paris", " London"])]
    [' Paris', ' London']
    """

    def __init__(self, model: str | LoadedModel | None = None, *, device: str | None = "auto",
                 dtype: str | None = "auto", max_batch_tokens: int = 8192, progress: bool | None = None,
                 deterministic: bool = False, config: EngineConfig | None = None,
                 batch_invariant: bool = False, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1) -> None:
        """``deterministic=True``: bitwise-identical numbers whatever else shares the batch, in any
        order, under any budget, chunked or not, prefix shared or not (native models; fixed-shape
        tiles everywhere, see EngineConfig), and whatever the TP size. ``batch_invariant`` is its
        old name.

        ``tensor_parallel_size`` / ``data_parallel_size``: the model split over N ranks, and M such
        replicas; the library starts and owns the N * M worker processes (``parallel.workers``;
        GPUs 0 .. N*M - 1 on CUDA, gloo processes on CPU) and this process holds no weights. Under
        ``torchrun`` (a process group already initialised with N ranks) every rank makes its
        Scorer with the same arguments and calls it with the same inputs. ``close()`` stops the
        workers."""
        self.config = config or EngineConfig(max_batch_tokens=max_batch_tokens, progress=progress,
                                             deterministic=deterministic or batch_invariant)
        if tensor_parallel_size != 1 or data_parallel_size != 1:
            from .parallel.engine import parallel_parts

            self.loaded, self.engine, self.device = parallel_parts(model, device, dtype, self.config,
                                                                   tensor_parallel_size, data_parallel_size)
        else:
            self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device, dtype)
            self.device = next(self.loaded.model.parameters()).device
            self.engine = Engine(self.loaded.model, self.config, self.device)
        self.tokenizer = self.loaded.tokenizer
        self.info = self.loaded.info
        self.weights_version = 0  # +1 per successful update_weights / load_weights

    def close(self) -> None:
        """Stop worker processes (parallel scorers); a no-op otherwise."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- continuations -------------------------------------------------------------------------

    def score(self, prompt: str, continuations: str | Sequence[str], *, temperature: float = 1.0,
              top_k: int = 0, entropy: bool = False, capture: Sequence[dict] | None = None,
              steer: Sequence[dict] | None = None) -> list[ContinuationScore]:
        """``capture`` / ``steer``: hidden-state reads and interventions of this call (see
        ``interp.specs`` for positions, ``layers.hooks`` for the ops); with neither, the forward is
        the plain one."""
        return self.run(self.score_job(prompt, continuations, temperature=temperature, top_k=top_k,
                                       entropy=entropy, capture=capture, steer=steer))

    def run(self, job: Job) -> Any:
        """Run a job's requests on this scorer's engine and finish it."""
        return job.finish(self.engine.run(job.requests))

    def score_job(self, prompt: str, continuations: str | Sequence[str], *, temperature: float = 1.0,
                  top_k: int = 0, entropy: bool = False, capture: Sequence[dict] | None = None,
                  steer: Sequence[dict] | None = None) -> Job:
        """Score each continuation after ``prompt``.

        Prompt and continuation are encoded jointly and split (trailing prompt whitespace moves
        to the continuation); the last prompt token's row predicts the first continuation token:

            tokens : [The] [capital] [of] [France] [is] | [ĠParis]
            rows   :   0       1      2      3      4
            row 4 -> log p(ĠParis | The capital of France is)

        An empty prompt is replaced by the prefix token (BOS, else EOS).
        """
        if isinstance(continuations, str):
            continuations = [continuations]
        if not isinstance(prompt, str):
            raise LogprobeError("prompt", f"must be a string, got {type(prompt).__name__}")
        check_text(prompt, "prompt")
        if not continuations:
            raise LogprobeError("continuations", "is empty", "give at least one continuation")
        temperature, top_k = self._options(temperature, top_k)
        caps, steers = self.hook_specs(capture, steer)
        requests, texts = [], []
        n_spaces = len(prompt) - len(prompt.rstrip())
        for i, c in enumerate(continuations):
            if not isinstance(c, str):
                raise LogprobeError("continuations", f"must be strings, got {type(c).__name__}")
            check_text(c, f"continuations[{i}]")
            ctx, cont = self._split(prompt, c)
            self._check_length(len(ctx) + len(cont), "prompt + continuation")
            st, ca = request_hooks(caps, steers, len(ctx) + len(cont), len(ctx),
                                   f"continuations[{i}]: " if len(continuations) > 1 else "",
                                   exact_sums=self.config.deterministic)
            requests.append(ScoreRequest(ctx + cont, len(ctx), temperature, top_k, entropy, st, ca))
            texts.append((prompt[len(prompt) - n_spaces:] if n_spaces else "") + c)
        return Job(requests, lambda results: [self._continuation_score(t, r, res, caps)
                                              for t, r, res in zip(texts, requests, results)])

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per pair, as lm-eval's ``loglikelihood``."""
        return self.run(self.loglikelihood_job(pairs))

    def loglikelihood_job(self, pairs: Sequence[tuple[str, str]]) -> Job:
        requests = []
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise LogprobeError(f"pairs[{i}]", "must be a (context, continuation) pair of strings")
            check_text(pair[0], f"pairs[{i}][0]"), check_text(pair[1], f"pairs[{i}][1]")
            ctx, cont = self._split(pair[0], pair[1])
            self._check_length(len(ctx) + len(cont), f"pairs[{i}]")
            requests.append(ScoreRequest(ctx + cont, len(ctx)))
        return Job(requests, lambda results: [(float(r.logprobs.double().sum()), bool((r.ranks == 0).all()))
                                              for r in results])

    # -- token ids (reinforcement learning) ----------------------------------------------------

    def logprobs(self, sequences: Sequence[dict], temperature: float = 1.0, top_k: int = 0,
                 entropy: bool = False, capture: Sequence[dict] | None = None,
                 steer: Sequence[dict] | None = None) -> list[SequenceLogprobs]:
        """Per-token log-probs of completions, for PPO/GRPO ratios and KL terms.

        Each sequence is ``{"prompt_token_ids": [...], "completion_token_ids": [...]}``. Scores are
        ``log_softmax(logits / temperature)`` at the rows that predict completion tokens:

            ids  : p0 p1 p2 | c0 c1 c2
            row  :  0  1  2    3  4
            row 2 -> c0, row 3 -> c1, row 4 -> c2       (3 log-probs for 3 completion tokens)
        """
        return self.run(self.logprobs_job(sequences, temperature, top_k, entropy, capture, steer))

    def logprobs_job(self, sequences: Sequence[dict], temperature: float = 1.0, top_k: int = 0,
                     entropy: bool = False, capture: Sequence[dict] | None = None,
                     steer: Sequence[dict] | None = None) -> Job:
        temperature, top_k = self._options(temperature, top_k)
        if isinstance(sequences, (str, bytes, dict)) or not isinstance(sequences, Sequence) or not sequences:
            raise LogprobeError("sequences", "must be a non-empty list of objects with prompt_token_ids and "
                                "completion_token_ids")
        caps, steers = self.hook_specs(capture, steer)
        requests = [self.sequence_request(seq, i, temperature, top_k, entropy, caps, steers)
                    for i, seq in enumerate(sequences)]
        return Job(requests, lambda results: [self.sequence_result(r, res, caps) for r, res in zip(requests, results)])

    @staticmethod
    def sequence_result(req: ScoreRequest, r: RequestResult, caps: list[CaptureSpec]) -> SequenceLogprobs:
        return SequenceLogprobs(r.logprobs, r.ranks, r.entropy, r.topk_ids, r.topk_logprobs,
                                capture_results(caps, req.capture, r.captures) if caps else None)

    def hook_specs(self, capture, steer) -> tuple[list[CaptureSpec], list[SteerSpec]]:
        """Validated ``capture`` / ``steer`` lists against this model's depth and width."""
        if not capture and not steer:
            return [], []
        model = self.loaded.model
        if not getattr(model, "supports_hooks", False):
            raise LogprobeError("steer" if steer else "capture", f"the {self.info.backend} backend has no hook points",
                                "use a native model (GGUF or a Llama-family directory)")
        L, H = model.config.num_layers, model.config.hidden_size
        return parse_capture(capture, L, H), parse_steer(steer, L, H)

    def sequence_request(self, seq: dict, i: int, temperature: float, top_k: int, entropy: bool,
                         caps: list[CaptureSpec] = (), steers: list[SteerSpec] = ()) -> ScoreRequest:
        """Validate one RL sequence and turn it into a request (used by the CLI's streaming mode)."""
        if not isinstance(seq, dict):
            raise LogprobeError(f"sequences[{i}]", "must be an object with prompt_token_ids and completion_token_ids")
        prompt = self.check_ids(seq.get("prompt_token_ids"), f"sequences[{i}].prompt_token_ids")
        completion = self.check_ids(seq.get("completion_token_ids"), f"sequences[{i}].completion_token_ids")
        if not prompt:
            raise LogprobeError(f"sequences[{i}].prompt_token_ids", "is empty: the first completion token needs "
                                "a context", "prepend the BOS (or EOS) token id")
        if not completion:
            raise LogprobeError(f"sequences[{i}].completion_token_ids", "is empty", "give at least one token")
        self._check_length(len(prompt) + len(completion), f"sequences[{i}]")
        st, ca = request_hooks(list(caps), list(steers), len(prompt) + len(completion), len(prompt),
                               f"sequences[{i}]: ", exact_sums=self.config.deterministic)
        return ScoreRequest(prompt + completion, len(prompt), temperature, top_k, entropy, st, ca)

    def logprobs_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_mask: torch.Tensor | None = None, *, num_response_tokens: int | None = None,
                        temperature: float = 1.0, entropy: bool = False, top_k: int = 0) -> AlignedLogprobs:
        """Log-probs of the response tokens of a padded RL batch, as tensors in the trainer's layout.

        ``input_ids`` / ``attention_mask`` [bs, L] (left, right or both padded), ``response_mask``
        [bs, R] over the last R columns (verl's ``response_mask``, OpenRLHF's ``action_mask``), or
        ``num_response_tokens`` R (TRL's ``logits_to_keep``; the mask is then
        ``attention_mask[:, -R:]``). Returns ``scoring.padded.AlignedLogprobs`` of [bs, R] float32
        tensors on ``input_ids``' device, 0 where masked; column j is log p(input_ids[:, L-R+j] |
        the real tokens before it), of ``log_softmax(logits / temperature)``:

            ids  : .  p0 p1 | r0 r1 .          (. = padding)
            out  :          [lp(r0|p0 p1), lp(r1|p0 p1 r0), 0]

        Packed internally (padding is never computed): the same requests, hence the same numbers,
        as ``logprobs`` on the rows' real tokens. ``scoring.padded`` draws the layout in full."""
        return self.run(self.logprobs_padded_job(input_ids, attention_mask, response_mask,
                                                 num_response_tokens=num_response_tokens, temperature=temperature,
                                                 entropy=entropy, top_k=top_k))

    def logprobs_padded_job(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            response_mask: torch.Tensor | None = None, *, num_response_tokens: int | None = None,
                            temperature: float = 1.0, entropy: bool = False, top_k: int = 0) -> Job:
        plan = plan_padded(attention_mask, response_mask, num_response_tokens)
        return self._aligned_job(plan, input_ids, temperature, entropy, top_k)

    def logprobs_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, score_start: torch.Tensor, *,
                        temperature: float = 1.0, entropy: bool = False, top_k: int = 0) -> AlignedLogprobs:
        """Log-probs of a packed (THD) batch: ``input_ids`` [T] holds the sequences back to back
        (sequence i = ``input_ids[cu_seqlens[i]:cu_seqlens[i+1]]``), each scored from its own index
        ``score_start[i]`` (>= 1) on. Returns [T] float32 tensors aligned with ``input_ids``, 0 where
        not scored: ``out[cu_seqlens[i] + t]`` = log p(token t of sequence i | its tokens < t)."""
        return self.run(self.logprobs_packed_job(input_ids, cu_seqlens, score_start, temperature=temperature,
                                                 entropy=entropy, top_k=top_k))

    def logprobs_packed_job(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, score_start: torch.Tensor, *,
                            temperature: float = 1.0, entropy: bool = False, top_k: int = 0) -> Job:
        return self._aligned_job(plan_packed(input_ids, cu_seqlens, score_start), input_ids, temperature,
                                 entropy, top_k)

    def _aligned_job(self, plan: Plan, input_ids: torch.Tensor, temperature: float, entropy: bool,
                     top_k: int) -> Job:
        temperature, top_k = self._options(temperature, top_k)
        if not isinstance(entropy, bool):
            raise LogprobeError("entropy", f"must be true or false, got {entropy!r}")
        requests = plan_requests(plan, input_ids, self.info.vocab_size, self.info.max_length, temperature, top_k,
                                 entropy)
        device = input_ids.device
        return Job(requests, lambda results: gather_results(results, plan, device, entropy, top_k))

    # -- new weights (reinforcement learning) --------------------------------------------------

    def update_weights(self, named_tensors) -> int:
        """Replace every weight with ``(Hugging Face name, tensor)`` pairs (float32/bfloat16/float16;
        a dict, a list, or an iterator that streams them), all or nothing: a missing, extra, repeated
        or mis-shaped name raises naming it and the old weights stay in force. Scores afterwards equal
        a fresh Scorer's on the new weights (bitwise in deterministic mode). A list or dict is
        checked whole, then copied in place; an iterator is staged on the model's device (one more
        copy of the weights at most). Returns the new ``weights_version``. Tensor/data-parallel
        scorers cut each tensor into its ranks' slices and send them to the workers, which stage them
        and copy in once all confirm. Mixture-of-experts models take experts one by one (checkpoint
        names) or stacked (transformers' in-memory ``experts.gate_up_proj``). Refused for
        packed-quantized models (GGUF blocks, compressed-tensors) and the transformers backend
        (``loading.update``)."""
        from .loading.update import update_weights

        update_weights(self.loaded.model, named_tensors, engine=self._workers())
        self.weights_version += 1
        return self.weights_version

    def load_weights(self, path: str) -> int:
        """``update_weights`` from a safetensors file or a Hugging Face checkpoint directory: every
        header is checked before one tensor is read, then tensors are copied in one at a time."""
        from .loading.update import load_weights

        load_weights(self.loaded.model, path, engine=self._workers())
        self.weights_version += 1
        return self.weights_version

    def _workers(self):
        """The engine of worker processes that hold the weights (tensor/data parallel), else None."""
        return None if isinstance(self.engine, Engine) else self.engine

    # -- hidden states and steering vectors ----------------------------------------------------

    def last_token_states(self, texts: Sequence[str], layers: Sequence[int], field: str = "texts") -> torch.Tensor:
        """``blocks.{l}.resid_post`` at each text's last token -> float32 [len(texts), len(layers), H]."""
        if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
            raise LogprobeError(field, "must be a non-empty list of texts")
        at = [f"blocks.{layer}.resid_post" for layer in layers]
        caps, _ = self.hook_specs([{"at": at, "positions": "last", "reduce": "last"}], None)
        requests = []
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t:
                raise LogprobeError(f"{field}[{i}]", "must be a non-empty string")
            check_text(t, f"{field}[{i}]")
            ids = self.tokenizer.encode(t)
            if self.tokenizer.add_bos:
                ids = [self.tokenizer.bos_id] + ids
            if len(ids) < 2:
                ids = [self.tokenizer.prefix_id] + ids
            self._check_length(len(ids), f"{field}[{i}]")
            _, ca = request_hooks(caps, [], len(ids), len(ids) - 1)
            requests.append(ScoreRequest(ids, len(ids) - 1, capture=ca))
        results = self.engine.run(requests)
        return torch.stack([torch.stack([v[0] for v in r.captures]) for r in results])

    def train_vector(self, positive: Sequence[str], negative: Sequence[str], layers: Sequence[int] | None = None,
                     method: str = "pca_diff") -> SteeringVector:
        """A reading/steering vector per layer from contrasting prompts (``interp.vectors``):
        captured last-token ``resid_post`` states of ``positive[i]`` vs ``negative[i]``. Layers
        default to 1..L-1 (llama.cpp cannot steer block 0). Save it with ``.save_gguf(path)``."""
        check_method(method)
        L = self.loaded.model.config.num_layers if getattr(self.loaded.model, "supports_hooks", False) else 0
        layers = list(range(1, L)) if layers is None else [int(x) for x in layers]
        if not layers:
            raise LogprobeError("layers", "is empty", "name at least one layer")
        if method == "pca_diff" and len(positive) != len(negative):
            raise LogprobeError("negative", f"has {len(negative)} prompts, positive has {len(positive)}",
                                "pca_diff pairs positive[i] with negative[i]: give equally many")
        names = [resolve_points(f"blocks.{x}.resid_post", L)[0] if L else "" for x in layers]
        pos = self.last_token_states(positive, layers, "positive")  # [n, layers, H]
        neg = self.last_token_states(negative, layers, "negative")
        dirs = {point_layer(n): direction_from_states(pos[:, j], neg[:, j], method) for j, n in enumerate(names)}
        return SteeringVector(dirs, method)

    # -- perplexity ----------------------------------------------------------------------------

    def perplexity(self, texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
                   context_length: int | None = None, stride: int | None = None, policy: str = "sliding",
                   prefix: bool | None = None, max_tokens: int | None = None,
                   return_token_nlls: bool = False, capture: Sequence[dict] | None = None,
                   steer: Sequence[dict] | None = None) -> PerplexityResult:
        """Token perplexity with a standard error, and word/byte perplexity and bits per byte.

        Each text is one token stream, cut into windows by ``scoring.windows`` (``policy``
        "sliding": every token scored once with up to ``context_length - stride`` tokens of extra
        context; "rolling": lm-eval's loglikelihood_rolling, disjoint scored spans each with a full
        window of context; "llama.cpp": non-overlapping chunks, second half scored). ``prefix``
        (default: on for "sliding" and "rolling", off for "llama.cpp") puts the prefix token (BOS, else EOS) before each
        text so its first token is scored too, as lm-eval's rolling log-likelihood does:

            stream : [BOS] t0 t1 t2 ...       row of BOS -> t0, row of t0 -> t1, ...

        ``max_tokens`` keeps the first N tokens of each text. Default context: min(2048, model's);
        default stride: context_length // 4.

        ``steer`` / ``capture`` positions count each text's own tokens (not the prefix token):
        ``all``, ``last``, an index or ``[start, end]``. A steered token is steered in every window
        that feeds it; a captured token is read in the window that scores it (the first window
        for tokens no window scores), so its state has that window's context.
        """
        return self.run(self.perplexity_job(texts, context_length=context_length, stride=stride, policy=policy,
                                            prefix=prefix, max_tokens=max_tokens,
                                            return_token_nlls=return_token_nlls, capture=capture, steer=steer))

    def perplexity_job(self, texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
                       context_length: int | None = None, stride: int | None = None, policy: str = "sliding",
                       prefix: bool | None = None, max_tokens: int | None = None,
                       return_token_nlls: bool = False, capture: Sequence[dict] | None = None,
                       steer: Sequence[dict] | None = None) -> Job:
        caps, steers = self.hook_specs(capture, steer)
        streams, raw_texts = self._perplexity_streams(texts, max_tokens)
        if context_length is None:
            context_length = min(2048, self.info.max_length)
        self._check_length(context_length, "context_length")
        if stride is None and policy == "sliding":
            stride = max(1, context_length // 4)
        use_prefix = (policy != "llama.cpp") if prefix is None else bool(prefix)
        requests, owners = [], []
        text_hooks = []  # per text: its whole-stream SteerAt / CaptureAt, before windowing
        for t, ids in enumerate(streams):
            n_text = len(ids)
            if use_prefix:
                ids = [self.tokenizer.prefix_id] + ids
            elif self.tokenizer.add_bos:
                ids = [self.tokenizer.bos_id] + ids
            off = len(ids) - n_text
            name = "texts" if len(streams) == 1 and texts and isinstance(texts[0], int) else f"texts[{t}]"
            if len(ids) < 2:  # a one-token stream predicts nothing
                raise LogprobeError(name, f"has {n_text} token{'s' * (n_text != 1)}: perplexity needs at least one "
                                    "scored token (the first token has no context)",
                                    "give a longer text" + ("" if use_prefix else " or set prefix true"))
            st, ca = request_hooks(caps, steers, n_text, 0, f"texts[{t}]: " if len(streams) > 1 else "",
                                   need_prompt=False, offset=off, exact_sums=self.config.deterministic)
            text_hooks.append((ca, off))
            try:
                windows = make_windows(policy, len(ids), context_length, stride)
            except LogprobeError as e:
                raise (LogprobeError(name, e.problem, e.fix) if e.field == "text" else e) from None
            for wi, w in enumerate(windows):
                toks = ids[w.begin:w.end]
                if policy == "llama.cpp" and self.tokenizer.add_bos:
                    toks = [self.tokenizer.bos_id] + toks[1:]  # llama-perplexity puts BOS first in every chunk
                w_steer = tuple(SteerAt(s.point, local, s.op, s.vector, s.coeff) for s in st
                                if (local := tuple(k - w.begin for k in s.positions if w.begin <= k < w.end)))
                lo = 0 if wi == 0 else w.score_begin  # tokens no window scores are read in the first
                w_capture = tuple(CaptureAt(c.point, tuple(k - w.begin for k in c.positions if lo <= k < w.end),
                                            c.kind, c.vector) for c in ca)
                requests.append(ScoreRequest(toks, w.score_begin - w.begin, steer=w_steer,
                                             capture=tuple(c for c in w_capture if c.positions)))
                owners.append((t, w_capture))
        if (scored := sum(r.num_scored for r in requests)) < 2:  # one NLL has no standard error (nan)
            raise LogprobeError(name if len(streams) == 1 else "texts", f"gives only {scored} scored token: a "
                                "perplexity and its standard error need at least 2", "give a longer text (or more texts)")
        finish = lambda results: self._perplexity_result(  # noqa: E731
            results, owners, len(streams), raw_texts, policy, context_length, stride, max_tokens, return_token_nlls,
            caps, text_hooks)
        return Job(requests, finish)

    @staticmethod
    def _perplexity_result(results, owners, n_streams, raw_texts, policy, context_length, stride, max_tokens,
                           return_token_nlls, caps=(), text_hooks=()) -> PerplexityResult:
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
            from .engine.runner import _join

            captures = [capture_results(list(caps), ca, [_join(ps, c.kind) for ps, c in zip(pieces[t], ca)], off)
                        for t, (ca, off) in enumerate(text_hooks)]
        nlls = [x for text_nlls in per_text for x in text_nlls]
        mean, se = mean_and_stderr(nlls)
        total = math.fsum(nlls)
        out = PerplexityResult(
            perplexity=_exp(mean), perplexity_stderr=_exp(mean) * se, nll_mean=mean, nll_stderr=se,
            num_tokens=len(nlls), num_windows=len(results), policy=policy, context_length=context_length,
            stride=stride if policy == "sliding" else None,
            token_nlls=per_text if return_token_nlls else None, captures=captures)
        if raw_texts is not None and max_tokens is None:
            out.num_words = sum(count_words(t) for t in raw_texts)
            out.num_bytes = sum(len(t.encode("utf-8")) for t in raw_texts)
            out.word_perplexity = _exp(total / out.num_words)
            out.byte_perplexity = _exp(total / out.num_bytes)
            out.bits_per_byte = total / out.num_bytes / math.log(2)
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _perplexity_streams(self, texts, max_tokens):
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
            streams = self.tokenizer.encode_batch(list(texts))
            raw = list(texts)
        elif all(isinstance(t, int) for t in texts):
            streams, raw = [self.check_ids(texts, "texts")], None
        else:
            streams = [self.check_ids(t, f"texts[{i}]") for i, t in enumerate(texts)]
            raw = None
        if max_tokens is not None:
            streams = [s[:max_tokens] for s in streams]
        return streams, raw

    def _split(self, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        return split_continuation(prompt, continuation, tok.encode, tok.prefix_id, tok.add_bos, tok.bos_id)

    def check_ids(self, ids, name: str) -> list[int]:
        if not isinstance(ids, (list, tuple)) and not (isinstance(ids, torch.Tensor) and ids.ndim == 1):
            raise LogprobeError(name, "must be a list of token ids")
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        vocab = self.info.vocab_size
        for j, x in enumerate(ids):
            if not isinstance(x, int) or isinstance(x, bool):
                raise LogprobeError(f"{name}[{j}]", f"must be an integer token id, got {x!r}")
            if not 0 <= x < vocab:
                raise LogprobeError(f"{name}[{j}]", f"token id {x} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_length(self, n: int, name: str) -> None:
        if n > self.info.max_length:
            raise LogprobeError(name, f"{n} tokens exceed the model's context of {self.info.max_length}",
                                "shorten the input")

    @staticmethod
    def _options(temperature: float, top_k: int) -> tuple[float, int]:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature <= 0:
            raise LogprobeError("temperature", f"must be a finite number > 0, got {temperature!r}")
        if temperature < MIN_TEMPERATURE:  # refused here, before a batch: the head would fail every request in it
            raise LogprobeError("temperature", f"{temperature!r} is below {MIN_TEMPERATURE:g}: logits / temperature "
                                "would overflow float32", f"use a temperature >= {MIN_TEMPERATURE:g}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise LogprobeError("top_k", f"must be an integer >= 0, got {top_k!r}")
        return float(temperature), top_k

    def _continuation_score(self, text: str, req: ScoreRequest, res: RequestResult,
                            caps: list[CaptureSpec] = ()) -> ContinuationScore:
        ids = req.tokens[req.score_begin:]
        lps = res.logprobs.tolist()
        total = float(res.logprobs.double().sum())
        top = None
        if res.topk_ids is not None:
            texts = self.tokenizer.token_texts(res.topk_ids.flatten().tolist())
            k = res.topk_ids.shape[1]
            top = [[(int(i), texts[r * k + c], float(lp)) for c, (i, lp) in enumerate(zip(ids_row, lp_row))]
                   for r, (ids_row, lp_row) in enumerate(zip(res.topk_ids.tolist(), res.topk_logprobs.tolist()))]
        return ContinuationScore(
            continuation=text, log_prob=total, prob=_exp(total), perplexity=_exp(-total / len(ids)),
            num_tokens=len(ids), is_greedy=bool((res.ranks == 0).all()), tokens=self.tokenizer.token_texts(ids),
            token_ids=ids, token_logprobs=lps, entropy=res.entropy.tolist() if res.entropy is not None else None,
            top_k=top, captures=capture_results(list(caps), req.capture, res.captures) if caps else None)

    # -- quantization quality ------------------------------------------------------------------

    def compare(self, reference: Scorer | LoadedModel | str | None,
                texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
                context_length: int | None = None, stride: int | None = None, policy: str = "sliding",
                prefix: bool | None = None, max_tokens: int | None = None, return_token_stats: bool = False):
        """This scorer's model (Q, e.g. quantized) against ``reference`` (R) on the same windows.

        Texts are tokenized once, by this scorer's tokenizer, and cut into windows as ``perplexity``
        does; both models score the same token ids, so they must share a tokenizer and vocabulary.
        Returns ``scoring.compare.CompareResult``: PPL(Q), PPL(R), their ratio, KL(R || Q) over the
        full vocabulary (mean ± stderr, max, percentiles), same-top-token rate and Δp statistics,
        as llama.cpp's ``--kl-divergence``. ``reference`` may be a Scorer, a LoadedModel or a model
        spec (loaded on this scorer's device)."""
        from .scoring.compare import compare_requests, compare_stats

        if not isinstance(self.engine, Engine):
            raise LogprobeError("tensor_parallel_size", "compare runs both models in this process",
                                "compare with scorers made without tensor_parallel_size / data_parallel_size")

        if not isinstance(reference, Scorer):
            reference = Scorer(reference, device=str(self.device), config=self.config)
        a, b = self.tokenizer.hf, reference.tokenizer.hf
        if self.info.vocab_size != reference.info.vocab_size or len(a) != len(b) or a.get_vocab() != b.get_vocab():
            raise LogprobeError("reference", f"{reference.info.name} does not share the vocabulary of {self.info.name} "
                                f"({reference.info.vocab_size} vs {self.info.vocab_size} logits, {len(b)} vs {len(a)} "
                                "tokens)", "compare models with the same tokenizer (e.g. two quantizations of one model)")
        job = self.perplexity_job(texts, context_length=context_length, stride=stride, policy=policy, prefix=prefix,
                                  max_tokens=max_tokens)
        rows = compare_requests(self.engine, reference.engine, job.requests, token_budget=self.config.max_batch_tokens,
                                token_chunk=self.config.head_token_chunk, vocab_chunk=self.config.head_vocab_chunk)
        ctx = context_length if context_length is not None else min(2048, self.info.max_length)
        if stride is None and policy == "sliding":
            stride = max(1, ctx // 4)
        return compare_stats(rows, len(job.requests), policy, ctx, stride if policy == "sliding" else None,
                             return_token_stats)


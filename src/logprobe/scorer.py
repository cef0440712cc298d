"""The public API: ``Scorer`` scores continuations, sequences of token ids and perplexity.

Every method states which rows predict which tokens; see ``scoring.contract`` for the full
contract and ``scoring.windows`` for how perplexity windows overlap. The methods build a ``Job``
(``scoring.work``) in the ``scoring`` module of their kind, from the scorer's ``ScoringContext``
and the option records of ``scoring.options``, and run it on the scorer's executor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .config import EngineConfig
from .engine.prefix_run import prefix_cache_for
from .engine.runner import Engine
from .engine.warmup import warmup_rounds, warmup_tokens
from .errors import LogprobeError
from .executor.cached import with_cache
from .executor.engine import parallel_parts
from .executor.interface import Executor
from .interp.vectors import SteeringVector
from .loading import LoadedModel, load_model
from .loading.collective import DEFAULT_GROUP, RECEIVE_TIMEOUT, Received, WeightGroups
from .loading.dummy import check_load_format
from .loading.loader import attention_layout
from .loading.update import InPlaceWrites, load_weights, note_kept, update_weights
from .scoring import chat as chat_scoring
from .scoring import continuations as text_scoring
from .scoring import perplexity as ppl_scoring
from .scoring import sequences as id_scoring
from .scoring import states
from .scoring.compare import compare_models
from .scoring.inputs import MIN_TEMPERATURE
from .scoring.options import HeadOptions, HookSpecs, Windows
from .scoring.padded import AlignedLogprobs, plan_packed, plan_padded
from .scoring.results import ContinuationScore, PerplexityResult, SequenceLogprobs
from .scoring.work import Job, ScoringContext

# Job and the result types are imported from here by the server, integrations and ``logprobe``.
__all__ = ["MIN_TEMPERATURE", "ContinuationScore", "Job", "PerplexityResult", "Scorer", "SequenceLogprobs"]


class Scorer:
    """Exact log-probabilities of given text.

    >>> s = Scorer()                       # SmolLM2-135M-Instruct Q4_1, CPU float32
    >>> [r.continuation for r in s.score("The capital of France is", [" Paris", " London"])]
    [' Paris', ' London']
    """

    def __init__(self, model: str | LoadedModel | None = None, *, device: str | None = "auto",
                 dtype: str | None = "auto", max_batch_tokens: int | None = None, progress: bool | None = None,
                 deterministic: bool = False, config: EngineConfig | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, cache: str | None = None,
                 prefix_cache: bool | int | None = None, expert_parallel_size: int | None = None,
                 attention_parallel: str | None = None, load_format="auto",
                 redundant_experts: int = 0, expert_loads=None) -> None:
        """``deterministic=True``: bitwise-identical numbers whatever else shares the batch, in any
        order, under any budget, chunked or not, prefix shared or not (native models; fixed-shape
        tiles everywhere, see EngineConfig), and whatever the TP size.

        ``tensor_parallel_size`` / ``data_parallel_size``: the model split over N ranks, and M such
        replicas; the library starts and owns the N * M worker processes (``executor.workers``;
        GPUs 0 .. N*M - 1 on CUDA, gloo processes on CPU) and this process holds no weights. Under
        ``torchrun`` (a process group already initialised with N ranks) every rank makes its
        Scorer with the same arguments and calls it with the same inputs. ``close()`` stops the
        workers. ``expert_parallel_size``: a mixture of experts' experts in M groups over the N
        ranks of a replica (M divides N and the expert count; rank r holds group r // (N / M),
        each of its experts split N / M ways; None: N, whole experts per rank, where N divides
        the expert count, else 1); deterministic mode gives the same bits at every N and M
        (docs/parallel.md). ``attention_parallel``: how a mixture of experts' attention, norms
        and dense blocks split over the N ranks: ``"data"`` (whole on every rank, each rank
        running its share of the batch's sequences; the default where the experts are whole per
        rank, M = N > 1, for the Llama-family and DeepSeek-style mixtures of experts) or
        ``"tensor"`` (split by heads and columns, every rank running every row).
        ``redundant_experts`` R with ``expert_loads`` (tokens routed to each expert, e.g. counted
        on a warm-up pass): each rank also holds up to R replicas of the hottest experts, placed to
        even the ranks' loads, and a hot expert's tokens are split among its holders
        (``parallel.placement``; whole experts per rank, M = N > 1); deterministic mode's bits
        are unchanged (docs/parallel.md, "Redundant experts").

        ``cache``: a directory of stored results (``executor.cached``): a request scored before
        under the same weights, tokenizer, dtype, device kind, deterministic mode and options is
        answered from it without a forward pass; new results are stored as they complete.

        ``prefix_cache``: keep the keys/values (and hybrid states) of token prefixes across calls
        and resume later requests from their longest cached prefix (``engine.prefix_cache``):
        True for the default budget (a quarter of free CUDA memory, 512 MiB on CPU), a number of
        bytes, or None/False (off, the default). Numbers are unchanged (bitwise in deterministic
        mode); cleared by new weights; ``prefix_cache_stats()`` reports hits and bytes held.
        Native models in this process only (not with tensor/data parallelism).

        ``load_format``: "auto" (the checkpoint's weights) or "dummy" (vLLM's name: random weights,
        each rank building its own shard on its own device from config.json alone, a directory
        of config.json and the tokenizer; ``loading.dummy.RandomWeights(seed, skew)`` for another
        seed or a skewed router): for speed measurements of models larger than the machine's disk
        (docs/parallel.md, "Random-weight shards"); their scores mean nothing."""
        random = check_load_format(load_format)  # None: the checkpoint's weights
        if random is not None and isinstance(model, LoadedModel):
            raise LogprobeError("load_format", "applies to a model named by its path, not a loaded model",
                                "pass the config directory's path")
        if random is not None and cache is not None:
            raise LogprobeError("cache", "random weights (load_format dummy) are not a model whose results "
                                "can be stored", "leave cache off")
        if (redundant_experts or expert_loads is not None) and tensor_parallel_size == 1:
            raise LogprobeError("redundant_experts", "replicas of experts need expert parallelism over 2 or "
                                "more ranks", "set tensor_parallel_size (and expert_parallel_size) > 1, or leave "
                                "redundant_experts and expert_loads out")
        config = engine_config(config, max_batch_tokens=max_batch_tokens, progress=progress,
                               deterministic=deterministic)
        if tensor_parallel_size != 1 or data_parallel_size != 1 or expert_parallel_size not in (None, 1):
            if prefix_cache:
                raise LogprobeError("prefix_cache", "is not available with tensor/data parallelism yet",
                                    "turn it off, or use one process (tensor_parallel_size=1, data_parallel_size=1)")
            self.loaded, self.engine, self.device = parallel_parts(model, device, dtype, config,
                                                                   tensor_parallel_size, data_parallel_size,
                                                                   expert_parallel_size, attention_parallel,
                                                                   load_format,
                                                                   redundant=redundant_experts, loads=expert_loads)
        else:
            self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device, dtype,
                                                                                  load_format=load_format)
            attention_layout(getattr(self.loaded.model, "config", None), 1, 1, attention_parallel)  # refuses a bad value
            self.device = next(self.loaded.model.parameters()).device
            self.engine = Engine(self.loaded.model, config, self.device)
            self.engine.prefix_cache = prefix_cache_for(self.loaded.model, prefix_cache, self.device)
        self.prefix_cache = getattr(self.engine, "prefix_cache", None)
        if cache is not None:  # hits answered from the cache, misses run and stored (versions: rehashed)
            self.engine = with_cache(self.engine, self.loaded, cache, lambda: self.weights_version,
                                     tensor_parallel_size, getattr(self.engine, "ep", expert_parallel_size or 1),
                                     self.attention_parallel)
        self.tokenizer = self.loaded.tokenizer
        self.info = self.loaded.info
        # what the job builders read about the model, built once (deterministic: renewed with config)
        self.context = ScoringContext.of(self.loaded, self.engine.config.deterministic)
        self.weights_version = 0  # +1 per successful update_weights / load_weights
        # the weights transformers holds as buffers that the last update left as they were (none of
        # them sent: ``loading.update.check_complete``), named as a trainer sends them
        self.kept_buffers: tuple[str, ...] = ()
        self._weight_version = "0"  # the caller's name for the weights (weight_version=), else str(weights_version)
        self._in_place = InPlaceWrites(self.engine)  # scoring refused while weights are written in place

    @property
    def attention_parallel(self) -> str:
        """The layout attention runs in over the ranks: "data" (each rank its share of the batch's
        sequences, attention whole) or "tensor" (split by heads; also with one rank)."""
        ctx = getattr(getattr(self.loaded, "model", None), "ctx", None)  # torchrun: this rank's model
        return getattr(self.engine, "attention", None) or getattr(ctx, "attention", None) or "tensor"

    @property
    def config(self) -> EngineConfig:
        """The engine's config, ``max_batch_tokens`` resolved (None at start: from the device)."""
        return self.engine.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Later calls run under ``config`` (``scorer.config = replace(scorer.config,
        deterministic=True)``); ``max_batch_tokens=None`` keeps the budget chosen at start."""
        self.engine.config = config
        self.context = replace(self.context, deterministic=bool(config.deterministic))

    @property
    def executor(self) -> Executor:
        """What runs this scorer's requests (``executor.interface``): the in-process engine or the
        worker processes' one. A server batches the requests of many jobs on it."""
        return self.engine

    def close(self) -> None:
        """Stop worker processes (parallel scorers) and leave weight update groups; a no-op otherwise."""
        if "_collective_groups" in self.__dict__:
            self._collective_groups.close()
        self.engine.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- continuations -------------------------------------------------------------------------

    def score(self, prompt: str, continuations: str | Sequence[str], *, temperature: float = 1.0,
              top_k: int = 0, entropy: bool = False, capture: Sequence[dict] | None = None,
              steer: Sequence[dict] | None = None, images: Sequence | None = None) -> list[ContinuationScore]:
        """``capture`` / ``steer``: hidden-state reads and interventions of this call (see
        ``interp.specs`` for positions, ``layers.hooks`` for the ops); with neither, the forward is
        the plain one. ``images``: see ``score_job``."""
        return self.run(self.score_job(prompt, continuations, temperature=temperature, top_k=top_k,
                                       entropy=entropy, capture=capture, steer=steer, images=images))

    def run(self, job: Job) -> Any:
        """Run a job's requests on this scorer's engine and finish it."""
        return job.finish(self.engine.run(job.requests))

    def score_job(self, prompt: str, continuations: str | Sequence[str], *, temperature: float = 1.0,
                  top_k: int = 0, entropy: bool = False, capture: Sequence[dict] | None = None,
                  steer: Sequence[dict] | None = None, images: Sequence | None = None) -> Job:
        """Score each continuation after ``prompt``.

        Prompt and continuation are encoded jointly and split (trailing prompt whitespace moves
        to the continuation); the last prompt token's row predicts the first continuation token:

            tokens : [The] [capital] [of] [France] [is] | [ĠParis]
            rows   :   0       1      2      3      4
            row 4 -> log p(ĠParis | The capital of France is)

        An empty prompt is replaced by the prefix token (BOS, else EOS).

        ``images`` (a model with a vision tower): the prompt's images (PIL images, paths, bytes,
        ``data:`` URLs), its placeholder once per image in ``prompt`` (Qwen3.5 ``<|image_pad|>``,
        Gemma ``<start_of_image>``), as ``logprobs``' ``images``; only the continuations' text is
        scored. All continuations share them: processed once, and their rows shared as a prefix
        (a multiple-choice question about an image):

            score(f"{PAD} Which animal is this? Answer:", [" a cat", " a dog"], images=[png])
        """
        return text_scoring.score_job(self.context, prompt, continuations, HeadOptions(temperature, top_k, entropy),
                                      HookSpecs(capture, steer), images=images)

    def score_chat(self, messages: Sequence[dict], *, temperature: float = 1.0, top_k: int = 0,
                   entropy: bool = False) -> ContinuationScore:
        """The final assistant message of a chat (OpenAI-style ``[{"role", "content"}, ...]``) given
        the messages before it, under the model's own chat template (``tokenizer.apply_chat_template``,
        its tokenization: no second BOS):

            context = template(messages[:-1], add_generation_prompt=True)
            scored  = template(messages)[len(context):]   (the message, its end-of-turn marker, ...)

        Returns a ``ContinuationScore``: ``continuation`` is the scored tokens' text, then
        ``log_prob``, ``tokens``, ``token_ids``, ``token_logprobs`` per token (``scoring.chat``).
        A model without a chat template raises ``LogprobeError``."""
        return self.run(self.score_chat_job(messages, temperature=temperature, top_k=top_k, entropy=entropy))

    def score_chat_job(self, messages: Sequence[dict], *, temperature: float = 1.0, top_k: int = 0,
                       entropy: bool = False) -> Job:
        return chat_scoring.chat_job(self.context, messages, HeadOptions(temperature, top_k, entropy))

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per pair, as lm-eval's ``loglikelihood``."""
        return self.run(self.loglikelihood_job(pairs))

    def loglikelihood_job(self, pairs: Sequence[tuple[str, str]]) -> Job:
        return text_scoring.loglikelihood_job(self.context, pairs)

    # -- token ids (reinforcement learning) ----------------------------------------------------

    def logprobs(self, sequences: Sequence[dict], temperature: float = 1.0, top_k: int = 0,
                 entropy: bool = False, capture: Sequence[dict] | None = None,
                 steer: Sequence[dict] | None = None, return_routed_experts: bool = False) -> list[SequenceLogprobs]:
        """Per-token log-probs of completions, for PPO/GRPO ratios and KL terms.

        Each sequence is ``{"prompt_token_ids": [...], "completion_token_ids": [...]}``. Scores are
        ``log_softmax(logits / temperature)`` at the rows that predict completion tokens:

            ids  : p0 p1 p2 | c0 c1 c2
            row  :  0  1  2    3  4
            row 2 -> c0, row 3 -> c1, row 4 -> c2       (3 log-probs for 3 completion tokens)

        Mixture-of-experts models (R3, SGLang's routed-experts shape): ``return_routed_experts``
        gives each result ``routed_experts``, int32 [len(ids) - 1, moe_layers, k]: row j holds the
        k experts token j was routed to at each MoE layer (the model's expert numbering, in the
        order the router ranks them) -- every token fed (prompt and completion; the last token is
        only a target), as SGLang's ``meta_info.routed_experts`` (which has a row per hidden layer,
        zeros in dense blocks: ``/generate`` answers so). In the example above, 5 rows:
        rows 0-1 are prompt routing, rows 2-4 the rows that score c0, c1, c2 (row j scores token
        j + 1). A sequence's ``"routed_experts"`` (same shape or SGLang's; list, array, tensor or
        SGLang's base64; a token's k experts distinct at each layer)
        forces those experts: each forced row's weights are its router's probabilities gathered at
        the given ids, normalised as the model normalises its own choice (``norm_topk_prob``,
        Mixtral's renormalisation), so replaying the returned routing gives bitwise the same numbers
        in deterministic mode. Requests forcing experts never share prefix rows with others.
        A dense model: ``LogprobeError`` naming the field.
        """
        return self.run(self.logprobs_job(sequences, temperature, top_k, entropy, capture, steer,
                                          return_routed_experts))

    def logprobs_job(self, sequences: Sequence[dict], temperature: float = 1.0, top_k: int = 0,
                     entropy: bool = False, capture: Sequence[dict] | None = None,
                     steer: Sequence[dict] | None = None, return_routed_experts: bool = False) -> Job:
        return id_scoring.logprobs_job(self.context, sequences, HeadOptions(temperature, top_k, entropy),
                                       HookSpecs(capture, steer), return_routed_experts)

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
        return id_scoring.aligned_job(self.context, plan, input_ids, HeadOptions(temperature, top_k, entropy))

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
        plan = plan_packed(input_ids, cu_seqlens, score_start)
        return id_scoring.aligned_job(self.context, plan, input_ids, HeadOptions(temperature, top_k, entropy))

    # -- new weights (reinforcement learning) --------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The served weights' name (SGLang's ``weight_version``): ``"0"`` at load, then the
        ``weight_version`` each successful ``update_weights``/``load_weights`` was given, else its
        count as a string (``"1"``, ``"2"``, ...). A failed update leaves it unchanged."""
        return self._weight_version

    def prefix_cache_stats(self) -> dict | None:
        """The prefix cache's counters (lookups, hits, cached_tokens, hit_rate, bytes, max_bytes,
        nodes, inserted/evicted tokens), or None when it is off."""
        return None if self.prefix_cache is None else self.prefix_cache.stats.as_dict()

    def warmup(self) -> dict:
        """Compile (and tune) ahead every kernel a scoring job meets: the rounds of
        ``engine.warmup`` (random token ids filling the budget, short and shared-prefix sequences,
        a chunked one, the head's options) run on the engine, their results dropped; the result
        cache is not consulted and the prefix cache is cleared after. Autotuned kernels' choices go
        to the tuning cache (``EngineConfig.tuning_cache``), so later processes start warm too.
        Returns seconds per round and in all, and the kernel choices recorded::

            {"rounds": {"full": 41.2, "small": 0.3, "shared": 0.4, "long": 1.1, "graphs": 2.1},
             "seconds": 45.1, "tokens": 41123, "tuned": 14, "graphs": 14}

        ``graphs``: the small-pass buckets captured as CUDA graphs (``EngineConfig.cuda_graph_tokens``;
        0 on CPU or without them), so that no first small request waits for a capture.
        """
        engine = getattr(self.engine, "inner", self.engine)  # not through the result cache
        rounds = warmup_rounds(self.info.vocab_size, self.config.max_batch_tokens, self.device.type)
        seconds, start = {}, time.perf_counter()
        for name, requests in rounds:
            t0 = time.perf_counter()
            engine.run(requests, progress=False)
            seconds[name] = round(time.perf_counter() - t0, 3)
        graphs = 0
        if hasattr(engine, "prepare_graphs"):  # every small-pass bucket captured (engine.graphs)
            t0 = time.perf_counter()
            graphs = engine.prepare_graphs()
            if graphs:
                seconds["graphs"] = round(time.perf_counter() - t0, 3)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        tuning = getattr(engine, "tuning", None)
        return {"rounds": seconds, "seconds": round(time.perf_counter() - start, 3),
                "tokens": warmup_tokens(rounds), "tuned": tuning.tuned if tuning is not None else 0,
                "graphs": graphs}

    def _bump(self, weight_version: str | None, kept: tuple[str, ...] = ()) -> int:
        self._in_place.done()  # every weight is new: a failed in-place update's refusal ends
        self.kept_buffers = kept
        if self.prefix_cache is not None:  # computed under the old weights
            self.prefix_cache.clear()
        self.weights_version += 1
        self._weight_version = str(self.weights_version) if weight_version is None else str(weight_version)
        return self.weights_version

    def update_weights(self, named_tensors, weight_version: str | None = None, *, in_place: bool = False) -> int:
        """Replace every weight with ``(Hugging Face name, tensor)`` pairs (float32/bfloat16/float16;
        a dict, a list, or an iterator that streams them), all or nothing: a missing, extra, repeated
        or mis-shaped name, or a tensor holding NaN or inf, raises naming it and the old weights stay
        in force. Scores afterwards equal a fresh Scorer's on the new weights (bitwise in
        deterministic mode). A list or dict is
        checked whole, then copied in place; an iterator is staged on the model's device (one more
        copy of the weights at most). Returns the new ``weights_version``. Tensor/data-parallel
        scorers cut each tensor into its ranks' slices and send them to the workers, which stage them
        and copy in once all confirm. Mixture-of-experts models take experts one by one (checkpoint
        names) or stacked (transformers' in-memory ``experts.gate_up_proj``). Refused for
        packed-quantized models (GGUF blocks, compressed-tensors) and the transformers backend
        (``loading.update``). ``weight_version`` names the new weights (``Scorer.weight_version``;
        default: the new ``weights_version`` as a string). The weights transformers holds as buffers
        (DeepSeek-V3's ``mlp.gate.e_score_correction_bias``, Gemma 4's ``layer_scalar``), when none is
        sent, keep their values: ``kept_buffers`` names them (a warning too). A vision tower's
        tensors (Qwen3.5's ``model.visual.*``) are taken where sent, the others kept (a trainer
        that freezes the tower sends the text model alone).

        ``in_place``: an iterator is written tensor by tensor as it comes, never staged (no second
        copy of the weights: for models that fill their devices); each tensor is still checked
        first. Scoring is refused (``errors.WeightsUnavailable``) from the first write until the
        stream ends complete; a stream that fails part way leaves the weights part old, part new,
        and scoring refused until an update completes."""
        if in_place:
            applied = self._in_place.run(lambda w: update_weights(self.loaded.model, named_tensors,
                                                                  engine=self._workers(), in_place=True,
                                                                  on_write=w), complete=True)
        else:
            applied = update_weights(self.loaded.model, named_tensors, engine=self._workers())
        return self._bump(weight_version, applied.kept)

    def load_weights(self, path: str, weight_version: str | None = None, *, in_place: bool = False) -> int:
        """``update_weights`` from a safetensors file or a Hugging Face checkpoint directory: every
        header is checked before one tensor is read, then tensors are copied in one at a time.
        ``in_place`` (tensor/data-parallel scorers): the workers copy in their slices as they come
        instead of staging their whole shard first (no second copy of the weights); a tensor found
        non-finite part way then leaves scoring refused (``errors.WeightsUnavailable``) until an
        update completes. One process never holds a second copy: it checks every value first."""
        workers = self._workers()
        if in_place and workers is not None:
            applied = self._in_place.run(lambda w: load_weights(self.loaded.model, path, engine=workers,
                                                                in_place=True, on_write=w), complete=True)
        else:
            applied = load_weights(self.loaded.model, path, engine=workers)
        return self._bump(weight_version, applied.kept)

    def _workers(self):
        """The engine of worker processes that hold the weights (tensor/data parallel), else None."""
        return None if self.engine.in_process else self.engine

    # -- new weights over a collective (SGLang's weight sync: ``loading.collective``) -----------

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl", *, timeout: float = 600.0,
                                  connect_timeout: float = 10.0, receive_timeout: float = RECEIVE_TIMEOUT,
                                  in_place: bool = False) -> None:
        """Join the trainer's process group ``group_name`` (SGLang's ``init_weights_update_group``):
        the trainer is rank 0 and hosts the store at ``master_address:master_port``, this scorer is
        rank ``rank_offset`` of ``world_size`` (2 .. 65536); ``backend`` "nccl" (model on CUDA) or
        "gloo". The group lives in a receiver process started now (``loading.receiver``: a
        trainer's faulty broadcast ends it, never this process). Blocks until every rank joined
        (``timeout`` s; the trainer's store must listen within ``connect_timeout`` s); each
        ``update_weights_from_distributed`` then receives within ``receive_timeout`` s. A scorer
        whose weights its tensor/data-parallel workers hold receives in this process (the driver:
        on its device, or host memory under gloo) and hands each rank its parts as
        ``update_weights`` does. ``in_place``: each bucket is written as it comes instead of held
        until the buckets cover the model (no second copy of the weights: for models that fill
        their devices); scoring is refused (``errors.WeightsUnavailable``; the server: 503) from the
        first bucket until the round covers the model, and after a bucket refused part way until
        a round completes."""
        self._weight_groups().join(self.device, master_address, master_port, rank_offset, world_size, group_name,
                                   backend, timeout=timeout, connect_timeout=connect_timeout,
                                   receive_timeout=receive_timeout, in_place=in_place)

    def receive_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence,
                                         group_name: str = DEFAULT_GROUP, weight_version: str | None = None
                                         ) -> Received:
        """The first half of ``update_weights_from_distributed``: the metadata checked against the
        model, then the tensors broadcast by rank 0 received into this process's memory and held
        with those of earlier buckets; the weights do not change (a server scores meanwhile). ->
        ``Received(tensors, version, complete, kept)``: every held (name, tensor) and the last
        ``weight_version`` given once they cover the model (``apply_received_weights`` them), else
        tensors None: more buckets to come. An ``in_place`` group hands on each bucket (``complete``:
        the round's last), to be applied with ``in_place=True``."""
        return self._weight_groups().receive(group_name, names, dtypes, shapes, self.loaded.model, weight_version)

    def apply_received_weights(self, named_tensors: list[tuple[str, torch.Tensor]],
                               weight_version: str | None = None, *, in_place: bool = False,
                               complete: bool = True, kept: tuple[str, ...] = (),
                               group_name: str = DEFAULT_GROUP) -> int:
        """The second half: ``update_weights`` of the received tensors (checks and errors name
        ``names``); returns the new ``weights_version`` (``kept_buffers``: the buffers it kept).
        ``in_place``: an in-place group's bucket (``Received``), checked whole and then written;
        ``complete`` (its round's last: then the version is bumped, ``kept`` the buffers the round
        left out) or not (the version stays, scoring stays refused). A bucket refused (a NaN: it is
        checked whole first, so none of it is written) ends the round of ``group_name``: the next
        bucket opens a new one, which must bring every weight again."""
        if not in_place:
            applied = update_weights(self.loaded.model, named_tensors, field="names", engine=self._workers())
            return self._bump(weight_version, applied.kept)
        try:
            self._in_place.run(lambda w: update_weights(self.loaded.model, named_tensors, field="names",
                                                        engine=self._workers(), whole=False, on_write=w),
                               complete=complete)
        except BaseException:
            self._weight_groups().drop_round(group_name)  # its buckets so far do not count toward a cover
            raise
        if not complete:
            return self.weights_version
        return self._bump(weight_version, note_kept(self.loaded.model, list(kept), {}) if kept else ())

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence,
                                        weight_version: str | None = None, flush_cache: bool = True,
                                        group_name: str = DEFAULT_GROUP) -> int:
        """SGLang's ``update_weights_from_distributed``: receive each tensor (``names[i]``, dtype
        ``dtypes[i]`` such as "bfloat16", shape ``shapes[i]``) by broadcast from rank 0 of the
        group, in order. The weights may come in several calls (the trainer's buckets): they are
        held until every parameter of the model has come (and every weight transformers holds as a
        buffer, once one of them has: ``loading.collective.covers``), then applied together as
        ``update_weights`` applies them, version bumped (named by the last ``weight_version``
        given; ``kept_buffers`` names the buffers none of which came). Buffers sent in a bucket
        after the one that completed the parameters are refused after receipt, naming
        ``names[i]``: the group stays usable (``WeightGroup.collect``). Before anything
        is received, a name the model does not have, a shape other than the model's, a name given
        twice (or held from an earlier bucket) or a shape without elements raises naming
        ``names[i]`` / ``shapes[i]``; so does a receive that fails or takes over
        ``receive_timeout`` s. Each of those leaves the group (the trainer's broadcasts cannot be
        received in step any more: join it again) and drops the held buckets; the old weights stay.
        A NaN is refused after receipt, naming ``names``: the held tensors are dropped, the old
        weights stay, the group stays usable. ``flush_cache``: accepted; nothing computed under
        the old weights is reused (the result cache is keyed by the weights' version). Returns the
        ``weights_version``: the new one once applied, the old one while held."""
        got = self.receive_weights_from_distributed(names, dtypes, shapes, group_name, weight_version)
        if got.tensors is None:
            return self.weights_version
        return self.apply_received_weights(got.tensors, got.version, in_place=got.in_place, complete=got.complete,
                                           kept=got.kept, group_name=group_name)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        """Leave the group (SGLang's ``destroy_weights_update_group``); the name can be joined again."""
        self._weight_groups().destroy(group_name)

    def _weight_groups(self) -> WeightGroups:
        groups = self.__dict__.get("_collective_groups")  # made on first use (setdefault: one, whatever the threads)
        return groups if groups is not None else self.__dict__.setdefault("_collective_groups", WeightGroups())

    # -- hidden states and steering vectors ----------------------------------------------------

    def last_token_states(self, texts: Sequence[str], layers: Sequence[int], field: str = "texts") -> torch.Tensor:
        """``blocks.{l}.resid_post`` at each text's last token -> float32 [len(texts), len(layers), H]."""
        return states.last_token_states(self.context, self.engine, texts, layers, field)

    def train_vector(self, positive: Sequence[str], negative: Sequence[str], layers: Sequence[int] | None = None,
                     method: str = "pca_diff") -> SteeringVector:
        """A reading/steering vector per layer from contrasting prompts (``interp.vectors``):
        captured last-token ``resid_post`` states of ``positive[i]`` vs ``negative[i]``. Layers
        default to 1..L-1 (llama.cpp cannot steer block 0). Save it with ``.save_gguf(path)``."""
        return states.train_vector(self.context, self.engine, positive, negative, layers, method)

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
        windows = Windows(context_length, stride, policy, prefix, max_tokens)
        return ppl_scoring.perplexity_job(self.context, texts, windows, HookSpecs(capture, steer), return_token_nlls)

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
        if not self.engine.in_process:
            raise LogprobeError("tensor_parallel_size", "compare runs both models in this process",
                                "compare with scorers made without tensor_parallel_size / data_parallel_size")

        if not isinstance(reference, Scorer):
            reference = Scorer(reference, device=str(self.device), config=self.config)
        return compare_models(self.context, self.engine, reference.context, reference.engine, texts,
                              Windows(context_length, stride, policy, prefix, max_tokens), return_token_stats)


def engine_config(config: EngineConfig | None, *, max_batch_tokens: int | None = None, progress: bool | None = None,
                  deterministic: bool = False) -> EngineConfig:
    """``config``, or one made of the keywords; both at once is a contradiction and raises (the
    keywords would be silently ignored).

    >>> engine_config(None, max_batch_tokens=64).max_batch_tokens
    64
    >>> engine_config(EngineConfig(), max_batch_tokens=64)
    Traceback (most recent call last):
    logprobe.errors.LogprobeError: max_batch_tokens: is given with config=EngineConfig(...), which already says it; set it in the config: EngineConfig(max_batch_tokens=...)
    """
    if config is None:
        return EngineConfig(max_batch_tokens=max_batch_tokens, progress=progress, deterministic=deterministic)
    given = {"max_batch_tokens": max_batch_tokens is not None, "progress": progress is not None,
             "deterministic": bool(deterministic)}
    for name, is_given in given.items():
        if is_given:
            raise LogprobeError(name, "is given with config=EngineConfig(...), which already says it",
                                f"set it in the config: EngineConfig({name}=...)")
    return config

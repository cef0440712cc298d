"""lm-evaluation-harness in process: ``--model logprobe``, no server.

Importing this module registers :class:`LogprobeLM` with lm-eval's model registry under the name
``logprobe`` (lm-eval's own plugin mechanism, ``@register_model``; lm-eval 0.4.13 reads no
package entry points, so the import is what makes the name known). ``logprobe eval`` imports it
before handing over to lm-eval's CLI; from Python::

    import lm_eval
    import logprobe.integrations.lm_eval  # noqa: F401  (registers "logprobe")

    lm_eval.simple_evaluate(model="logprobe", model_args="model=smollm2-135m,device=cpu",
                            tasks=["hellaswag"])

Model args: ``model`` (or ``pretrained``; a known name, a .gguf file or a Hugging Face directory),
``device``, ``dtype``, ``deterministic``, ``max_batch_tokens`` (the token budget of one forward
pass; lm-eval's ``batch_size`` is accepted and ignored: logprobe batches by tokens), ``max_length``,
``cache`` (a directory: logprobe's result cache, ``executor.cached``, keyed by weights and token
ids; lm-eval's own ``--use_cache``, keyed by request text, works beside it).

Token boundaries are lm-eval's, as its ``hf`` backend draws them with ``max_length = L``
(default ``min(2048, model context - 1)``):

* ``loglikelihood``: context and continuation are split as ``scoring.contract`` says (lm-eval's
  rule); when context + continuation exceed ``L + 1`` tokens the context is cut from the left to
  the last ``L + 1`` tokens, so ``L`` tokens are fed.
* ``loglikelihood_rolling``: the document after the prefix token (BOS, else EOS) in the
  "rolling" windows of ``scoring.windows`` with ``context_length = L + 1``: every token scored
  once, each window fed ``L`` tokens. Through the server, lm-eval's ``local-completions`` with
  ``max_length = L + 2`` draws the same windows (it keeps ``max_length - 1`` and rolls windows
  of one less again).

Worked example (default model): ``loglikelihood`` of ``("The capital of France is", " Paris")``
is ``(-0.2581, True)``, the same numbers as ``Scorer().loglikelihood`` and as the server.
"""

from __future__ import annotations

from collections.abc import Sequence

try:  # lm-eval is optional: without it the rest of logprobe (the CLI, the server) runs, ``eval`` says how to get it
    import lm_eval.models  # noqa: F401  (lm-eval's built-in models: its registry imports them only while empty,
    from lm_eval.api.model import LM  # so registering "logprobe" first would hide local-completions & co.)
    from lm_eval.api.registry import register_model

    MISSING: ImportError | None = None
except ImportError as e:
    LM, MISSING = object, e

    def register_model(*names):
        return lambda cls: cls

from ..errors import LogprobeError
from ..scorer import Scorer
from ..scoring.contract import split_continuation
from ..scoring.windows import rolling_windows

DEFAULT_MAX_LENGTH = 2048
MODEL_ARGS = ("model", "pretrained", "device", "dtype", "deterministic", "max_batch_tokens", "max_length", "cache")


def truncate_pair(ctx: list[int], cont: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Keep the last ``max_length + 1`` tokens of ``ctx + cont`` (lm-eval's hf backend), cutting
    the context only: ``truncate_pair([1, 2, 3, 4], [5, 6], 4)`` is ``([2, 3, 4], [5, 6])``."""
    if len(cont) > max_length:
        raise LogprobeError("continuation", f"has {len(cont)} tokens, more than max_length {max_length}",
                            "raise max_length in --model_args")
    keep = max_length + 1 - len(cont)
    return ctx[-keep:] if len(ctx) > keep else ctx, cont


def rolling_sequences(ids: Sequence[int], prefix_id: int, max_length: int) -> list[dict]:
    """One document's rolling windows as ``Scorer.logprobs`` sequences (prompt / completion ids).

    ``rolling_sequences([7, 8, 9, 10, 11], prefix_id=1, max_length=3)`` feeds 3 tokens per window::

        stream [1, 7, 8, 9, 10, 11]         windows of context_length 4 (scoring.windows "rolling")
        {"prompt_token_ids": [1], "completion_token_ids": [7, 8, 9]}
        {"prompt_token_ids": [8, 9], "completion_token_ids": [10, 11]}

    An empty document has no windows (its log-likelihood is 0)."""
    if not ids:
        return []
    stream = [prefix_id, *ids]
    return [{"prompt_token_ids": stream[w.begin:w.score_begin], "completion_token_ids": stream[w.score_begin:w.end]}
            for w in rolling_windows(len(stream), max_length + 1)]


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise LogprobeError(f"model_args {name}", f"must be true or false, got {value!r}")


def _count(value, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and n != value):
        raise LogprobeError(f"model_args {name}", f"must be a positive integer, got {value!r}")
    return n


@register_model("logprobe")
class LogprobeLM(LM):
    """An lm-eval ``LM`` over a :class:`logprobe.Scorer` (see the module docstring for the windows).

    >>> lm = LogprobeLM(model="smollm2-135m", device="cpu")     # or LogprobeLM(scorer=Scorer(...))
    >>> lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])  # doctest: +SKIP
    """

    def __init__(self, model: str | None = None, pretrained: str | None = None, device: str | None = "auto",
                 dtype: str | None = "auto", deterministic: bool | str = False,
                 max_batch_tokens: int | str | None = None,
                 max_length: int | str | None = None, batch_size=None, max_batch_size=None, scorer=None,
                 cache: str | None = None) -> None:
        super().__init__()
        del batch_size, max_batch_size  # lm-eval's; logprobe batches by tokens (max_batch_tokens)
        if model is not None and pretrained is not None and model != pretrained:
            raise LogprobeError("model_args", f"model={model!r} and pretrained={pretrained!r} disagree",
                                "give one of them")
        if scorer is None:
            scorer = Scorer(model or pretrained, device=device or "auto", dtype=dtype or "auto",
                            max_batch_tokens=None if max_batch_tokens is None
                            else _count(max_batch_tokens, "max_batch_tokens"),
                            deterministic=_flag(deterministic, "deterministic"), cache=cache or None)
        self.scorer = scorer
        self._device = str(scorer.device)
        limit = scorer.info.max_length - 1  # L + 1 tokens per window must fit the model's context
        self.max_length = min(DEFAULT_MAX_LENGTH, limit) if max_length is None else _count(max_length, "max_length")
        if self.max_length > limit:
            raise LogprobeError("model_args max_length", f"{self.max_length} leaves no room in the model's context of "
                                f"{scorer.info.max_length} (windows hold max_length + 1 tokens)",
                                f"use max_length <= {limit}")

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LogprobeLM:
        """lm-eval's constructor hook; ``model_args`` win over lm-eval's own ``--device`` / ``--batch_size``
        (its ``--device`` defaults to ``cuda:0``, which must not override ``device=cpu``)."""
        unknown = sorted(set(arg_dict) - set(MODEL_ARGS) - {"batch_size", "max_batch_size"})
        if unknown:
            raise LogprobeError("model_args", f"unknown {', '.join(map(repr, unknown))}",
                                f"logprobe takes {', '.join(MODEL_ARGS)}")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LogprobeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- the three request types ------------------------------------------------------------------

    def pair_sequence(self, context: str, continuation: str) -> dict:
        """One ``(context, continuation)`` as a ``Scorer.logprobs`` sequence, split and truncated as lm-eval's
        ``TemplateLM`` does (an empty context is the prefix token, or the continuation's own first
        token when that already is the prefix token)."""
        tok = self.scorer.tokenizer
        ctx, cont = split_continuation(context, continuation, tok.encode, tok.prefix_id, tok.add_bos, tok.bos_id)
        if context == "" and len(cont) > 1 and cont[0] == tok.prefix_id:
            ctx, cont = cont[:1], cont[1:]
        ctx, cont = truncate_pair(ctx, cont, self.max_length)
        return {"prompt_token_ids": ctx, "completion_token_ids": cont}

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request, one engine run for all of them."""
        seqs = [self.pair_sequence(*req.args) for req in requests]
        if not seqs:
            return []
        out = [(r.sum_logprob, bool((r.ranks == 0).all())) for r in self.scorer.logprobs(seqs)]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole-document log-likelihood per request (rolling windows, every token once)."""
        tok = self.scorer.tokenizer
        docs = [rolling_sequences(tok.encode(req.args[0]), tok.prefix_id, self.max_length) for req in requests]
        flat = [s for doc in docs for s in doc]
        results = iter(self.scorer.logprobs(flat) if flat else [])
        out = [sum((next(results).sum_logprob for _ in doc), 0.0) for doc in docs]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        tasks = sorted({str(r.task_name) for r in requests if getattr(r, "task_name", None)})
        raise LogprobeError("tasks", "logprobe scores given text and does not generate: "
                            f"{', '.join(tasks) or 'this task'} needs generate_until",
                            "evaluate log-likelihood, multiple-choice or perplexity tasks")

"""verl's reference policy computed by logprobe: its batch layouts in, ``ref_log_prob`` out.

verl is imported inside the functions that build its objects (``import logprobe`` never imports it)::

    from logprobe.integrations.verl import LogprobeRefPolicy

    ref = LogprobeRefPolicy("path/to/reference", temperature=1.0, device="cuda", dtype="bfloat16")
    batch = batch.union(ref.compute_ref_log_prob(batch))    # DataProto in, DataProto{"ref_log_prob"} out

**Padded batch** (``DataProto.batch``, as the rollout leaves it): ``prompts`` [bs, P] left-padded,
``responses`` [bs, R] right-padded, ``input_ids`` = their concatenation [bs, P + R],
``attention_mask`` [bs, P + R], ``response_mask`` [bs, R] (multi-turn: 0 on tool tokens). verl's
actor feeds ``input_ids`` with ``position_ids = cumsum(attention_mask) - 1``, divides the logits by
``meta_info["temperature"]`` and keeps ``logprobs_from_logits(logits[:, P-1:-1], responses)``:
column j of ``ref_log_prob`` [bs, R] is log p(responses[:, j] | the real tokens before it)::

    col          0   1   2 | 3   4   5        prompts | responses      ref_log_prob[b]
    row 0        .   p0  p1| r0  r1  .        attention 0 1 1 1 1 0    [lp(r0|p0 p1), lp(r1|p0 p1 r0), 0]
    row 1        p0  p1  p2| r0  t0  r1       (t0: a tool token)       [lp(r0|p0..p2), lp(t0|..r0), lp(r1|..t0)]

Every real response token is scored, tool tokens included, as verl scores them (its losses apply
``response_mask`` afterwards); after the response (attention 0) the value is 0, as verl 0.9's
``no_padding_2_padding`` leaves it (verl's older padded actor left the logits of padding there,
which every consumer masks). That is ``Scorer.logprobs_padded(input_ids, attention_mask,
attention_mask[:, -R:], temperature=T)``.

**No-padding batch** (verl 0.9's ``RayPPOTrainer._compute_ref_log_prob``: the DataProto as a
TensorDict through ``left_right_2_no_padding``, meta_info as non-tensor data): ``input_ids`` is a
jagged nested tensor of each row's real tokens; the answer ``log_probs`` is nested alike and
shifted left by one, as verl's model engine returns it: entry t of sequence i is log p(token t + 1 |
tokens <= t); the trainer's ``no_padding_2_padding`` reads entries P_i - 1 .. n_i - 2 (the
response). Here entries before P_i - 1 and the last are 0::

    sequence i      p0    p1    r0            r1            r2      (P_i = 2)
    log_probs[i]    0     lp(r0|p0 p1)  lp(r1|..r0)  lp(r2|..r1)  0

**Temperature**: ``meta_info["temperature"]`` (the rollout's, which verl's trainer sets), else the
worker's own ``temperature``; a per-row temperature tensor must hold one value.

**As verl's Ray worker** for ``Role.RefPolicy`` (each worker holds a whole Scorer and scores its
share of the batch: one data-parallel rank per worker)::

    from logprobe.integrations.verl import LogprobeRefWorker
    role_worker_mapping[Role.RefPolicy] = ray.remote(LogprobeRefWorker)
    # model: actor_rollout_ref.model.path, or actor_rollout_ref.logprobe.model_path; other keys of
    # actor_rollout_ref.logprobe (device, dtype, ...) go to the Scorer; temperature: the rollout's
"""

from __future__ import annotations

import functools

import torch

from ..errors import LogprobeError
from ..scorer import Scorer


def padded_layout(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [bs, L], attention_mask [bs, L], scored [bs, R])`` of a padded verl batch
    (``DataProto.batch`` or a dict-like with the same keys); ``scored = attention_mask[:, -R:]``."""
    for key in ("input_ids", "attention_mask", "responses"):
        if key not in batch.keys():
            raise LogprobeError(f"data.batch[{key!r}]", "is missing", "pass the rollout's DataProto")
    input_ids, attention_mask, responses = batch["input_ids"], batch["attention_mask"], batch["responses"]
    R = responses.shape[1]
    if input_ids.shape[1] < R or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise LogprobeError("data.batch", f"input_ids {tuple(input_ids.shape)}, attention_mask "
                            f"{tuple(attention_mask.shape)} and responses {tuple(responses.shape)} disagree",
                            "input_ids must be prompts and responses concatenated")
    if not torch.equal(input_ids[:, -R:], responses):
        raise LogprobeError("data.batch['responses']", "differs from the last columns of input_ids")
    return input_ids, attention_mask, attention_mask[:, -R:]


def temperature_of(meta: dict, default: float | None) -> float:
    """``meta["temperature"]`` (a number, or a per-row tensor holding one value), else ``default``."""
    t = meta.get("temperature", default)
    if t is None:
        raise LogprobeError("meta_info['temperature']", "is missing and the worker has no temperature",
                            "pass LogprobeRefPolicy(..., temperature=rollout temperature)")
    if isinstance(t, torch.Tensor):
        if t.numel() == 0 or not bool((t == t.reshape(-1)[0]).all()):
            raise LogprobeError("temperature", "differs between rows", "score each temperature's rows apart")
        t = t.reshape(-1)[0].item()
    return float(t)


def ref_log_prob_padded(scorer: Scorer, batch, temperature: float) -> torch.Tensor:
    """float32 [bs, R] log-probs of every real response token of a padded batch, 0 after it."""
    input_ids, attention_mask, scored = padded_layout(batch)
    return scorer.logprobs_padded(input_ids, attention_mask, scored, temperature=temperature).logprobs


def ref_log_prob_nopadding(scorer: Scorer, td, temperature: float) -> torch.Tensor:
    """The nested, left-shifted ``log_probs`` of a no-padding batch (see the module docstring)."""
    ids = td["input_ids"]
    if not ids.is_nested:
        raise LogprobeError("input_ids", "is not a nested tensor", "pass the batch after left_right_2_no_padding")
    offsets = ids.offsets()  # [bs + 1]
    prompts = td["prompts"]
    if prompts.is_nested:
        prompt_lens = prompts.offsets().diff()
    else:
        prompt_lens = td["attention_mask"][:, :prompts.shape[1]].sum(1)  # [bs]
    lp = scorer.logprobs_packed(ids.values(), offsets, prompt_lens.to(offsets.device),
                                temperature=temperature).logprobs  # [T], 0 on each prompt
    # entry t predicts token t + 1: shift left; each sequence's last entry takes the next one's
    # first (0: a first token is never scored), the very last the first sequence's first (0)
    return torch.nested.nested_tensor_from_jagged(torch.roll(lp, -1), offsets=offsets)


class LogprobeRefPolicy:
    """A reference-policy worker: ``compute_ref_log_prob`` answers verl's padded ``DataProto``
    with ``DataProto{"ref_log_prob": [bs, R]}`` and verl 0.9's no-padding TensorDict with
    ``TensorDict{"log_probs": nested}``, in this process (``LogprobeRefWorker`` is the Ray worker)."""

    def __init__(self, model_path: str, temperature: float | None = None, **scorer_kwargs) -> None:
        self.model_path, self.temperature, self.scorer_kwargs = model_path, temperature, scorer_kwargs
        self.scorer: Scorer | None = None

    def init_model(self) -> None:
        """Load the reference model (verl calls this once, before the first batch)."""
        if self.scorer is None:
            self.scorer = Scorer(self.model_path, **self.scorer_kwargs)

    def compute_ref_log_prob(self, data):
        self.init_model()
        from tensordict import TensorDict

        if isinstance(data, TensorDict):
            from verl.utils import tensordict_utils as tu

            t = temperature_of({"temperature": tu.get_non_tensor_data(data, "temperature", self.temperature)},
                               None)
            return tu.get_tensordict({"log_probs": ref_log_prob_nopadding(self.scorer, data, t).cpu()})
        from verl import DataProto

        t = temperature_of(data.meta_info, self.temperature)
        return DataProto.from_dict(tensors={"ref_log_prob": ref_log_prob_padded(self.scorer, data.batch, t).cpu()})


def config_get(config, *keys, default=None):
    """``config[k0][k1]...`` of a dict or an OmegaConf config, ``default`` where a key is absent."""
    for k in keys:
        if config is None or not hasattr(config, "get"):
            return default
        config = config.get(k)
    return default if config is None else config


@functools.cache
def make_ref_worker_class():
    """``LogprobeRefWorker``: a ``verl.single_controller.base.Worker`` whose ``init_model`` (one call
    to all workers) loads a ``LogprobeRefPolicy`` from verl's ``actor_rollout_ref`` config and
    registers the worker as its own data-parallel rank of mesh "ref", and whose
    ``compute_ref_log_prob`` takes that rank's share of the batch, as verl's engine workers do."""
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import (
        Dispatch,
        make_nd_compute_dataproto_dispatch_fn,
        register,
    )

    class LogprobeRefWorker(Worker):
        def __init__(self, config=None, role: str | None = None) -> None:
            super().__init__()
            self.config, self.role, self.policy = config, role, None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self) -> None:
            options = dict(config_get(self.config, "logprobe", default={}))
            path = options.pop("model_path", None) or config_get(self.config, "model", "path")
            if path is None:
                raise LogprobeError("actor_rollout_ref.model.path", "is missing", "the reference model's path")
            temperature = config_get(self.config, "rollout", "temperature")
            self.policy = LogprobeRefPolicy(path, temperature=temperature, **options)
            self.policy.init_model()
            self._register_dispatch_collect_info("ref", dp_rank=self.rank, is_collect=True)

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
        def compute_ref_log_prob(self, data):
            return self.policy.compute_ref_log_prob(data)

    LogprobeRefWorker.__module__ = __name__
    LogprobeRefWorker.__qualname__ = "LogprobeRefWorker"
    return LogprobeRefWorker


def __getattr__(name: str):
    # ``LogprobeRefWorker`` is built on first use, so that the functions above need no verl import
    if name == "LogprobeRefWorker":
        return make_ref_worker_class()
    raise AttributeError(name)

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

**Images** (a model with a vision tower, Qwen3.5): a row's ``non_tensor_batch["multi_modal_inputs"]``
(its processor's ``pixel_values`` and ``image_grid_thw``, taken as they are) or
``["multi_modal_data"]`` (``{"image": [PIL images]}``, run through the checkpoint's processor)
is scored with its ids, whose image tokens verl has already expanded; such a batch runs as one
library request per row (``rows_with_media``), the same numbers as ``Scorer.logprobs`` with those
images. A row's video or audio is refused by name (the text would be scored without it).

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

from ..engine.request import ScoreRequest
from ..errors import LogprobeError
from ..scorer import Scorer
from ..scoring.inputs import check_length, check_options
from ..scoring.work import Job


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


def ref_log_prob_padded(scorer: Scorer, batch, temperature: float, media=None) -> torch.Tensor:
    """float32 [bs, R] log-probs of every real response token of a padded batch, 0 after it.
    ``media``: the rows' ``multi_modal_inputs`` (or ``multi_modal_data``), see ``media_rows``."""
    input_ids, attention_mask, scored = padded_layout(batch)
    rows = media_rows(media, len(input_ids))
    if rows is None:
        return scorer.logprobs_padded(input_ids, attention_mask, scored, temperature=temperature).logprobs
    R = scored.shape[1]
    seqs = []
    for b in range(len(input_ids)):
        real = attention_mask[b].bool()
        n = int(real[-R:].sum())
        if not bool(real[-R:][:n].all()):
            raise LogprobeError(f"data.batch['attention_mask'][{b}]", "has padding inside the response",
                                "right-pad the responses")
        seqs.append((input_ids[b, :-R][real[:-R]].tolist(), input_ids[b, -R:][:n].tolist()))
    out = torch.zeros(len(input_ids), R, dtype=torch.float32)
    for b, lp in enumerate(rows_with_media(scorer, seqs, rows, temperature)):
        out[b, :len(lp)] = lp
    return out


def ref_log_prob_nopadding(scorer: Scorer, td, temperature: float, media=None) -> torch.Tensor:
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
    rows = media_rows(media, len(offsets) - 1)
    if rows is not None:
        flat, ends, starts = ids.values().tolist(), offsets.tolist(), prompt_lens.tolist()
        seqs = [(flat[a:a + p], flat[a + p:e]) for a, e, p in zip(ends, ends[1:], starts)]
        lp = torch.zeros(len(flat), dtype=torch.float32)
        for (a, p), row in zip(zip(ends, starts), rows_with_media(scorer, seqs, rows, temperature)):
            lp[a + p:a + p + len(row)] = row  # aligned with the tokens, as logprobs_packed returns them
    else:
        lp = scorer.logprobs_packed(ids.values(), offsets, prompt_lens.to(offsets.device),
                                    temperature=temperature).logprobs  # [T], 0 on each prompt
    # entry t predicts token t + 1: shift left; each sequence's last entry takes the next one's
    # first (0: a first token is never scored), the very last the first sequence's first (0)
    return torch.nested.nested_tensor_from_jagged(torch.roll(lp, -1), offsets=offsets)


MEDIA_KEYS = ("multi_modal_inputs", "multi_modal_data")  # verl's per-row media, the first one found read


def media_rows(media, n: int) -> list[dict | None] | None:
    """verl's per-row media (an object array, a list, or tensordict's stack of them) -> each row's
    dict or None (no images); None when no row has images. A row's ``multi_modal_inputs`` is its
    processor's output (``pixel_values``, ``image_grid_thw``, the ids already expanded); its
    ``multi_modal_data`` is ``{"image": [PIL images]}`` (``"images"`` in the agent loop). Videos
    and audio are refused by name (never scored without them)."""
    if media is None:
        return None
    rows = media.tolist() if hasattr(media, "tolist") else list(media)
    if len(rows) != n:
        raise LogprobeError("data.non_tensor_batch['multi_modal_inputs']", f"has {len(rows)} rows for {n}")
    out: list[dict | None] = []
    for b, row in enumerate(rows):
        if not isinstance(row, dict) or not row:
            out.append(None)
            continue
        other = sorted(k for k in row if k.startswith(("video", "audio", "second_per_grid")) and _given(row[k]))
        if other:
            raise LogprobeError(f"data.non_tensor_batch[{b}]['{other[0]}']", "carries video or audio: logprobe "
                                "takes images only (the text would be scored without them)", "send images only")
        out.append(row if any(_given(row.get(k)) for k in ("pixel_values", "image", "images")) else None)
    return out if any(r is not None for r in out) else None


def _given(value) -> bool:
    """A media value that holds something (None, [] and empty tensors hold nothing)."""
    return value is not None and (not hasattr(value, "__len__") or len(value) > 0)


def rows_with_media(scorer: Scorer, seqs: list[tuple[list[int], list[int]]], rows: list[dict | None],
                    temperature: float) -> list[torch.Tensor]:
    """Each row's response log-probs (float32 [n]) given its images: the library's requests, their
    ids as verl has them (the image tokens expanded)."""
    temperature, _ = check_options(temperature, 0)
    context, requests, owner = scorer.context, [], []
    for b, ((prompt, response), row) in enumerate(zip(seqs, rows)):
        if not response:
            continue
        field = f"data[{b}]"
        context.check_ids(prompt + response, field)
        check_length(len(prompt) + len(response), field, context.max_length)
        images = None if row is None else row_image_inputs(context, prompt + response, row, field)
        requests.append(ScoreRequest(prompt + response, len(prompt), temperature, images=images))
        owner.append(b)
    results = scorer.run(Job(requests, lambda results: results)) if requests else []
    out = [torch.zeros(0, dtype=torch.float32) for _ in seqs]
    for b, res in zip(owner, results):
        out[b] = res.logprobs.float()
    return out


def row_image_inputs(context, ids: list[int], row: dict, field: str):
    """A row's ``ImageInputs``: verl's processed pixels and grids as they are, or its images run
    through the checkpoint's processor (their tokens already expanded in ``ids``)."""
    reader = context.check_images(f"{field}.images")
    if row.get("pixel_values") is not None:
        grids = [tuple(int(v) for v in g) for g in torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3).tolist()]
        return reader.inputs(ids, torch.as_tensor(row["pixel_values"]).float(), grids, field)
    images = row.get("image") if _given(row.get("image")) else row.get("images")
    pixels, grids = reader.patches(list(images), f"{field}.images")
    return reader.inputs(ids, pixels, grids, field)


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
            media = next((tu.get(data, k) for k in MEDIA_KEYS if k in data.keys()), None)
            return tu.get_tensordict({"log_probs": ref_log_prob_nopadding(self.scorer, data, t, media).cpu()})
        from verl import DataProto

        t = temperature_of(data.meta_info, self.temperature)
        media = next((data.non_tensor_batch[k] for k in MEDIA_KEYS if k in data.non_tensor_batch), None)
        return DataProto.from_dict(tensors={"ref_log_prob": ref_log_prob_padded(self.scorer, data.batch, t,
                                                                                 media).cpu()})


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

"""Checks of the arguments every scoring method shares, raised as ``LogprobeError`` naming the field.

They run while a job is built, before any batch: a bad value fails its own call only, never
the other requests it would have shared a batch with.
"""

from __future__ import annotations

import math

import torch

from ..errors import LogprobeError
from ..interp.specs import CaptureSpec, SteerSpec, parse_capture, parse_steer

MIN_TEMPERATURE = 1e-30  # below it, logits / temperature can overflow float32 (NaN log-probs)
# SGLang's, vLLM's and verl's multimodal fields: a request carrying one is refused, never scored
# without its media
MEDIA_FIELDS = frozenset({"image_data", "video_data", "audio_data", "multi_modal_data", "mm_data", "images",
                          "videos", "audios", "multi_modal_inputs"})
MEDIA_PROBLEM = ("carries images, audio or video: logprobe scores text given text and does not take them yet "
                 "(the text would be scored without them)")


def check_no_media(item: dict, field: str) -> None:
    """Refuse ``item`` (a request's dict, or a table row: ``field`` "") when it has a media field.

        >>> check_no_media({"prompt_token_ids": [1], "multi_modal_data": {}}, "sequences[0]")
        Traceback (most recent call last):
        ...
        logprobe.errors.LogprobeError: sequences[0].multi_modal_data: carries images, audio or video: logprobe scores text given text and does not take them yet (the text would be scored without them); send the text alone
    """
    media = sorted(MEDIA_FIELDS & item.keys())
    if media:
        raise LogprobeError(f"{field}.{media[0]}" if field else media[0], MEDIA_PROBLEM, "send the text alone")


def check_options(temperature: float, top_k: int) -> tuple[float, int]:
    """``(float(temperature), top_k)`` once both are valid (the CLI calls it before loading a model).

    >>> check_options(1, 5)
    (1.0, 5)
    >>> check_options(0.0, 0)
    Traceback (most recent call last):
    logprobe.errors.LogprobeError: temperature: must be a finite number > 0, got 0.0
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise LogprobeError("temperature", f"must be a finite number > 0, got {temperature!r}")
    if temperature < MIN_TEMPERATURE:  # refused here, before a batch: the head would fail every request in it
        raise LogprobeError("temperature", f"{temperature!r} is below {MIN_TEMPERATURE:g}: logits / temperature "
                            "would overflow float32", f"use a temperature >= {MIN_TEMPERATURE:g}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise LogprobeError("top_k", f"must be an integer >= 0, got {top_k!r}")
    return float(temperature), top_k


def check_ids(ids, name: str, vocab_size: int) -> list[int]:
    """A list (or 1-D tensor) of token ids in ``[0, vocab_size)`` as a list of ints.

    >>> check_ids(torch.tensor([3, 1]), "ids", 4)
    [3, 1]
    >>> check_ids([3, 4], "ids", 4)
    Traceback (most recent call last):
    logprobe.errors.LogprobeError: ids[1]: token id 4 is outside the vocabulary [0, 4)
    """
    if not isinstance(ids, (list, tuple)) and not (isinstance(ids, torch.Tensor) and ids.ndim == 1):
        raise LogprobeError(name, "must be a list of token ids")
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    # the usual case in C (type() of each, min, max); the loop below only to name what is wrong
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return ids
    for j, x in enumerate(ids):
        if not isinstance(x, int) or isinstance(x, bool):
            raise LogprobeError(f"{name}[{j}]", f"must be an integer token id, got {x!r}")
        if not 0 <= x < vocab_size:
            raise LogprobeError(f"{name}[{j}]", f"token id {x} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_length(n: int, name: str, max_length: int) -> None:
    """Refuse ``n`` tokens beyond the model's context (``ModelInfo.max_length``)."""
    if n > max_length:
        raise LogprobeError(name, f"{n} tokens exceed the model's context of {max_length}", "shorten the input")


def check_hooks(capture, steer, has_hooks: bool, layers: int, width: int,
                backend: str) -> tuple[list[CaptureSpec], list[SteerSpec]]:
    """``capture`` / ``steer`` parsed against a model of ``layers`` blocks of ``width``; ``([], [])``
    for neither, on any model, so the plain forward never needs hook points.

    >>> check_hooks(None, [], False, 0, 0, "transformers")
    ([], [])
    """
    if not capture and not steer:
        return [], []
    if not has_hooks:
        raise LogprobeError("steer" if steer else "capture", f"the {backend} backend has no hook points",
                            "use a native model (GGUF or a Llama-family directory)")
    return parse_capture(capture, layers, width), parse_steer(steer, layers, width)

"""Requests with images on the engine's path (``request.ImageInputs``): the vision tower's
embeddings, once per request; which rows of a pass they replace; the positions of a request's rows.

A request's rows k .. k + n - 1 (a whole request, a branch or a chunk) placed from batch row
``start``: their positions are columns k .. k + n - 1 of its [3, L] rows, and each image token j
in that range puts ``embeds[i]`` (i: its order among the image tokens) at batch row start + j - k.

    >>> img = ImageInputs(torch.zeros(0, 1), (), np.array([2, 3]), np.arange(15).reshape(3, 5), ())
    >>> img.embeds = torch.tensor([[1.0], [2.0]])
    >>> rows, embeds = image_rows(img, 3, 2, start=10)
    >>> rows.tolist(), embeds.tolist(), row_positions(img, 3, 2).tolist()
    ([10], [[2.0]], [[3, 4], [8, 9], [13, 14]])
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import LogprobeError
from .request import ImageInputs, ScoreRequest


def check_images(model, requests: list[ScoreRequest]) -> None:
    """Refuse requests with images on a model without a vision tower (or whose tower is not on
    this rank: tensor parallelism)."""
    i = next((i for i, r in enumerate(requests) if r.images is not None), None)
    if i is None or getattr(model, "visual", None) is not None:
        return
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vision", None) is not None:
        raise LogprobeError("tensor_parallel_size", "images: the vision tower runs on one rank only",
                            "score images with tensor_parallel_size 1")
    raise LogprobeError(f"requests[{i}].images", f"{type(model).__name__} has no vision tower",
                        "score images with a Qwen3.5 checkpoint that has its vision_config")


def embed_images(model, requests: list[ScoreRequest], indices) -> None:
    """The tower's embeddings of each request in ``indices`` that has images and none yet, kept on
    the request: each image alone (its numbers depend on nothing else in the batch), once per
    distinct image (by digest) among them: an RL group's requests share one run of its image."""
    done: dict[str, torch.Tensor] = {}
    for i in indices:
        img = requests[i].images
        if img is None or img.embeds is not None:
            continue
        parts, a = [], 0
        for key, (t, h, w) in zip(img.keys, img.grids):
            n = t * h * w
            if key not in done:
                done[key] = model.encode_image(img.pixel_values[a:a + n], (t, h, w))
            parts.append(done[key])
            a += n
        img.embeds = torch.cat(parts)


def planned_ids(r: ScoreRequest) -> list[int]:
    """The ids the planner shares prefixes by: a request's inputs with each image's tokens standing
    for its content (a negative number from the image's digest), so two requests share rows only
    up to the first image that differs, however equal their ids. Image tokens 9 of two images:

        >>> img = ImageInputs(torch.zeros(0, 1), ((1, 2, 2), (1, 2, 2)), np.array([1, 3]),
        ...                   np.zeros((3, 5), dtype=np.int64), ("0" * 64, "f" * 64))
        >>> planned_ids(ScoreRequest([5, 9, 6, 9, 7], 4, images=img))
        [5, -1, 6, -1152921504606846976]
    """
    ids = r.inputs
    if r.images is None:
        return ids
    img, out = r.images, list(ids)
    patches = [t * h * w for t, h, w in img.grids]
    merged = sum(patches) // max(len(img.token_index), 1)  # m²: patches per image token
    per = [p // merged for p in patches]  # each image's tokens, in order
    k = 0
    for image, n in enumerate(per):
        mark = -1 - int(img.keys[image][:15], 16)  # below every token id
        for j in img.token_index[k:k + n]:
            if j < len(out):
                out[j] = mark
        k += n
    return out


def row_positions(img: ImageInputs, first: int, n: int) -> np.ndarray:
    """Positions [3, n] of the request's rows first .. first + n - 1."""
    return img.positions[:, first:first + n]


def image_rows(img: ImageInputs, first: int, n: int, start: int) -> tuple[np.ndarray, torch.Tensor]:
    """(batch rows, their embeddings [m, H]) of the image tokens among rows first .. first + n - 1
    placed from batch row ``start``."""
    idx = img.token_index
    sel = np.nonzero((idx >= first) & (idx < first + n))[0]
    return (start + idx[sel] - first).astype(np.int64), img.embeds[torch.from_numpy(sel).to(img.embeds.device)]

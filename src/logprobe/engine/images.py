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

A model whose image tokens attend to each other both ways (Gemma 3: ``ImageFormat.bidirectional``)
gives each run of image tokens a *span*: its rows see the keys up to the run's end
(``bidirectional_spans``; ``layers.attention.Segment.spans``). A row inside a span depends on the
image tokens after it, so no prefix may end inside a span: shared prefixes and the prefix cache
key a span's tokens by the digest of all its images (``planned_ids``: two requests agree on a
span whole or not from its first token), and a chunk never ends inside one (``chunk_end``).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import LogprobeError
from .request import ImageInputs, ScoreRequest


def check_images(model, requests: list[ScoreRequest]) -> None:
    """Refuse requests with images on a model without a vision tower (or whose tower is not on
    this rank)."""
    i = next((i for i, r in enumerate(requests) if r.images is not None), None)
    if i is None:
        return
    fmt = getattr(model, "image_format", None)
    if fmt is None:
        raise LogprobeError(f"requests[{i}].images", f"{type(model).__name__} has no vision tower",
                            "score images with a checkpoint that has its vision_config (Qwen3.5, Gemma 3)")
    if not model.tower_here:
        raise LogprobeError("tensor_parallel_size", "images: the vision tower runs on one rank only",
                            "score images with tensor_parallel_size 1")


class ImageMemo:
    """The vision tower's embeddings by image digest for one run: each distinct image runs once,
    whatever batches, chunks or branches its requests land in (an RL group's requests share
    their images); an entry is dropped once every request of the run that holds the image has
    its embeddings, so the memo holds only images still to be used. Three requests of one image
    a, the second also with b, embedded one per batch: a runs once, b once, and a is dropped
    after the third:

    >>> img = lambda *keys: ImageInputs(torch.zeros(len(keys), 1), ((1, 1, 1),) * len(keys), np.array([0]), None, keys)
    >>> reqs = [ScoreRequest([7, 8], 1, images=img("a")), ScoreRequest([7, 8], 1, images=img("a", "b")),
    ...         ScoreRequest([7, 8], 1, images=img("a"))]
    >>> class Tower:
    ...     runs = 0
    ...     def encode_image(self, patches, grid):
    ...         Tower.runs += 1
    ...         return patches
    >>> memo = ImageMemo(reqs)
    >>> for i in range(3):
    ...     memo.embed(Tower(), reqs, [i])
    >>> Tower.runs, memo.done, reqs[1].images.embeds.shape
    (2, {}, torch.Size([2, 1]))
    """

    def __init__(self, requests: list[ScoreRequest]) -> None:
        self.left: dict[str, int] = {}  # requests without embeddings yet that hold each image
        for r in requests:
            if r.images is not None and r.images.embeds is None:
                for key in set(r.images.keys):
                    self.left[key] = self.left.get(key, 0) + 1
        self.done: dict[str, torch.Tensor] = {}

    def embed(self, model, requests: list[ScoreRequest], indices) -> None:
        """The embeddings of each request in ``indices`` that has images and none yet, kept on the
        request: each image alone (its numbers depend on nothing else in the batch)."""
        for i in indices:
            img = requests[i].images
            if img is None or img.embeds is not None:
                continue
            parts, a = [], 0
            for key, (t, h, w) in zip(img.keys, img.grids):
                n = t * h * w
                if key not in self.done:
                    self.done[key] = model.encode_image(img.pixel_values[a:a + n], (t, h, w))
                parts.append(self.done[key])
                a += n
            img.embeds = parts[0] if len(parts) == 1 else torch.cat(parts)
            for key in set(img.keys):
                self.left[key] = self.left.get(key, 1) - 1
                if self.left[key] <= 0:
                    self.done.pop(key, None)
                    self.left.pop(key)


def planned_ids(r: ScoreRequest) -> list[int]:
    """The ids the planner shares prefixes by: a request's inputs with each image's tokens standing
    for its content (a negative number from the image's digest), so two requests share rows only
    up to the first image that differs, however equal their ids. Image tokens 9 of two images:

        >>> img = ImageInputs(torch.zeros(0, 1), ((1, 2, 2), (1, 2, 2)), np.array([1, 3]),
        ...                   np.zeros((3, 5), dtype=np.int64), ("0" * 64, "f" * 64))
        >>> planned_ids(ScoreRequest([5, 9, 6, 9, 7], 4, images=img))
        [5, -1, 6, -1152921504606846976]

    With bidirectional spans each span's tokens stand for the digest of all its images (a prefix
    never ends inside one): two images in one run of image tokens, all four marked alike:

        >>> img = ImageInputs(torch.zeros(0, 1), ((1, 2, 2), (1, 2, 2)), np.array([1, 2, 3, 4]), None,
        ...                   ("0" * 64, "f" * 64), spans=((1, 5),))
        >>> ids = planned_ids(ScoreRequest([5, 9, 9, 9, 9, 7, 8], 5, images=img))
        >>> ids[0], len(set(ids[1:5])), ids[1] < 0, ids[5]
        (5, 1, True, 7)
    """
    ids = r.inputs
    if r.images is None:
        return ids
    img, out = r.images, np.asarray(ids, dtype=np.int64)
    index = img.token_index
    inside = index < len(out)
    out[index[inside]] = _image_marks(img)[inside]
    return out.tolist()


def _image_marks(img: ImageInputs) -> np.ndarray:
    """Each image token's mark (below every token id): its image's digest, or with spans the
    digest of the images of its span."""
    patches = [t * h * w for t, h, w in img.grids]
    merged = sum(patches) // max(len(img.token_index), 1)  # m²: patches per image token
    counts = [p // merged for p in patches]  # each image's tokens
    marks = np.repeat(np.array([_mark(k) for k in img.keys], dtype=np.int64), counts)
    if img.spans:
        index, owner = img.token_index, np.repeat(np.arange(len(patches)), counts)  # each token's image
        for a, e in img.spans:
            inside = (index >= a) & (index < e)
            images = np.unique(owner[inside]).tolist()  # in order: the tokens' images do not go back
            joined = ",".join(dict.fromkeys(img.keys[k] for k in images))  # each distinct digest once
            marks[inside] = _mark(hashlib.sha256(joined.encode()).hexdigest())
    return marks


def _mark(digest: str) -> int:
    return -1 - int(digest[:15], 16)


def bidirectional_spans(token_index: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive image tokens, [a, e) in token indices (transformers' Gemma 3 groups
    image tokens into blocks the same way: ``get_block_sequence_ids_for_mask``; two images with no
    token between them are one run).

    >>> bidirectional_spans(np.array([2, 3, 4, 7, 8, 10]))
    ((2, 5), (7, 9), (10, 11))
    """
    idx = np.asarray(token_index, dtype=np.int64)
    if not len(idx):
        return ()
    breaks = np.nonzero(np.diff(idx) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(idx)]])
    return tuple((int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, ends))


def segment_spans(img: ImageInputs | None, first: int, n: int) -> tuple[tuple[int, int], ...]:
    """The spans of a request's rows first .. first + n - 1 (a segment; spans in token indices,
    which are its key indices): each span that ends inside them, from ``first`` on (rows before
    ``first`` are context, computed with the whole span). A span that runs past them cannot be
    computed here: the engine never cuts there (``chunk_end``, ``planned_ids``).

    >>> img = ImageInputs(torch.zeros(0, 1), (), np.array([]), None, (), spans=((2, 5), (7, 9)))
    >>> segment_spans(img, 0, 6), segment_spans(img, 3, 7), segment_spans(img, 5, 2)
    (((2, 5),), ((3, 5), (7, 9)), ())
    """
    if img is None or not img.spans:
        return ()
    out = []
    for a, e in img.spans:
        if e <= first or a >= first + n:
            continue
        if e > first + n:
            raise LogprobeError("images", f"rows {first}..{first + n - 1} end inside the image tokens {a}..{e - 1}, "
                                "whose rows attend to each other", "report this: a pass was cut inside an image")
        out.append((max(a, first), e))
    return tuple(out)


def chunk_end(img: ImageInputs | None, b: int, e: int) -> int:
    """The end of a chunk from row ``b`` planned to end at ``e``, moved out of a bidirectional span
    it falls inside: back to the span's start when that is past ``b``, else on to the span's end.

    >>> img = ImageInputs(torch.zeros(0, 1), (), np.array([]), None, (), spans=((10, 20),))
    >>> chunk_end(img, 0, 15), chunk_end(img, 10, 15), chunk_end(img, 0, 20), chunk_end(None, 0, 15)
    (10, 20, 20, 15)
    """
    for a, z in (img.spans if img is not None else ()):
        if a < e < z:
            return a if a > b else z
    return e


def row_positions(img: ImageInputs | None, first: int, n: int) -> np.ndarray:
    """Positions of the request's rows first .. first + n - 1: [3, n] multimodal rows, or [n]."""
    if img is None or img.positions is None:
        return np.arange(first, first + n, dtype=np.int64)
    return img.positions[:, first:first + n]


def image_rows(img: ImageInputs, first: int, n: int, start: int) -> tuple[np.ndarray, torch.Tensor]:
    """(batch rows, their embeddings [m, H]) of the image tokens among rows first .. first + n - 1
    placed from batch row ``start``."""
    idx = img.token_index
    sel = np.nonzero((idx >= first) & (idx < first + n))[0]
    return (start + idx[sel] - first).astype(np.int64), img.embeds[torch.from_numpy(sel).to(img.embeds.device)]

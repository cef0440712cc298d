"""``ImageFormat``: how a family's prompts hold images, stated once by the model (``image_format``,
from its config) and read by the scoring side (``scoring.images``: placeholders expanded, the
processor's output cut into patches) and the engine (``engine.images``: positions, bidirectional
spans). A model with a vision tower also has ``encode_image(patches, grid)`` and ``tower_here``.

Qwen3.5: the prompt writes the image token once per image (its chat template puts
``<|vision_start|>`` / ``<|vision_end|>`` around it); it becomes ``t * h * w / merge²`` image
tokens; positions are the multimodal (t, h, w) rows; attention stays causal.

Gemma 3: the prompt writes ``<start_of_image>`` once per image; it becomes
``"\\n\\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"`` (as
transformers' ``Gemma3Processor.full_image_sequence``); positions are plain; the tokens of one run
of image tokens attend to each other both ways (``bidirectional``). Its processor gives square
images [n, C, S, S], cut here into patches of ``patch_size`` (grid (1, S / p, S / p)):

    >>> f = ImageFormat(image_token_id=9, merge=2, placeholder_id=7, begin_id=7, end_id=8, around="\\n\\n",
    ...                 bidirectional=True, patch_size=4, image_size=16)
    >>> f.tokens((1, 4, 4)), f.marker, f.expansion_ids((1, 4, 4), [5])
    (4, 7, [5, 7, 9, 9, 9, 9, 8, 5])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError


@dataclass(frozen=True, slots=True)
class ImageFormat:
    image_token_id: int  # the token whose rows the tower's output replaces
    merge: int  # an image of patch grid (t, h, w) has t * h * w / merge² tokens
    placeholder_id: int | None = None  # the id a prompt marks each image with; None: the image token
    begin_id: int | None = None  # written before an image's tokens when a placeholder is expanded
    end_id: int | None = None  # and after them
    around: str = ""  # text on both sides of an expanded image
    mrope: bool = False  # positions: the multimodal (t, h, w) rows (Qwen3.5); else each token's index
    bidirectional: bool = False  # one run of image tokens attends to itself both ways (Gemma 3)
    patch_size: int = 0  # > 0: the processor gives square images [n, C, S, S], cut into p x p patches here
    image_size: int = 0  # S: the side the tower takes (patch_size > 0)

    @property
    def marker(self) -> int:
        """The id a prompt writes once per image."""
        return self.image_token_id if self.placeholder_id is None else self.placeholder_id

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge ** 2

    def expansion_ids(self, grid: tuple[int, int, int], around_ids: list[int]) -> list[int]:
        """The ids one placeholder becomes (``around_ids``: ``around`` tokenized)."""
        run = [self.image_token_id] * self.tokens(grid)
        if self.begin_id is not None:
            run = [self.begin_id] + run
        if self.end_id is not None:
            run = run + [self.end_id]
        return around_ids + run + around_ids if self.around else run

    def patches(self, out, field: str) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The image processor's output -> (patches [N, C * p * p ...] float32, each image's grid)."""
        if "image_position_ids" in out:  # Gemma 4: padded patch lists with each patch's (x, y)
            return _positioned(out, self.merge, field)
        if self.patch_size == 0:
            grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
            return out["pixel_values"].float(), grids
        crops = out.get("num_crops")
        if crops is not None and any(int(c) for c in torch.as_tensor(crops).flatten().tolist()):
            raise LogprobeError(field, "the image processor made pan-and-scan crops: they are not taken",
                                "set do_pan_and_scan to false in preprocessor_config.json")
        px = out["pixel_values"].float()  # [n, C, S, S]
        p, S = self.patch_size, self.image_size
        if px.dim() != 4 or px.shape[2] != S or px.shape[3] != S:
            raise LogprobeError(field, f"the image processor gave pixel values {tuple(px.shape)}, the vision tower "
                                f"takes {S} x {S} images", "set the processor's size to the tower's image_size")
        n, C, g = px.shape[0], px.shape[1], S // p
        # each p x p patch flattened (channel, row, column) as the Conv2d weight, patches in raster order
        cut = px.reshape(n, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n * g * g, C * p * p)
        return cut, [(1, g, g)] * n


def _positioned(out, merge: int, field: str) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """A processor's padded patches [n, max, dim] with their (x, y) [n, max, 2] ((-1, -1): padding)
    -> each image's own patches, which must be its ph x pw grid in raster order (as Gemma 4's
    processor lays them), joined, and the grids (1, ph, pw)."""
    px, pos = out["pixel_values"].float(), torch.as_tensor(out["image_position_ids"]).long()
    parts, grids = [], []
    for i in range(px.shape[0]):
        valid = (pos[i] >= 0).all(-1)
        n = int(valid.sum())
        xy = pos[i][:n]
        ph, pw = (int(xy[:, 1].max()) + 1, int(xy[:, 0].max()) + 1) if n else (0, 0)
        raster = torch.stack([torch.arange(pw).repeat(ph), torch.arange(ph).repeat_interleave(pw)], -1)
        if not n or ph * pw != n or bool(valid[n:].any()) or not torch.equal(xy, raster) or ph % merge or pw % merge:
            raise LogprobeError(field, f"image {i}: the processor's patches are not a raster grid of whole "
                                f"{merge} x {merge} tokens", "use the checkpoint's own image processor")
        parts.append(px[i, :n])
        grids.append((1, ph, pw))
    return torch.cat(parts), grids

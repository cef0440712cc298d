"""Images in a request: each image read (PIL image, file path, bytes or a ``data:`` URL), turned
into patches by the checkpoint's own image processor (transformers' ``AutoImageProcessor``: its
resizing and normalisation), each placeholder of the prompt expanded to the image's tokens, and
the positions and bidirectional spans of the whole sequence. What differs by family is the model's
``ImageFormat`` (``models.vision``).

Qwen3.5: the placeholder is the image token's text (``<|image_pad|>``, as the chat template writes
it between ``<|vision_start|>`` and ``<|vision_end|>``); image i's placeholder becomes
``t * h * w / m²`` image tokens (its patch grid merged by m), as transformers' ``Qwen3VLProcessor``
expands it (``replace_image_token``). That processor also loads a video processor, which needs
torchvision; the image processor alone does what a sequence of images needs.

    prompt "A <|vision_start|><|image_pad|><|vision_end|> cat" with one image that the processor
    makes a grid (1, 6, 10) of patches (m = 2): the placeholder becomes 6 * 10 / 4 = 15 image tokens

Gemma 3: the placeholder is ``<start_of_image>``; it becomes ``Gemma3Processor``'s
``"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"``
in the prompt text (tokenized with it); in ``prompt_token_ids`` that text's ids are spliced in,
``"\\n\\n"`` tokenized alone (give them expanded, as the processor returns them, for its exact ids).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..engine.images import bidirectional_spans
from ..engine.request import ImageInputs
from ..errors import LogprobeError
from ..models.qwen3_5_vision import mrope_positions
from ..models.vision import ImageFormat
from ..tokenizer import Tokenizer


def read_image(item, field: str):
    """A PIL image (RGB) from a PIL image, a file path, bytes or a ``data:image/...;base64,`` URL;
    unreadable, truncated or unknown data: ``LogprobeError`` naming ``field``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise LogprobeError(field, "reading images needs Pillow", "pip install 'logprobe[images]'") from e

    if isinstance(item, Image.Image):
        image = item
    else:
        data = _image_bytes(item, field)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()  # decodes now: a truncated file fails here, not in the processor
        except Image.DecompressionBombError as e:  # Pillow's ceiling (~179 M pixels): not an OSError
            raise LogprobeError(field, f"has too many pixels ({e})", "give a smaller image") from e
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise LogprobeError(field, f"is not a readable image: {e}", "give a PNG, JPEG, WebP or GIF image") from e
    return image.convert("RGB")


def _image_bytes(item, field: str) -> bytes:
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str) and item.startswith("data:"):
        head, _, payload = item.partition(",")
        if not head.endswith(";base64") or not head.startswith("data:image/"):
            raise LogprobeError(field, f"{head[:40]!r}: a data URL must be data:image/...;base64,...")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise LogprobeError(field, f"the data URL is not base64: {e}") from e
    if isinstance(item, (str, Path)):
        path = Path(item).expanduser()
        if not path.is_file():
            raise LogprobeError(field, f"{str(item)[:200]!r} is not an image file",
                                "give a PIL image, bytes, a data: URL or an existing file path")
        return path.read_bytes()
    raise LogprobeError(field, f"must be a PIL image, bytes, a data: URL or a file path, got {type(item).__name__}")


@dataclass
class ImageReader:
    """A checkpoint's images -> request inputs (its image processor loaded on first use), by the
    model's ``ImageFormat``."""

    path: str
    tokenizer: Tokenizer
    fmt: ImageFormat
    _processor: object = field(default=None, repr=False)
    _call: threading.local = field(default_factory=threading.local, repr=False)  # ``one_call``'s memo

    @contextmanager
    def one_call(self):
        """Within it (one call's requests, this thread), a list of images already read is not read
        and processed again: an RL group's requests share their images, the same objects. Only
        within a call: a PIL image may be changed between calls."""
        self._call.memo = {}
        try:
            yield
        finally:
            self._call.memo = None

    @property
    def image_token_id(self) -> int:
        return self.fmt.image_token_id

    @property
    def merge(self) -> int:
        return self.fmt.merge

    @property
    def placeholder(self) -> str:
        return self.tokenizer.hf.convert_ids_to_tokens(self.fmt.marker)

    def processor(self):
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(self.path)
            except (OSError, ValueError) as e:
                raise LogprobeError("images", f"the checkpoint's image processor does not load: {e}",
                                    "put the checkpoint's preprocessor_config.json beside its config.json") from e
        return self._processor

    def patches(self, images: list, field: str, fields: list[str] | None = None
                ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """(pixel values [patches, patch_dim] float32, each image's grid) of the images read
        (image k named ``fields[k]``, by default ``field[k]``)."""
        memo = getattr(self._call, "memo", None)
        key = tuple(map(id, images))
        if memo is not None and key in memo:
            return memo[key][1]
        fields = fields or [f"{field}[{k}]" for k in range(len(images))]
        pil = [read_image(item, name) for item, name in zip(images, fields)]
        try:
            out = self.processor()(images=pil, return_tensors="pt")
        except (ValueError, OSError) as e:
            raise LogprobeError(field, f"the image processor refused them: {e}") from e
        read = self.fmt.patches(out, field)
        if memo is not None:
            memo[key] = (images, read)  # the images held: their ids name them for the whole call
        return read

    def _text(self, token: int | None) -> str:
        return "" if token is None else self.tokenizer.hf.convert_ids_to_tokens(token)

    def expansion_text(self, grid: tuple[int, int, int]) -> str:
        """The text one placeholder becomes."""
        f = self.fmt
        run = self._text(f.begin_id) + self._text(f.image_token_id) * f.tokens(grid) + self._text(f.end_id)
        return f.around + run + f.around

    def prompt(self, text: str, images, field: str) -> tuple[str, torch.Tensor, list[tuple[int, int, int]]]:
        """The prompt with each placeholder expanded to its image's tokens, the pixel values, the grids."""
        if not isinstance(images, (list, tuple)) or not images:
            raise LogprobeError(f"{field}.images", "must be a non-empty list of images")
        mark = self.placeholder
        if text.count(mark) != len(images):
            raise LogprobeError(f"{field}.images", f"{len(images)} images for {text.count(mark)} {mark} "
                                "placeholders in the prompt", f"write {mark} once per image, where it stands")
        pixels, grids = self.patches(list(images), f"{field}.images")
        pieces = text.split(mark)
        out = pieces[0]
        for grid, rest in zip(grids, pieces[1:]):
            out += self.expansion_text(grid) + rest
        return out, pixels, grids

    def prompt_ids(self, ids: list[int], images, field: str) -> tuple[list[int], torch.Tensor, list]:
        """Prompt ids with the placeholder once per image (expanded) or already expanded -> (ids
        expanded, pixel values, grids)."""
        if not isinstance(images, (list, tuple)) or not images:
            raise LogprobeError(f"{field}.images", "must be a non-empty list of images")
        pixels, grids = self.patches(list(images), f"{field}.images")
        f = self.fmt
        marks = sum(1 for x in ids if x == f.marker)
        tokens = sum(1 for x in ids if x == f.image_token_id)
        if marks == len(grids) and (f.placeholder_id is None or tokens == 0):
            return self.expand(ids, grids, f"{field}.images"), pixels, grids
        want = sum(f.tokens(g) for g in grids)
        if tokens != want:
            raise LogprobeError(f"{field}.images", f"{len(grids)} images ({want} image tokens) for {tokens} ids "
                                f"{f.image_token_id} in prompt_token_ids",
                                f"give the placeholder {f.marker} once per image")
        return list(ids), pixels, grids

    def expand(self, ids: list[int], grids: list[tuple[int, int, int]], field: str) -> list[int]:
        """Ids with one placeholder per image (a chat template's rendering) -> each expanded to its
        image's ids (``ImageFormat.expansion_ids``)."""
        marks = [j for j, x in enumerate(ids) if x == self.fmt.marker]
        if len(marks) != len(grids):
            raise LogprobeError(field, f"the chat template wrote {len(marks)} image placeholders for {len(grids)} "
                                "images", "use the model's own chat template (it renders image parts)")
        around = self.tokenizer.encode(self.fmt.around) if self.fmt.around else []
        out, a = [], 0
        for j, grid in zip(marks, grids):
            out += ids[a:j] + self.fmt.expansion_ids(grid, around)
            a = j + 1
        return out + ids[a:]

    def digests(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[str, ...]:
        """Each image's digest (sha256 of its pixel values and grid): within ``one_call`` once per
        pixel tensor, which ``patches`` hands every request of a group (hashing a 1024-px image's
        25 MB of patches took longer than the tower ran it)."""
        memo = getattr(self._call, "memo", None)
        held = memo.get(("digests", id(pixels))) if memo is not None else None
        if held is not None and held[0] is pixels:
            return held[1]
        keys, a = [], 0
        for grid in grids:
            n = grid[0] * grid[1] * grid[2]
            digest = hashlib.sha256(pixels[a:a + n].numpy().tobytes())
            digest.update(repr(grid).encode())
            keys.append(digest.hexdigest())
            a += n
        if memo is not None:  # the tensor held with them: its id names it for the whole call
            memo[("digests", id(pixels))] = (pixels, tuple(keys))
        return tuple(keys)

    def inputs(self, ids: list[int], pixels: torch.Tensor, grids: list[tuple[int, int, int]], field: str
               ) -> ImageInputs:
        """The request's ``ImageInputs`` for its whole token ids (prompt and completion)."""
        f = self.fmt
        index = np.nonzero(np.asarray(ids) == f.image_token_id)[0].astype(np.int64)
        want = sum(f.tokens(g) for g in grids)
        if len(index) != want:
            raise LogprobeError(f"{field}.images", f"{len(index)} image tokens for {want} image embeddings",
                                "write the placeholder once per image and nowhere else")
        keys = self.digests(pixels, grids)
        positions = mrope_positions(ids, f.image_token_id, grids, f.merge).numpy() if f.mrope else None
        spans = bidirectional_spans(index) if f.bidirectional else ()
        return ImageInputs(pixels, tuple(grids), index, positions, keys, spans=spans)

"""Images in HTTP requests (a model with a vision tower: Qwen3.5), turned into bytes the library
reads (``scoring.images``) once the server's limits hold. The server reads no file of its own disk
and, by default, fetches nothing: an image comes inline.

    "data:image/png;base64,iVBOR..."       -> its bytes (every route)
    "iVBOR..." (bare base64)               -> its bytes (SGLang's image_data and verl's multi_modal_data only)
    "https://host/cat.png"                 -> 400 naming the field, unless the server was started with
                                              --allow-remote-images: then fetched (timeout, size limit)
    anything else (a path, a number)       -> 400 naming the field

Limits, checked before the image processor runs (each a 400 naming the item):
``max_images_per_request`` images in one HTTP request (the first one beyond it is named), and
``max_image_pixels`` per image, read off the image's header before it is decoded
(a 20000 x 20000 PNG of a few kilobytes is refused without its 1.2 GB of pixels).
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import LogprobeError
from ..io.images import check_pixels
from .config import ServerConfig

FETCH_CHUNK = 1 << 16


@contextmanager
def renamed(old: str, new: str) -> Iterator[None]:
    """Re-raise a ``LogprobeError`` whose field starts with ``old`` as one naming ``new`` there: the
    library names a sequence's images ``sequences[i].images[k]``; a request that sent them as
    ``multi_modal_data.image`` or ``image_data`` is told its own field."""
    try:
        yield
    except LogprobeError as e:
        if not e.field.startswith(old):
            raise
        raise LogprobeError(new + e.field[len(old):], e.problem, e.fix) from e


def image_bytes(value, field: str, config: ServerConfig, bare_base64: bool = False) -> bytes:
    """The bytes of one image sent over HTTP (see the module docstring)."""
    if not isinstance(value, str):
        raise LogprobeError(field, f"must be a data:image/...;base64 URL string, got {type(value).__name__}")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise LogprobeError(field, f"{head[:40]!r}: a data URL must be data:image/...;base64,...")
        return _b64(payload, field)
    if value.startswith(("http://", "https://")):
        if not config.allow_remote_images:
            raise LogprobeError(field, f"is a remote URL ({value[:80]!r}): this server fetches no images",
                                "send the image inline as data:image/png;base64,..., or start the server with "
                                "--allow-remote-images")
        return fetch(value, field, config)
    if bare_base64:  # SGLang's image_data takes base64 without a data: header (a path is not read)
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise LogprobeError(field, f"{value[:60]!r} is neither a data: URL nor base64 (the server reads no "
                                "files)", "send the image inline as data:image/png;base64,...") from None
    raise LogprobeError(field, f"{value[:60]!r} is not a data: URL (the server reads no files)",
                        "send the image inline as data:image/png;base64,...")


def _b64(payload: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise LogprobeError(field, f"is not base64: {e}", "send the image's bytes base64-encoded") from e


def fetch(url: str, field: str, config: ServerConfig) -> bytes:
    """An http(s) image, read within ``remote_image_timeout`` s (per socket operation) and
    ``max_remote_image_bytes``; any failure a 400 naming ``field``."""
    limit = config.max_remote_image_bytes
    try:
        with urllib.request.urlopen(url, timeout=config.remote_image_timeout) as resp:  # noqa: S310 (opted in)
            if not resp.geturl().startswith(("http://", "https://")):  # a redirect to another scheme
                raise LogprobeError(field, f"redirected to {resp.geturl()[:80]!r}", "give an http(s) image URL")
            data = b""
            while len(data) <= limit:
                chunk = resp.read(FETCH_CHUNK)
                if not chunk:
                    return data
                data += chunk
    except (urllib.error.URLError, OSError, ValueError) as e:  # HTTP errors, timeouts, refused connections
        raise LogprobeError(field, f"could not be fetched ({type(e).__name__}: {e})",
                            "check the URL, or send the image inline as a data: URL") from e
    raise LogprobeError(field, f"is more than {limit} bytes (the server's limit on a fetched image)",
                        "send a smaller image")


class ImageBudget:
    """The images of one HTTP request, counted against ``max_images_per_request`` as they are read."""

    def __init__(self, config: ServerConfig) -> None:
        self.config, self.count = config, 0

    def read(self, value, field: str, bare_base64: bool = False) -> bytes:
        """``value``'s bytes, within the limits (see the module docstring)."""
        self.count += 1
        limit = self.config.max_images_per_request
        if self.count > limit:
            raise LogprobeError(field, f"is image {self.count} of this request: more than this server's limit of "
                                f"{limit}", "send fewer images per request (or start the server with a larger "
                                "--max-images-per-request)")
        data = image_bytes(value, field, self.config, bare_base64)
        check_pixels(data, field, self.config.max_image_pixels,
                     "send a smaller image (or start the server with a larger --max-image-pixels)")
        return data


def chat_images(messages: list[dict], context, budget: ImageBudget) -> list[dict]:
    """OpenAI messages with each ``image_url`` / ``image`` part's image read into bytes (an
    ``{"type": "image", "image": bytes}`` part, what ``scoring.chat`` takes); other parts as they
    are. A model without a vision tower: the first image part is refused by name.

        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}
     -> {"type": "image", "image": b"\\x89PNG..."}       (errors name messages[i].content[j].image_url.url)
    """
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, list):
            content = [_chat_part(p, f"messages[{i}].content[{j}]", context, budget) for j, p in enumerate(content)]
        out.append({**m, "content": content})
    return out


def _chat_part(part: dict, field: str, context, budget: ImageBudget) -> dict:
    kind = part.get("type")
    if kind not in ("image_url", "image"):
        return part
    if context.images is None:
        context.check_images(field)  # raises: the model has no vision tower
    if kind == "image":
        return {"type": "image", "image": budget.read(part.get("image"), f"{field}.image")}
    url = part.get("image_url")
    if isinstance(url, dict):
        return {"type": "image", "image": budget.read(url.get("url"), f"{field}.image_url.url")}
    return {"type": "image", "image": budget.read(url, f"{field}.image_url")}


def sequence_images(seqs: list[dict], context, budget: ImageBudget) -> tuple[list[dict], list[tuple[str, str]]]:
    """``/v1/logprobs`` sequences with their ``images`` (data: URLs) or verl's ``multi_modal_data``
    (``{"image": [...]}``, bare base64 too) read into bytes under the library's ``images`` key ->
    (the sequences, the (library field, request field) renames of their errors).

        {"prompt_token_ids": [...], "completion_token_ids": [...], "multi_modal_data": {"image": ["iVBOR..."]}}
     -> {"prompt_token_ids": [...], "completion_token_ids": [...], "images": [b"\\x89PNG..."]},
        [("sequences[0].images", "sequences[0].multi_modal_data.image")]
    """
    out, renames = [], []
    for i, seq in enumerate(seqs):
        at = f"sequences[{i}]"
        if "images" in seq and "multi_modal_data" in seq:
            raise LogprobeError(f"{at}.multi_modal_data", "is given with images", "send the images once, in one of them")
        if "multi_modal_data" in seq:
            values, field, bare = seq["multi_modal_data"]["image"], f"{at}.multi_modal_data.image", True
            renames.append((f"{at}.images", field))
        elif "images" in seq:
            values, field, bare = seq["images"], f"{at}.images", False
        else:
            out.append(seq)
            continue
        data = read_images(values, field, context, budget, bare)
        out.append({k: v for k, v in seq.items() if k != "multi_modal_data"} | {"images": data})
    return out, renames


def read_images(values: list, field: str, context, budget: ImageBudget, bare_base64: bool = False) -> list[bytes]:
    """A list of images sent as ``field`` (``/v1/score``'s ``images``, a sequence's) read into
    bytes, image k named ``field[k]``; a model without a vision tower: refused naming ``field``."""
    if context.images is None:
        context.check_images(field)  # raises: the model has no vision tower
    return [budget.read(v, f"{field}[{k}]", bare_base64) for k, v in enumerate(values)]


def renamed_job(renames: list[tuple[str, str]], build):
    """``build()``, its errors naming the request's own fields (``renamed``)."""
    try:
        return build()
    except LogprobeError as e:
        for old, new in renames:
            if e.field.startswith(old):
                raise LogprobeError(new + e.field[len(old):], e.problem, e.fix) from e
        raise

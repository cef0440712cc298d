"""Image bytes coming in (an HTTP request's, a table cell's): their size read off the header, before
anything decodes them, so a bad or huge image is refused by name while it is still a few bytes.

    image_size(png_bytes, "images[0]")        -> (48, 32)
    image_size(b"%PDF-1.4", "images[0]")      -> LogprobeError "images[0]: is not an image in a format Pillow reads ..."
    a 40000 x 40000 PNG of 40 kB              -> (40000, 40000), not 4.8 GB decoded (the caller compares it with its limit)
"""

from __future__ import annotations

import io

from ..errors import LogprobeError

FIX = "give a PNG, JPEG, WebP or GIF image"


def image_size(data: bytes, field: str) -> tuple[int, int]:
    """(width, height) from the image's header; unreadable data: ``LogprobeError`` naming ``field``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise LogprobeError(field, "reading images needs Pillow", "pip install 'logprobe[images]'") from e
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            return image.size
    except Image.DecompressionBombError as e:  # Pillow's own ceiling (~179 M pixels)
        raise LogprobeError(field, f"has too many pixels ({e})", "send a smaller image") from e
    except UnidentifiedImageError as e:
        raise LogprobeError(field, f"is not an image in a format Pillow reads (its first bytes: {data[:8]!r})",
                            FIX) from e
    except (OSError, ValueError, SyntaxError) as e:
        raise LogprobeError(field, f"is not a readable image: {e}", FIX) from e


def check_pixels(data: bytes, field: str, max_pixels: int, fix: str = "send a smaller image") -> None:
    """Refuse an image of more than ``max_pixels`` pixels (or an unreadable one) from its header.

    >>> from PIL import Image
    >>> png = io.BytesIO(); Image.new("RGB", (256, 256)).save(png, "PNG")
    >>> check_pixels(png.getvalue(), "image", 100)
    Traceback (most recent call last):
    logprobe.errors.LogprobeError: image: is 256 x 256 = 65536 pixels, more than the limit of 100; send a smaller image
    """
    w, h = image_size(data, field)
    if w * h > max_pixels:
        raise LogprobeError(field, f"is {w} x {h} = {w * h} pixels, more than the limit of {max_pixels}", fix)

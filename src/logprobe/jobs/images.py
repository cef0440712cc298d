"""A table's image column (``--images-column NAME``; a model with a vision tower): each row's cell
is its prompt's images, one placeholder each in the prompt (``scoring.images``).

A cell is one image or a list of them (CSV: a JSON list); an image is a file path (relative to the
table file's folder, ``base_dir``), bytes (Parquet binary), a ``data:image/...;base64`` URL, or
Hugging Face datasets' ``{"bytes": ..., "path": ...}``. An empty cell: a row without images. Each
image is read here and its header checked (``io.images``), so a row whose image cannot be read
fails alone, naming the row and the column:

    row 3: image[1]: 'cats/b.png' cannot be read (No such file or directory); paths are relative to the table file's folder

>>> row_images(None, "image", ".") is None
True
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from ..errors import LogprobeError
from ..io.images import image_size
from . import fields


def row_images(value: Any, column: str, base_dir: str) -> list[bytes] | None:
    """The images of one cell, as bytes (None: an empty cell); errors name ``column`` (``column[k]``
    for the k-th of a list)."""
    if fields.missing(value):
        return None
    if isinstance(value, str) and value.lstrip().startswith("["):  # CSV: a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise LogprobeError(column, f"is not a JSON list ({e.msg} at column {e.colno})",
                                'write it as ["a.png", "b.png"]') from e
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray":
        return [cell_image(v, f"{column}[{k}]", base_dir) for k, v in enumerate(value)] or None
    return [cell_image(value, column, base_dir)]


def cell_image(item: Any, name: str, base_dir: str) -> bytes:
    """One image's bytes, its header checked (see the module docstring)."""
    if isinstance(item, dict):  # datasets' Image feature as stored in Parquet
        item = item.get("bytes") if item.get("bytes") is not None else item.get("path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    elif isinstance(item, str) and item.startswith("data:"):
        head, _, payload = item.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise LogprobeError(name, f"{head[:40]!r}: a data URL must be data:image/...;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise LogprobeError(name, f"the data URL is not base64: {e}") from e
    elif isinstance(item, str) and item:
        path = os.path.join(base_dir, os.path.expanduser(item))  # an absolute path stays as it is
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise LogprobeError(name, f"{item[:200]!r} cannot be read ({e.strerror or e})",
                                "paths are relative to the table file's folder") from e
    else:
        raise LogprobeError(name, f"must be an image path, bytes or a data: URL, got {type(item).__name__}")
    image_size(data, name)  # unreadable or too large for Pillow: refused here, by name
    return data


def rename_image_field(field: str, column: str) -> str:
    """A library field of a row's images (``images``, ``images[k]``) as the table's column.

    >>> rename_image_field("images[1]", "image"), rename_image_field("prompt", "image")
    ('image[1]', 'prompt')
    """
    return column + field[len("images"):] if field.startswith("images") else field

"""A ``messages`` column (a chat: a list of ``{role, content}``, or its JSON text in CSV) -> the
job of its final assistant message under the model's chat template (``scoring.chat``). ``ScoreRows``
takes it instead of ``prompt`` + ``continuation``; the output columns are a continuation's, with
``continuation`` the scored tokens' text.

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
 -> {"index": 0, "continuation": "Hello!<|im_end|>\\n", "log_prob": -3.1, "num_tokens": 4, ...}

>>> messages('[{"role": "user", "content": "Hi"}]')
[{'role': 'user', 'content': 'Hi'}]
"""

from __future__ import annotations

from typing import Any

from ..errors import LogprobeError
from ..scoring.chat import chat_job
from ..scoring.options import HeadOptions
from ..scoring.work import Job, ScoringContext
from . import fields
from .images import cell_image


def messages(value: Any, name: str = "messages") -> list:
    """The column's value as a list (CSV: JSON text parsed)."""
    value = fields.json_value(value, name)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise LogprobeError(name, f"must be a list of {{role, content}} messages, got {type(value).__name__}")
    return list(value)


def chat_row_job(value: Any, context: ScoringContext, options: HeadOptions, base_dir: str = "") -> Job:
    """The job of one row's ``messages``; ``finish`` gives a ``ContinuationScore``. An image part's
    path is relative to ``base_dir`` (the table file's folder), as an image column's is."""
    return chat_job(context, table_images(messages(value), base_dir), options)


def table_images(msgs: list, base_dir: str) -> list:
    """The messages with each ``{"type": "image", "image": <path>}`` part's file read (``jobs.images``:
    the path relative to ``base_dir``, the error naming the part); other parts as they are.

    >>> table_images([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "/data")
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}]
    """
    out = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = [_read_path(p, f"messages[{i}].content[{j}].image", base_dir) for j, p in enumerate(content)]
            m = {**m, "content": content}
        out.append(m)
    return out


def _read_path(part: Any, field: str, base_dir: str) -> Any:
    if isinstance(part, dict) and part.get("type") == "image" and isinstance(part.get("image"), str) \
            and part["image"] and not part["image"].startswith("data:"):
        return {**part, "image": cell_image(part["image"], field, base_dir)}
    return part

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


def messages(value: Any, name: str = "messages") -> list:
    """The column's value as a list (CSV: JSON text parsed)."""
    value = fields.json_value(value, name)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise LogprobeError(name, f"must be a list of {{role, content}} messages, got {type(value).__name__}")
    return list(value)


def chat_row_job(value: Any, context: ScoringContext, options: HeadOptions) -> Job:
    """The job of one row's ``messages``; ``finish`` gives a ``ContinuationScore``."""
    return chat_job(context, messages(value), options)

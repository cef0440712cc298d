"""A row job by name from flat keyword options (``temperature=..., context_length=...``), as
Ray actors and ``logprobe ray`` pass them: the keywords are gathered into the job's records
(``scoring.options``), so no job restates their defaults.

>>> row_job("score", temperature=2.0, join="").options
HeadOptions(temperature=2.0, top_k=0, entropy=False)
>>> row_job("perplexity", context_length=64, text_field="body").windows.context_length
64
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..errors import LogprobeError
from ..scoring.options import HeadOptions, HookSpecs, Windows
from .logprobs import LogprobsRows
from .perplexity import PerplexityRows
from .score import ScoreRows

JOBS = {"logprobs": LogprobsRows, "score": ScoreRows, "perplexity": PerplexityRows}
# a job's record field -> the record whose keywords it gathers
RECORDS = {"options": HeadOptions, "hooks": HookSpecs, "windows": Windows}


def row_job(name: str, **options: Any):
    """``JOBS[name]`` with ``options``: its own fields as given, the records' fields gathered."""
    if name not in JOBS:
        raise LogprobeError("job", f"must be one of {', '.join(JOBS)}, got {name!r}")
    cls = JOBS[name]
    own = {f.name for f in fields(cls)}
    kwargs = {}
    for field_name, record in RECORDS.items():
        if field_name in own:
            names = {f.name for f in fields(record)}
            kwargs[field_name] = record(**{k: options.pop(k) for k in list(options) if k in names})
    return cls(**kwargs, **options)  # an unknown keyword is a TypeError naming it

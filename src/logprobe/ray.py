"""``logprobe.ray``: the Ray Data classes (``Logprobs``, ``Score``, ``Perplexity``) and
``aggregate_perplexity``; they live in ``logprobe.integrations.ray``. Importing ``logprobe`` does
not import this module (nor Ray); the classes import Ray only where they need it.

>>> import logprobe.ray
>>> logprobe.ray.Logprobs.job_name
'logprobs'
"""

from .integrations.ray import JOBS, Logprobs, Perplexity, Score, aggregate_perplexity

__all__ = ["JOBS", "Logprobs", "Perplexity", "Score", "aggregate_perplexity"]

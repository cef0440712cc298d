"""``logprobe.ray``: the Ray Data classes (``Logprobs``, ``Score``, ``Perplexity``),
``map_batches`` (``Dataset.map_batches`` after a check that the actors leave a CPU for reading) and
``aggregate_perplexity``; they live in ``logprobe.integrations.ray``. Importing ``logprobe`` does
not import this module (nor Ray); the classes import Ray only where they need it.

>>> import logprobe.ray
>>> logprobe.ray.Logprobs.job_name
'logprobs'
"""

from .integrations.ray import JOBS, Logprobs, Perplexity, Score, aggregate_perplexity, check_cpus, map_batches

__all__ = ["JOBS", "Logprobs", "Perplexity", "Score", "aggregate_perplexity", "check_cpus", "map_batches"]

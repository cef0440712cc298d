"""logprobe: exact log-probabilities of given text under a language model, fast."""

from .config import EngineConfig
from .errors import LogprobeError
from .loading import LoadedModel, ModelInfo, load_model
from .scorer import ContinuationScore, PerplexityResult, Scorer, SequenceLogprobs

__all__ = ["ContinuationScore", "EngineConfig", "LoadedModel", "LogprobeError", "ModelInfo",
           "PerplexityResult", "Scorer", "SequenceLogprobs", "load_model"]
__version__ = "0.1.0"

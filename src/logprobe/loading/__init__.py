"""``load_model(spec)``: a model name, a GGUF file or a Hugging Face directory -> LoadedModel."""

from .loader import DEFAULT_MODEL, LoadedModel, ModelInfo, load_model

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelInfo", "load_model"]

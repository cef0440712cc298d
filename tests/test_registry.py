"""The registry of native families (``loading.registry``): each config.json model_type and GGUF
architecture goes to the family the loader's if-chains sent it to before the registry (a literal
table, written from that code)."""

from __future__ import annotations

import pytest

from logprobe.errors import LogprobeError
from logprobe.layers.moe import MoeSpec
from logprobe.loading.registry import (
    Family,
    families,
    family_for_config,
    family_for_gguf,
    family_of,
    register,
)
from logprobe.models.glm4 import Glm4Config
from logprobe.models.glm4_moe import PartialRotaryConfig
from logprobe.models.llama import LlamaConfig

# config.json model_type -> the family load_model / describe_model read it with (None: the
# transformers backend), as the if-chains of loader.py (is_hybrid, is_deepseek, is_sigmoid_moe,
# is_gpt_oss, is_gemma, is_gemma4, is_glm4, then hf.native_config) decided before the registry.
MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "llama",
    "qwen2_moe": "llama", "qwen3_moe": "llama", "mixtral": "llama", "olmoe": "llama",
    "deepseek_v3": "deepseek", "kimi_k2": "deepseek",
    "glm4_moe": "sigmoid_moe", "minimax_m2": "sigmoid_moe",
    "gpt_oss": "gpt_oss",
    "gemma3_text": "gemma", "gemma3": "gemma",
    "gemma4_text": "gemma4", "gemma4": "gemma4",
    "glm4": "glm4",
    "qwen3_5_text": "hybrid", "qwen3_5_moe_text": "hybrid", "qwen3_next": "hybrid",
    "qwen3_5": "hybrid", "qwen3_5_moe": "hybrid",
    "gpt2": None, "gemma2": None, "phi": None, "bert": None, "qwen3_5_moe_text_x": None,
}
# GGUF general.architecture -> family (None: refused as not supported), as loader._gguf_config and
# gguf.gguf_config decided.
GGUF_ARCHS = {
    "llama": "llama", "qwen2": "llama", "qwen3": "llama", "qwen2moe": "llama", "qwen3moe": "llama",
    "qwen3next": "hybrid", "qwen35": "hybrid", "qwen35moe": "hybrid",
    "deepseek2": "deepseek", "glm4moe": "sigmoid_moe", "minimax-m2": "sigmoid_moe", "gemma3": "gemma",
    "gemma2": None, "phi3": None, "bert": None,
}


def _name(family: Family | None) -> str | None:
    return None if family is None else family.name


def test_model_types_go_to_the_family_the_if_chains_chose():
    got = {t: _name(family_for_config({"model_type": t})) for t in MODEL_TYPES}
    assert got == MODEL_TYPES
    registered = {t for f in families() for t in f.model_types}
    assert registered == {t for t, f in MODEL_TYPES.items() if f is not None}  # the table covers every key
    assert family_for_config({}) is None and family_for_config({"model_type": ["llama"]}) is None


def test_gguf_architectures_go_to_the_family_the_if_chains_chose():
    assert {a: _name(family_for_gguf(a)) for a in GGUF_ARCHS} == GGUF_ARCHS
    assert {a for f in families() for a in f.gguf_archs} == {a for a, f in GGUF_ARCHS.items() if f is not None}
    assert family_for_gguf(None) is None


def test_a_config_object_finds_its_family_through_its_class():
    """The most derived registered class wins: GLM-4's and the sigmoid routers' configs are
    LlamaConfigs (update.family's isinstance chain checked them before the Llama family)."""
    llama = LlamaConfig(64, 16, 32, 1, 2, 2, 8)
    moe = LlamaConfig(64, 16, 32, 1, 2, 2, 8, moe=MoeSpec(4, 2, 8, True))
    assert [_name(family_of(c)) for c in (llama, moe)] == ["llama", "llama"]
    assert _name(family_of(Glm4Config(64, 16, 32, 1, 2, 2, 8))) == "glm4"
    assert _name(family_of(PartialRotaryConfig(64, 16, 32, 1, 2, 2, 8))) == "sigmoid_moe"
    assert family_of(None) is None and family_of({"model_type": "llama"}) is None


def test_a_key_registered_by_two_families_is_refused():
    gemma = family_for_config({"model_type": "gemma3"})
    with pytest.raises(LogprobeError, match="is registered by the families 'gemma' and 'copy'"):
        register(Family(**{**{k: getattr(gemma, k) for k in Family.__slots__}, "name": "copy",
                           "config_class": type("CopyConfig", (), {})}))
    assert _name(family_for_config({"model_type": "gemma3"})) == "gemma"

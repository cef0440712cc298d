"""The registry of native families (``loading.registry``): each config.json model_type and GGUF
architecture goes to the family the loader's if-chains sent it to before the registry (a literal
table, written from that code), the loader and weight updates name no family, and every registered
family's tiny checkpoint loads through it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_budget_families import saved_dirs
from test_deepseek import ds_dirs as ds_dirs  # noqa: F401 (fixtures used by name)
from test_gemma3 import gemma_dirs as gemma_dirs  # noqa: F401
from test_gemma4 import gemma4_dirs as gemma4_dirs  # noqa: F401
from test_glm4 import glm4_dir as glm4_dir  # noqa: F401
from test_gpt_oss import dirs as gpt_oss_dirs  # noqa: F401
from test_moe_sigmoid_families import dirs as sigmoid_dirs  # noqa: F401
from test_qwen3_next import float64_reference as float64_reference  # noqa: F401
from test_qwen3_next import hybrid_dirs as hybrid_dirs  # noqa: F401
from test_qwen3_vl import vl_dirs as qwen3_vl_dirs  # noqa: F401

import logprobe.loading.loader as loader_module
import logprobe.loading.update as update_module
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
from logprobe.models.base import ScoringModel
from logprobe.models.glm4 import Glm4Config
from logprobe.models.glm4_moe import PartialRotaryConfig
from logprobe.models.llama import LlamaConfig
from logprobe.models.qwen3_vl import Qwen3VLConfig

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
    "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
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
    assert _name(family_of(Qwen3VLConfig(64, 16, 32, 1, 2, 2, 8))) == "qwen3_vl"
    assert family_of(None) is None and family_of({"model_type": "llama"}) is None


def test_a_key_registered_by_two_families_is_refused():
    gemma = family_for_config({"model_type": "gemma3"})
    with pytest.raises(LogprobeError, match="is registered by the families 'gemma' and 'copy'"):
        register(Family(**{**{k: getattr(gemma, k) for k in Family.__slots__}, "name": "copy",
                           "config_class": type("CopyConfig", (), {})}))
    assert _name(family_for_config({"model_type": "gemma3"})) == "gemma"


def _family_words() -> set[str]:
    return {w for f in families() for w in (f.name, *f.model_types, *f.gguf_archs)}


def _family_classes() -> set[str]:
    """Names of every family's config class and model class (and their subclasses)."""
    roots = [f.config_class for f in families()] + [ScoringModel]
    seen: set[type] = set()
    while roots:
        cls = roots.pop()
        if cls not in seen:
            seen.add(cls)
            roots.extend(cls.__subclasses__())
    return {c.__name__ for c in seen} - {"ScoringModel"}


def _isinstance_targets(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                "issubclass"):
            if len(node.args) < 2:
                continue
            second = node.args[1]
            for t in second.elts if isinstance(second, ast.Tuple) else [second]:
                name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                if name:
                    out.append((node.lineno, name))
    return out


@pytest.mark.parametrize("module", [loader_module, update_module], ids=["loader", "update"])
def test_loader_and_update_name_no_family(module):
    text = Path(module.__file__).read_text(encoding="utf-8")
    words = _family_words()
    assert {"llama", "gemma", "gpt_oss", "qwen3_next", "deepseek2"} <= words  # the registry is the one read
    found = sorted({m.group(0).lower() for w in words
                    for m in re.finditer(rf"(?<!\w){re.escape(w)}(?!\w)", text, re.IGNORECASE)})
    assert found == [], f"{Path(module.__file__).name} names families: {found}"
    classes = _family_classes()
    assert {"GemmaConfig", "LlamaModel", "Glm4Config", "HybridModel"} <= classes
    checks = [(line, name) for line, name in _isinstance_targets(ast.parse(text)) if name in classes]
    assert checks == [], f"isinstance on a family's class: {checks}"


def test_the_source_checks_see_family_names_and_isinstance():
    """The two checks above find what they look for (the loader before the registry had both)."""
    text = "from .gemma import build_gemma\nif isinstance(cfg, (GemmaConfig, int)):\n    pass\n# Gemma 3\n"
    words = [w for w in _family_words() if re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text, re.IGNORECASE)]
    assert words == ["gemma"]
    assert _isinstance_targets(ast.parse(text)) == [(2, "GemmaConfig"), (2, "int")]


@pytest.mark.slow  # builds every family's tiny checkpoint (the slow tier: pytest -m slow)
def test_every_family_tiny_checkpoint_loads(tiny_dirs, ds_dirs, gemma_dirs, gemma4_dirs, glm4_dir,  # noqa: F811
                                            gpt_oss_dirs, sigmoid_dirs, hybrid_dirs, qwen3_vl_dirs):  # noqa: F811
    from logprobe.loading.loader import describe_model, load_model

    seen = set()
    trees = [tiny_dirs["llama"], ds_dirs, gemma_dirs, gemma4_dirs, glm4_dir, gpt_oss_dirs, sigmoid_dirs, hybrid_dirs,
             qwen3_vl_dirs]
    for path in saved_dirs(trees):
        model = load_model(str(path), device="cpu", dtype="float32").model
        family = family_of(model.config)
        assert family is not None and isinstance(model, family.model_class(model.config)), path.name
        seen.add(family.name)
    assert seen == {f.name for f in families()}
    assert family_of(describe_model(None, device="cpu").model.config).name == "llama"  # the default GGUF

"""Every native family's config gives the budget rule its shapes: on CUDA the default budget of a
native model is never the transformers backend's guess (``CUDA_UNKNOWN``; gpt-oss and Gemma 4 fell
back to it before, 4.5% slower for gpt-oss-20b than its own figure), and a config missing a field the rule reads
is an error in ``budget_for``, not a silent fallback."""

from __future__ import annotations

import pytest
from test_deepseek import ds_dirs as ds_dirs  # noqa: F401 (fixtures used by name)
from test_gemma3 import gemma_dirs as gemma_dirs  # noqa: F401
from test_gemma4 import gemma4_dirs as gemma4_dirs  # noqa: F401
from test_glm4 import glm4_dir as glm4_dir  # noqa: F401
from test_gpt_oss import dirs as gpt_oss_dirs  # noqa: F401
from test_moe_sigmoid_families import dirs as sigmoid_dirs  # noqa: F401
from test_qwen3_next import float64_reference as float64_reference  # noqa: F401
from test_qwen3_next import hybrid_dirs as hybrid_dirs  # noqa: F401

from logprobe.engine.budget import MAX_AUTO, MAX_AUTO_MOE, ranks_budget
from logprobe.loading.loader import describe_model

pytestmark = pytest.mark.slow  # builds every family's tiny checkpoint (the slow tier: pytest -m slow)
GiB = 2**30


def saved_dirs(tree):
    """Every saved checkpoint directory among the fixtures' values (dicts, tuples of dir and model)."""
    if isinstance(tree, dict):
        for v in tree.values():
            yield from saved_dirs(v)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            yield from saved_dirs(v)
    elif hasattr(tree, "is_dir") and tree.is_dir() and (tree / "config.json").exists():
        yield tree


def test_every_native_family_has_a_budget(ds_dirs, gemma_dirs, gemma4_dirs, glm4_dir, gpt_oss_dirs,  # noqa: F811
                                          sigmoid_dirs, hybrid_dirs):  # noqa: F811
    seen = {}
    for path in saved_dirs([ds_dirs, gemma_dirs, gemma4_dirs, glm4_dir, gpt_oss_dirs, sigmoid_dirs, hybrid_dirs]):
        model = describe_model(str(path), device="cpu", dtype="float32").model
        cap = MAX_AUTO_MOE if getattr(model.config, "moe", None) is not None else MAX_AUTO
        # tiny widths: 100 GiB holds far more than the cap, so every family lands on its cap
        assert ranks_budget("cuda", 100 * GiB, model.config, 2) == cap, path.name
        seen[type(model).__name__] = cap
    assert set(seen) >= {"DeepseekModel", "GemmaModel", "Gemma4Model", "Glm4Model", "Glm4MoeModel",
                         "MiniMaxM2Model", "HybridModel", "GptOssModel"}, seen

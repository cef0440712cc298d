from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # test processes side by side share the cores: one thread each
    os.environ["OMP_NUM_THREADS"] = "1"  # (and to the servers and workers they start)
    torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_scorer():
    from logprobe import Scorer

    return Scorer(progress=False, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def default_reference(default_scorer):
    """The default GGUF loaded by transformers (its own dequantizer), in float64."""
    from transformers import AutoModelForCausalLM

    path = Path(default_scorer.info.path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.double().eval()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """kind -> (directory, float64 transformers model) for each tiny random architecture."""
    from helpers import make_hf_dir

    out = {}
    for i, kind in enumerate(["llama", "llama3", "qwen2", "qwen3", "mistral", "gpt2"]):
        d = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (d, make_hf_dir(d, kind, seed=i))
    return out

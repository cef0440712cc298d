"""Deterministic mode bitwise batch-invariant at any CPU thread count, on the Gemma 3 and Gemma 4
native paths (tiny random checkpoints of tests/test_gemma3.py and tests/test_gemma4.py).

PyTorch's CPU loops cut a tensor into one flat range per thread, and a range that ends mid-SIMD
block rounds its scalar tail otherwise; where the cuts fall follows torch.get_num_threads(), so a
machine with many cores broke what two cores kept. GELU's kernel cuts its loop into exactly one
range per thread once it has more than 16,384 elements (most loops use a grain of 32,768): the
GeGLU of a pass of ~550 rows (96 wide, padded to 128) was cut into 16 ranges of 2,640 elements on
16 threads (41.25 spans of 64), and every request in the batch differed from the same request
alone. Each thread count below runs every request alone and all of them in one deterministic
pass (shared prefixes too), and asks for the same bits.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import VOCAB
from test_gemma3 import gemma_dirs as gemma_dirs  # noqa: F401 (fixtures used by name)
from test_gemma4 import gemma4_dirs as gemma4_dirs  # noqa: F401

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.loading import load_model

THREADS = (3, 12, 16)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _requests() -> list[ScoreRequest]:
    """Two groups of completions sharing a context, and two lone sequences: ~550 rows in one pass."""
    rng = random.Random(3)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for n_ctx in (30, 70):
        ctx = tok(n_ctx)
        reqs += [ScoreRequest(ctx + tok(rng.randint(1, 30)), n_ctx) for _ in range(3)]
    return reqs + [ScoreRequest(tok(150), 4), ScoreRequest(tok(6), 1)]


@pytest.mark.parametrize("family", ["gemma3_text", "gemma4_text"])
def test_deterministic_bitwise_at_every_thread_count(family, request, threads):
    dirs = request.getfixturevalue("gemma_dirs" if family == "gemma3_text" else "gemma4_dirs")
    loaded = load_model(str(dirs[family][0]), "cpu", "float32")
    reqs = _requests()
    for n in THREADS:
        threads(n)
        single = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
        alone = [single.engine.run([r])[0].logprobs for r in reqs]
        batched = Scorer(loaded, config=EngineConfig(deterministic=True, max_batch_tokens=1 << 20)).engine.run(reqs)
        differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if not torch.equal(a, b.logprobs)]
        assert not differ, f"{family} on {n} threads: requests {differ} differ from themselves alone"

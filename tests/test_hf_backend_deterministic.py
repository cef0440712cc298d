"""The transformers backend in deterministic mode: each request runs alone in its own forward (a
batch of one, no padding), so its numbers are bitwise the same alone and in any shuffled mix under
any budget; default mode (padded batches, longest first) within 1e-5; both against float64
transformers. A model that states neither context nor deterministic support is still refused."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_hf_dir, ref_logprobs
from test_determinism import BUDGETS, random_mix, same
from torch import nn

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.errors import LogprobeError
from logprobe.loading import load_model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-gpt2")
    ref = make_hf_dir(d, "gpt2", seed=5)
    return load_model(str(d), "cpu", "float32"), ref


@pytest.mark.parametrize("deterministic", [True, False])
def test_alone_equals_mixes(deterministic, gpt2):
    loaded, ref = gpt2
    assert loaded.info.backend == "transformers"
    reqs = random_mix(seed=11)
    alone_engine = Scorer(loaded, config=EngineConfig(deterministic=deterministic))
    alone = [alone_engine.engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):  # alone is right (float64 reference)
        lp = ref_logprobs(ref, r.tokens, r.temperature)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < 1e-4
    rng = random.Random(2)
    for budget in BUDGETS:
        for _ in range(1):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic)
            out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
            for i, res in zip(order, out):
                same(alone[i], res, deterministic)


def test_deterministic_forward_runs_each_request_alone(gpt2):
    """One base forward per request in deterministic mode, of exactly its tokens (no padding)."""
    loaded, _ = gpt2
    reqs = random_mix(seed=3)[:5]
    shapes: list[tuple[int, ...]] = []
    hook = loaded.model.base.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        Scorer(loaded, config=EngineConfig(deterministic=True, max_batch_tokens=1 << 20)).engine.run(reqs)
        assert sorted(shapes) == sorted((1, len(r.tokens) - 1) for r in reqs)
        shapes.clear()
        Scorer(loaded, config=EngineConfig(max_batch_tokens=1 << 20)).engine.run(reqs)
        assert shapes == [(len(reqs), max(len(r.tokens) - 1 for r in reqs))]  # default: one padded batch
    finally:
        hook.remove()


def test_a_model_without_deterministic_support_is_refused(gpt2):
    loaded, _ = gpt2

    class Bare(nn.Module):  # no caps: neither context nor deterministic
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a):
            return self.inner(*a)

        def head_params(self):
            return self.inner.head_params()

    from dataclasses import replace

    bare = replace(loaded, model=Bare(loaded.model))
    with pytest.raises(LogprobeError, match="Bare has no deterministic kernels"):
        Scorer(bare, deterministic=True).engine.run(random_mix(seed=1)[:2])

"""Sequences longer than the batch budget: chunks that see earlier chunks through a KV cache.

Every requested position is scored exactly once whatever the chunk size; results equal the
unchunked run (bitwise in deterministic mode) and the float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import ref_logprobs

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.scheduler import Chunk, plan_work
from logprobe.layers.attention import AttentionMeta, _sdpa, _tiled
from logprobe.loading import load_model

BUDGETS = [64, 100, 257, 4096]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("n", [1, 5, 64, 100, 1000])
@pytest.mark.parametrize("budget", [1, 7, 64, 257])
def test_chunks_cover_every_input_once(n, budget):
    plan = plan_work([[3] * n], budget)
    rows = [r for batch in plan for c in batch for r in range(c.begin, c.end)] \
        if n > budget else [r for r in range(n)]
    assert rows == list(range(n))
    assert all(len(batch) == 1 for batch in plan)
    assert (n > budget) == all(isinstance(b[0], Chunk) for b in plan)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return {k: load_model(str(tiny_dirs[k][0]), "cpu", "float32") for k in ("llama", "mistral")}


@pytest.mark.parametrize("kind", ["llama", "mistral"])  # mistral: a 16-token sliding window across chunks
@pytest.mark.parametrize("deterministic", [False, True])
def test_long_sequence_any_budget(kind, deterministic, loaded, tiny_dirs):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(2, 300, (1001,), generator=g).tolist()  # 1000 inputs
    reqs = [ScoreRequest(tokens, 1), ScoreRequest(tokens, 650, top_k=3, entropy=True)]
    runs = {}
    for budget in BUDGETS:
        scorer = Scorer(loaded[kind], config=EngineConfig(max_batch_tokens=budget, deterministic=deterministic))
        runs[budget] = scorer.engine.run(reqs)
        assert [len(r.logprobs) for r in runs[budget]] == [1000, 351]  # each position scored once
    lp = ref_logprobs(tiny_dirs[kind][1], tokens)  # [1001, V] float64
    want = lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    base = runs[4096]
    assert (base[0].logprobs.double() - want).abs().max() < 1e-4
    ent = -(lp[649:-1].exp() * lp[649:-1]).sum(-1)
    assert (base[1].entropy.double() - ent).abs().max() < 1e-4
    for budget in BUDGETS[:-1]:
        for a, b in zip(base, runs[budget]):
            if deterministic:
                assert torch.equal(bits(a.logprobs), bits(b.logprobs))
            else:
                assert (a.logprobs - b.logprobs).abs().max() < 1e-5
        if deterministic:
            assert torch.equal(bits(base[1].entropy), bits(runs[budget][1].entropy))
            assert torch.equal(bits(base[1].topk_logprobs), bits(runs[budget][1].topk_logprobs))
    if deterministic:  # the tail of the second request is the tail of the first, bitwise
        assert torch.equal(bits(base[0].logprobs[649:]), bits(base[1].logprobs))


def test_long_sequence_transformers_backend(tiny_dirs):
    """No KV cache there: a request over the budget runs whole, alone, and is still exact."""
    lm = load_model(str(tiny_dirs["gpt2"][0]), "cpu", "float32")
    tokens = torch.randint(2, 300, (301,)).tolist()
    out = Scorer(lm, max_batch_tokens=64, progress=False).engine.run([ScoreRequest(tokens, 1)])[0]
    lp = ref_logprobs(tiny_dirs["gpt2"][1], tokens)
    want = lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert len(out.logprobs) == 300 and (out.logprobs.double() - want).abs().max() < 1e-4


@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("context, n", [(0, 1), (0, 150), (37, 1), (37, 90), (128, 64)])
def test_tiled_kernel_matches_sdpa(window, block, context, n):
    """The deterministic kernel is the same function as SDPA (GQA, context, sliding window)."""
    g = torch.Generator().manual_seed(context + n)
    q = torch.randn(n, 6, 32, generator=g)
    k = torch.randn(context + n, 2, 32, generator=g)
    v = torch.randn(context + n, 2, 32, generator=g)
    want = _sdpa(q.double(), k.double(), v.double(), 32**-0.5, window).float()
    got = _tiled(q, k, v, 32**-0.5, window, block)
    assert (got - want).abs().max() < 1e-5
    # a query's result depends only on its own keys: the same rows, split into two segments
    # (the second seeing the first as context), are bitwise equal
    if n > 1:
        cut = n // 2
        first = _tiled(q[:cut], k[:context + cut], v[:context + cut], 32**-0.5, window, block)
        second = _tiled(q[cut:], k, v, 32**-0.5, window, block)
        assert torch.equal(bits(torch.cat([first, second])), bits(got))


@pytest.mark.slow  # slow tier (pytest -m slow): the real model chunked many ways
def test_default_model_chunked_bitwise(default_scorer, default_reference):
    """The real model: a 1000-token sequence with budgets 64, 257 and 4096, deterministic."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 49152, (1001,), generator=g).tolist()
    req = [ScoreRequest(tokens, 1)]
    out = {b: Scorer(default_scorer.loaded, config=EngineConfig(max_batch_tokens=b, deterministic=True))
           .engine.run(req)[0].logprobs for b in (64, 257, 4096)}
    assert torch.equal(bits(out[64]), bits(out[4096])) and torch.equal(bits(out[257]), bits(out[4096]))
    lp = ref_logprobs(default_reference, tokens)
    want = lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    fast = Scorer(default_scorer.loaded, config=EngineConfig(max_batch_tokens=100)).engine.run(req)[0].logprobs
    # random ids make a few extreme positions: measured max |Δ| 3.4e-4 (deterministic) and 2.4e-4
    # (fast, unchunked) at the same position, mean 4e-6 for both
    for got in (out[4096], fast):
        err = (got.double() - want).abs()
        assert err.max() < 1e-3 and err.mean() < 1e-5


def test_attention_meta_packed_matches_segments():
    assert AttentionMeta.packed([2, 0, 3]).varlen() == ([0, 2, 2, 5], [0, 2, 2, 5], [0, 1, 2, 3, 4])

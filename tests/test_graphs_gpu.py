"""CUDA graph replays of small passes (``engine.graphs``) on a GPU: bitwise the eager passes in
deterministic mode, within rounding otherwise, against float64 in float32. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_dir, random_sequences, ref_logprobs
from test_determinism import same

from logprobe import EngineConfig, Scorer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _pair(path, dtype: str, det: bool, **kw) -> tuple[Scorer, Scorer]:
    eager = Scorer(str(path), device="cuda", dtype=dtype,
                   config=EngineConfig(deterministic=det, cuda_graph_tokens=0, progress=False, **kw))
    graphed = Scorer(str(path), device="cuda", dtype=dtype, config=EngineConfig(deterministic=det, progress=False, **kw))
    assert eager.engine.graphs is None and graphed.engine.graphs is not None
    return eager, graphed


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("det", [True, False])
def test_graphs_match_eager(kind, dtype, det, tmp_path):
    ref = make_hf_dir(tmp_path, kind, seed=3)
    eager, graphed = _pair(tmp_path, dtype, det)
    seqs = random_sequences(8, seed=1)
    worst = 0.0
    for call in (seqs[:1], seqs[1:4], seqs, seqs[:1]):
        kw = dict(temperature=0.9, top_k=3, entropy=True)
        for a, b in zip(eager.logprobs(call, **kw), graphed.logprobs(call, **kw)):
            if det:
                same(a, b, exact=True)
            worst = max(worst, float((a.logprobs - b.logprobs).abs().max()))
    g = graphed.engine.graphs
    assert g.failed is None and g.replays >= 4 and g.captures >= 1
    print(f"{kind} {dtype} det={det}: graphs against eager max |Δ| {worst:.2e}, {g.captures} captures")
    assert worst < (1e-5 if dtype == "float32" else 0.1)
    if dtype == "float32":
        s = seqs[3]
        ids = s["prompt_token_ids"] + s["completion_token_ids"]
        want = ref_logprobs(ref, ids)[len(s["prompt_token_ids"]) - 1:-1].gather(
            1, torch.tensor(s["completion_token_ids"])[:, None])[:, 0]
        assert float((graphed.logprobs([s])[0].logprobs.double() - want).abs().max()) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_and_chunks(dtype, tmp_path):
    """Requests resumed from the prefix cache, shared prefixes and chunks over a KV cache: graphs
    bitwise eager in deterministic mode."""
    make_hf_dir(tmp_path, "llama", seed=4)
    prompt = list(range(2, 60))
    seqs = [{"prompt_token_ids": prompt, "completion_token_ids": [5 + i, 9, 7 + i, 3]} for i in range(6)]
    long = {"prompt_token_ids": list(range(3, 200)), "completion_token_ids": [4, 5, 6]}
    for kw in (dict(max_batch_tokens=64), {}):
        eager = Scorer(str(tmp_path), device="cuda", dtype=dtype, prefix_cache=True,
                       config=EngineConfig(deterministic=True, cuda_graph_tokens=0, progress=False, **kw))
        graphed = Scorer(str(tmp_path), device="cuda", dtype=dtype, prefix_cache=True,
                         config=EngineConfig(deterministic=True, progress=False, **kw))
        for call in (seqs[:1], seqs[1:], [long], seqs, [long]):
            for a, b in zip(eager.logprobs(call), graphed.logprobs(call)):
                same(a, b, exact=True)
        assert graphed.engine.graphs.replays > 0 and graphed.engine.graphs.failed is None


def test_weights_updated_in_place(tmp_path):
    """update_weights copies in place: the graphs stay and score the new weights (bitwise a fresh
    eager scorer's on them)."""
    make_hf_dir(tmp_path / "a", "llama", seed=5)
    make_hf_dir(tmp_path / "b", "llama", seed=6)
    from safetensors.torch import load_file

    new = load_file(str(tmp_path / "b" / "model.safetensors"))
    seqs = random_sequences(3, seed=2)
    graphed = Scorer(str(tmp_path / "a"), device="cuda", dtype="bfloat16", progress=False, deterministic=True)
    graphed.logprobs(seqs)
    captures = graphed.engine.graphs.captures
    graphed.update_weights(new)
    after = graphed.logprobs(seqs)
    assert graphed.engine.graphs.captures == captures  # kept
    fresh = Scorer(str(tmp_path / "b"), device="cuda", dtype="bfloat16",
                   config=EngineConfig(deterministic=True, cuda_graph_tokens=0, progress=False))
    for a, b in zip(fresh.logprobs(seqs), after):
        same(a, b, exact=True)


from test_graphs import (  # noqa: E402 (the family fixtures, used by name)
    ds_dirs,  # noqa: F401
    family_dirs,
    float64_reference,  # noqa: F401
    hybrid_dirs,  # noqa: F401
    family_requests,
    gemma4_dirs,  # noqa: F401
    gemma_dirs,  # noqa: F401
    glm4_dir,  # noqa: F401
    gpt_oss_dirs,  # noqa: F401
    moe_dirs,  # noqa: F401
    sigmoid_dirs,  # noqa: F401
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_family_on_cuda(request, dtype):
    """Every native family's tiny checkpoint on CUDA: captured (mixtures of experts included: their
    fused expert kernels read nothing on the host), deterministic replays bitwise the eager passes,
    default float32 within 1e-5 of them."""
    import warnings

    from logprobe.loading import load_model

    reqs = family_requests()
    seen, failures = {}, []
    for label, path in family_dirs(request):
        loaded = load_model(str(path), "cuda", dtype)
        for det in (True, False):
            eager = Scorer(loaded, config=EngineConfig(deterministic=det, cuda_graph_tokens=0, progress=False))
            graphed = Scorer(loaded, config=EngineConfig(deterministic=det, progress=False))
            want = eager.engine.run(reqs)
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                got = graphed.engine.run(reqs)
            gap = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(want, got))
            g = graphed.engine.graphs
            how = "no runner" if g is None else "replayed" if g.failed is None and g.replays else f"eager ({g.failed})"
            seen[f"{label} det={det}"] = (how, f"{gap:.1e}")
            if (det and gap != 0) or (dtype == "float32" and gap > 1e-5) or how != "replayed":
                failures.append((label, det, gap, how))
    for k, v in seen.items():
        print(dtype, k, *v)
    assert not failures, failures


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe"])
def test_hybrids_on_cuda(hybrid_dirs, kind):
    """The hybrids' linear-attention core cut out of the graphs (fla-core's kernels between
    replays): deterministic bitwise eager, also over chunks and cached states; float32 default
    within 1e-5 of eager."""
    path = hybrid_dirs[kind][0]
    prompt = list(range(2, 130))
    seqs = [{"prompt_token_ids": prompt, "completion_token_ids": [5 + i, 9, 7 + i]} for i in range(3)]
    seqs += random_sequences(3, seed=4)
    long = {"prompt_token_ids": list(range(3, 200)), "completion_token_ids": [4, 5, 6]}
    for det, kw in ((True, dict(max_batch_tokens=64)), (True, {}), (False, {})):
        eager = Scorer(str(path), device="cuda", dtype="float32", prefix_cache=True,
                       config=EngineConfig(deterministic=det, cuda_graph_tokens=0, progress=False, **kw))
        graphed = Scorer(str(path), device="cuda", dtype="float32", prefix_cache=True,
                         config=EngineConfig(deterministic=det, progress=False, **kw))
        worst = 0.0
        for call in (seqs[:1], seqs[1:], [long], seqs):
            for a, b in zip(eager.logprobs(call), graphed.logprobs(call)):
                if det:
                    same(a, b, exact=True)
                worst = max(worst, float((a.logprobs - b.logprobs).abs().max()))
        g = graphed.engine.graphs
        print(kind, det, kw, f"max |Δ| {worst:.1e}", g.captures, g.failed)
        assert g.failed is None and g.replays > 0 and worst < 1e-5

"""The same library on a GPU: float32 matches float64 tightly, bf16 loosely. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_dir, random_sequences, ref_logprobs

from logprobe import Scorer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 0.25)])
def test_cuda_matches_reference(kind, dtype, tol, tmp_path):
    ref = make_hf_dir(tmp_path, kind, seed=5)
    scorer = Scorer(str(tmp_path), device="cuda", dtype=dtype, progress=False)
    assert scorer.info.device.startswith("cuda") and scorer.info.dtype == dtype
    seqs = random_sequences(4, seed=9)
    out = scorer.logprobs(seqs, temperature=0.9, top_k=3, entropy=True)
    worst = 0.0
    for s, r in zip(seqs, out):
        ids = s["prompt_token_ids"] + s["completion_token_ids"]
        rows = ref_logprobs(ref, ids, 0.9)[len(s["prompt_token_ids"]) - 1:-1]
        tgt = rows.gather(1, torch.tensor(s["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, float((r.logprobs.double() - tgt).abs().max()))
        assert r.logprobs.device.type == "cpu" and r.entropy is not None
    print(f"{kind} {dtype}: max |Δ logprob| = {worst:.2e}")
    assert worst < tol


def test_cuda_capture_and_steering_match_cpu(tmp_path):
    """Hooks on the GPU (flash attention path, float32) agree with the CPU run of the same weights."""
    make_hf_dir(tmp_path, "llama", seed=6)
    cpu = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False)
    gpu = Scorer(str(tmp_path), device="cuda", dtype="float32", progress=False)
    seqs = random_sequences(4, seed=3)
    v = torch.randn(64)
    kw = dict(capture=[{"at": "blocks.*.resid_post", "positions": "all", "reduce": "mean"},
                       {"at": "final_norm", "positions": "last"}],
              steer=[{"at": "blocks.0.mlp_out", "vector": v, "coeff": 2.0, "op": "add"},
                     {"at": "blocks.1.resid_pre", "vector": v, "coeff": 0.5, "op": "project_out"}])
    for a, b in zip(cpu.logprobs(seqs, **kw), gpu.logprobs(seqs, **kw)):
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
        for x, y in zip(a.captures, b.captures):
            assert x.positions == y.positions and y.value.device.type == "cpu"
            torch.testing.assert_close(y.value, x.value, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("matmul", ["cublas", "triton"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_deterministic_is_bitwise_batch_invariant(dtype, matmul, tmp_path):
    """Deterministic mode on CUDA (fixed-shape cuBLAS row tiles or the Triton matmul, Triton
    RMSNorm, varlen FlashAttention in bf16, the fused head with fixed vocabulary splits): each
    request's numbers are bitwise the same alone, among others in any order, chunked under small
    budgets, prefix-shared or not."""
    import random

    import transformers as tf
    from test_determinism import random_mix, same

    from logprobe.config import Deterministic, EngineConfig
    from logprobe.loading import load_model

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=20000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.05, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    from helpers import byte_tokenizer

    byte_tokenizer()[0].save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), "cuda", dtype)
    reqs = random_mix(seed=3, vocab=20000)
    # a small CUDA row tile, so that the requests span several tiles and padded tails
    det = dict(deterministic=Deterministic(matmul=matmul, cuda_tile=64))
    alone_engine = Scorer(loaded, config=EngineConfig(share_prefixes=False, **det))
    alone = [alone_engine.engine.run([r])[0] for r in reqs]
    rng = random.Random(2)
    for budget in (64, 100, 257, 1 << 20):
        for share in (True, False):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            engine = Scorer(loaded, config=EngineConfig(max_batch_tokens=budget, share_prefixes=share,
                                                        **det)).engine
            for i, res in zip(order, engine.run([reqs[i] for i in order])):
                same(alone[i], res, True)
    plain = Scorer(loaded, config=EngineConfig(share_prefixes=False)).engine.run(reqs)
    worst = max(float((a.logprobs - p.logprobs).abs().max()) for a, p in zip(alone, plain))
    print(f"{dtype}: deterministic vs default max |Δ logprob| = {worst:.2e}")
    assert worst < (0.1 if dtype == "bfloat16" else 1e-3)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_packed_resumes_match_uncached(dtype, deterministic, tmp_path):
    """The prefix cache on CUDA: requests resumed from cached prefixes of different lengths run in
    one pass (one KV cache holding every prefix; varlen FlashAttention, and cuDNN for a segment of
    ``LONG_ROWS`` rows or more in default mode, reading each segment's own context span); bitwise
    their uncached selves in deterministic mode, within rounding otherwise."""
    import random

    from test_determinism import same
    from test_prefix_cache import resumed_calls

    from logprobe.config import EngineConfig
    from logprobe.engine.request import ScoreRequest
    from logprobe.layers.attention_gpu import LONG_ROWS

    make_hf_dir(tmp_path, "llama", seed=3)
    cfg = EngineConfig(max_batch_tokens=1 << 14, deterministic=deterministic)
    plain = Scorer(str(tmp_path), device="cuda", dtype=dtype, config=cfg)
    cached = Scorer(plain.loaded, config=cfg, prefix_cache=1 << 28)
    first, second = resumed_calls(seed=1)
    rng = random.Random(5)
    if not deterministic:  # a long segment after a cached prefix: the cuDNN path
        second = second + [ScoreRequest(first[0].tokens[:70] + [rng.randrange(2, 300) for _ in range(LONG_ROWS + 8)], 70)]
    cached.engine.run(first)
    rows: list[int] = []
    cached.engine.fault_hook = lambda n, _t: rows.append(n)
    want, got = plain.engine.run(second), cached.engine.run(second)
    assert len(rows) == 1 and all(g.cached_tokens > 0 for g in got)
    tol = 0.0 if deterministic else (0.05 if dtype == "bfloat16" else 1e-4)
    for w, g in zip(want, got):
        if deterministic:
            same(w, g, True)
        else:
            assert float((w.logprobs - g.logprobs).abs().max()) <= tol


def _compiled(kernel) -> int:
    """Compiled variants of a Triton kernel in this process (``JITFunction.device_caches``)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_row_counts_compile_one_kernel_each():
    """A batch's row count (1, a multiple of 16, any other) is not a specialization: a server's
    steps of every size reuse the kernel the first step compiled, no compile mid-run."""
    from logprobe.kernels import logprob_head, rmsnorm

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    gain = torch.ones(96, device="cuda", dtype=torch.bfloat16)
    counts = []
    for rows in (17, 1, 16, 33, 64):
        h = torch.randn(rows, 96, device="cuda", dtype=torch.bfloat16, generator=g)
        rmsnorm.invariant_rmsnorm(h, gain, 1e-6)
        y = torch.randint(0, 1000, (rows,), device="cuda", generator=g)
        logprob_head.fused_logprob_head(h, w, y, torch.ones(rows, device="cuda"))
        counts.append((_compiled(rmsnorm._rmsnorm), _compiled(logprob_head._head_partials)))
    assert min(counts[0]) > 0 and len(set(counts)) == 1, counts  # 1 and 16 rows would be variants of 17's

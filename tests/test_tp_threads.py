"""Deterministic mode's TP invariance, with tensor parallelism emulated in threads on one device
(``tp_threads``: the real rank models, loader cuts and engines; collectives through memory):
every hook point of every block and the log-probs of rank 0 at (TP, EP) = (2, 1), (2, 2), (4, 4) are
TP = 1's bits, and a difference is reported at the first point it reaches (embed, then each
block's attn_out, mlp_out, resid_post, then the log-probs), and at the first step inside
attention where the ranks' heads side by side leave TP = 1's (q / k into and out of their
per-head norms, rotated q / k, the attention output: ``tp_threads.trace_attention``).

On CPU (float32, tiny Qwen3-MoE and Llama configs) this checks the emulation against what the
gloo workers already guarantee; on one GPU (``-m gpu``, bf16, the Qwen3-30B-A3B shape with two
layers: q/k norms per head, 4 kv heads, 128 experts top-8) it is the two-GPU diagnosis without
the second GPU: on 2 x H200 ``blocks.0.attn_out`` of a 292-token request once left TP = 1's bits
(the Llama-3-8B shape, bitwise on two GPUs, is the control)."""

from __future__ import annotations

import pytest
import torch
from tp_threads import first_head_step, random_state, rank_models, run_ranks, trace_attention

from logprobe.config import EngineConfig
from logprobe.engine.request import CaptureAt, ScoreRequest
from logprobe.loading.hf import native_config

PARTS = ("attn_out", "mlp_out", "resid_post")
TINY = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16, intermediate_size=96,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048),
    "llama": dict(model_type="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=1e4,
                  max_position_embeddings=2048),
}
GPU_SHAPES = {  # two layers each; on CUDA deterministic mode keeps experts whole per rank (EP = TP)
    "qwen3-30b-a3b": (dict(TINY["qwen3_moe"], vocab_size=151936, hidden_size=2048, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                           num_experts=128, num_experts_per_tok=8), [(2, 2), (4, 4)]),
    "llama-8b": (dict(TINY["llama"], vocab_size=128256, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336), [(2, 1), (4, 1)]),
}


def _requests(cfg, lengths: list[int], seed: int = 5) -> list[ScoreRequest]:
    """One request per length, every block's points captured at every position."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, min(cfg.vocab_size, 256), (n,), generator=gen).tolist()
        points = ["embed"] + [f"blocks.{i}.{p}" for i in range(cfg.num_layers) for p in PARTS]
        out.append(ScoreRequest(tokens, 1, capture=tuple(CaptureAt(p, tuple(range(n)), "rows") for p in points)))
    return out


def first_difference(want, got, requests) -> str | None:
    """The first point (forward order; log-probs last) where ``got`` leaves ``want``'s bits."""
    for i, (a, b, r) in enumerate(zip(want, got, requests)):
        for c, x, y in zip(r.capture, a.captures, b.captures):
            if not torch.equal(x, y):
                rows = (x != y).any(-1).nonzero().flatten().tolist()
                return (f"request {i} ({len(r.tokens)} tokens): {c.point} (max |d| {(x - y).abs().max().item():.2e}, "
                        f"{len(rows)} rows: {rows[:8]})")
        if not torch.equal(a.logprobs, b.logprobs):
            return f"request {i}: log-probs (max |d| {(a.logprobs - b.logprobs).abs().max().item():.2e})"
    return None


def _check(raw: dict, device: str, dtype: torch.dtype, lengths: list[int], sizes) -> None:
    cfg, why = native_config(raw)
    assert cfg is not None, why
    state = random_state(cfg, device)
    config = EngineConfig(deterministic=True, max_batch_tokens=4096, progress=False)
    requests = _requests(cfg, lengths)
    one = rank_models(cfg, state, 1, 1, device, dtype)
    with trace_attention(one) as steps:
        want = run_ranks(one, requests, config)
        one_steps = steps(0)
    for size, experts in sizes:
        models = rank_models(cfg, state, size, experts, device, dtype)
        with trace_attention(models) as steps:
            got = run_ranks(models, requests, config)
            inside = first_head_step(one_steps, [steps(r) for r in range(size)])
        where = first_difference(want, got, requests)
        assert where is None and inside is None, \
            f"TP={size} EP={experts}: first not bitwise at {where}; inside attention: {inside}"
        del models


@pytest.mark.parametrize("family", list(TINY))
def test_threads_tp_is_bitwise_tp1_on_cpu(family):
    sizes = [(2, 1), (2, 2), (4, 4)] if family == "qwen3_moe" else [(2, 1)]
    _check(TINY[family], "cpu", torch.float32, [37, 70], sizes)


def test_first_difference_names_the_first_point():
    """The report can fail, and names the earliest point: a changed attn_out of block 1 and
    changed log-probs are reported as block 1's attn_out."""
    from logprobe.engine.request import RequestResult

    req = ScoreRequest([5, 6, 7], 1, capture=(CaptureAt("embed", (0, 1), "rows"),
                                               CaptureAt("blocks.1.attn_out", (0, 1), "rows")))
    same = torch.zeros(2, 4)
    a = RequestResult(torch.zeros(2), torch.zeros(2, dtype=torch.long), captures=[same, same])
    b = RequestResult(torch.ones(2), torch.zeros(2, dtype=torch.long), captures=[same, same + 1e-3])
    assert first_difference([a], [a], [req]) is None
    assert "blocks.1.attn_out" in first_difference([a], [b], [req])


def test_trace_sets_each_rank_heads_beside_one_process():
    """The attention trace records every step per head (a Qwen3 block: q / k norms in and out,
    rotated q / k, attention) and names a step where one rank's heads change."""
    cfg, _ = native_config(TINY["qwen3_moe"])
    state, requests = random_state(cfg, "cpu"), _requests(cfg, [37])
    config = EngineConfig(deterministic=True, max_batch_tokens=4096, progress=False)
    traced = []
    for size in (1, 2):
        models = rank_models(cfg, state, size, size, "cpu", torch.float32)
        with trace_attention(models) as steps:
            run_ranks(models, requests, config)
            traced.append([steps(r) for r in range(size)])
    (one,), ranks = traced
    assert [n for n, _ in one[:7]] == ["q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "q_rotated",
                                       "k_rotated", "attention"]
    assert len(one) == 7 * cfg.num_layers and ranks[1][3][1].shape == (37, 2, 16)
    assert first_head_step(one, ranks) is None
    ranks[1][3] = ("k_norm_out", ranks[1][3][1] + 1e-3)
    assert first_head_step(one, ranks).startswith("call 3: k_norm_out (max |d| 1.00e-03, 74 (row, head) pairs: "
                                                  "[[0, 2], [0, 3], [1, 2], [1, 3]]")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_threads_tp_is_bitwise_tp1_on_one_gpu(shape):
    raw, sizes = GPU_SHAPES[shape]
    _check(raw, "cuda", torch.bfloat16, [292, 210, 122, 1000], sizes)

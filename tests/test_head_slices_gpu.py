"""Deterministic mode's CUDA ops give a head's (or a column's) bits whatever else the call holds:
the other heads a tensor-parallel rank does not hold, the other sequences of the batch. One GPU
stands in for TP = 2 by running the first half of the heads (and of the kv heads) alone; these
are the ops between a block's input and its ``attn_out`` on a Qwen3-MoE shape (32 query heads,
4 kv heads, head_dim 128, hidden 2048, q/k norms), where two GPUs once found ``attn_out`` not
bitwise TP = 1 on a single 292-token request."""

from __future__ import annotations

import pytest
import torch

from logprobe.kernels import triton_available
from logprobe.kernels.matmul import invariant_linear
from logprobe.kernels.rmsnorm import invariant_rmsnorm
from logprobe.layers.attention_gpu import flash_varlen_attention
from logprobe.layers.rotary import apply_rotary

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA")]

HQ, HKV, D, HID = 32, 4, 128, 2048


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    make = lambda h: torch.randn(n, h, D, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    return make(HQ), make(HKV), make(HKV)


@pytest.mark.parametrize("n", [1, 17, 210, 292, 1000])
def test_attention_head_half_is_bitwise(n):
    q, k, v = _qkv(n, n)
    cu = [0, n]
    whole = flash_varlen_attention(q, k, v, cu, cu, D ** -0.5)
    half = flash_varlen_attention(q[:, :HQ // 2].contiguous(), k[:, :HKV // 2].contiguous(),
                                  v[:, :HKV // 2].contiguous(), cu, cu, D ** -0.5)
    assert whole is not None and half is not None
    d = (whole[:, :HQ // 2].float() - half.float()).abs().max().item()
    assert torch.equal(whole[:, :HQ // 2], half), f"{n} tokens: max |d| {d:.3e}"


@pytest.mark.parametrize("n", [17, 292])
def test_attention_alone_equals_in_a_batch(n):
    q, k, v = _qkv(n, 7)
    others = _qkv(3000, 8)
    alone = flash_varlen_attention(q, k, v, [0, n], [0, n], D ** -0.5)
    qb, kb, vb = (torch.cat([a, b]) for a, b in zip((q, k, v), others))
    cu = [0, n, n + 3000]
    batch = flash_varlen_attention(qb, kb, vb, cu, cu, D ** -0.5)
    d = (alone.float() - batch[:n].float()).abs().max().item()
    assert torch.equal(alone, batch[:n]), f"max |d| {d:.3e}"


def test_norm_rotary_and_matmul_head_half_are_bitwise():
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(292, HID, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(HQ * D, HID, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    q = invariant_linear(x, w)  # [T, HQ * D]
    q_half = invariant_linear(x, w[: HQ * D // 2].contiguous())
    assert torch.equal(q[:, : HQ * D // 2], q_half)
    qh = q.view(292, HQ, D)
    nw = torch.rand(D, generator=g, device="cuda").to(torch.bfloat16) + 0.5
    normed = invariant_rmsnorm(qh, nw, 1e-6)
    assert torch.equal(normed[:, : HQ // 2], invariant_rmsnorm(qh[:, : HQ // 2], nw, 1e-6))
    cis = torch.polar(torch.ones(292, D // 2, device="cuda"), torch.rand(292, D // 2, generator=g, device="cuda"))
    rot = apply_rotary(normed, cis, True)
    assert torch.equal(rot[:, : HQ // 2], apply_rotary(normed[:, : HQ // 2], cis, True))
    o = (torch.randn(HID, HQ * D, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    y = invariant_linear(rot.reshape(292, -1), o)
    assert torch.equal(y[:, : HID // 2], invariant_linear(rot.reshape(292, -1), o[: HID // 2].contiguous()))


@pytest.mark.parametrize("vocab", [151936, 128256, 102400])
def test_head_two_shards_combine_to_one_rank_bitwise(vocab):
    """The deterministic head as two TP ranks run it (each its vocabulary shard of the fixed grid,
    the target logit's max across ranks, the partials side by side in rank order) against one
    rank: bitwise. Vocabularies of Qwen3 (19 grid chunks), Llama 3 (16) and DeepSeek-V2 (13)."""
    from logprobe.layers.logprob_head import (
        HeadParams,
        _kernel_partials,
        _target_logits,
        combine_head_partials,
        logprob_head,
    )
    from logprobe.parallel.shard import vocab_chunk_width, vocab_shard

    g = torch.Generator("cuda").manual_seed(vocab)
    N = 300
    w = (torch.randn(vocab, HID, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    h = torch.randn(N, HID, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.randint(0, vocab, (N,), generator=g, device="cuda")
    one = logprob_head(h, HeadParams(w), y, deterministic=True).logprobs
    inv_t = torch.ones(N, device="cuda")
    grid = vocab_chunk_width(vocab)
    shards = [HeadParams(w[a:b].contiguous(), vocab_start=a, vocab_total=vocab)
              for a, b in (vocab_shard(vocab, grid, r, 2) for r in range(2))]
    zy = torch.maximum(*[_target_logits(h, p, y, inv_t, 512, True, True) for p in shards])
    parts = [_kernel_partials(h, p, y, zy, inv_t, 0, False, p.grid_width) for p in shards]  # the grid's splits
    joined = [None if a is None else torch.cat([a, b]) for a, b in zip(*parts)]
    two = combine_head_partials(zy, *joined, top_k=0, deterministic=True)[0]
    d = (one - two).abs().max().item()
    assert torch.equal(one, two), f"vocab {vocab}: max |d| {d:.3e}"


@pytest.mark.parametrize("heads", [2, 4, 8, 32])
def test_rotary_head_half_is_bitwise(heads):
    """The rotary kernel at each head count a rank may hold: its first half of the heads rotated
    alone equals the same heads rotated with the rest. Once found differing (1 ulp, 8 of 1,168
    (row, head) pairs) for Qwen3-MoE's 4 kv heads against 2: the compiler chose which product to
    fuse into the add by block size, which the kernel's explicit FMAs now pin."""
    from logprobe.layers.rotary import RotaryEmbedding

    g = torch.Generator("cuda").manual_seed(heads)
    T = 1000
    x = torch.randn(T, heads, D, generator=g, device="cuda").to(torch.bfloat16)
    cis = RotaryEmbedding(D, 1_000_000.0).to("cuda")(torch.arange(T, device="cuda") % 600)
    whole = apply_rotary(x, cis, True)
    half = apply_rotary(x[:, : heads // 2].contiguous(), cis, True)
    d = (whole[:, : heads // 2].float() - half.float()).abs().max().item()
    assert torch.equal(whole[:, : heads // 2], half), f"{heads} heads: max |d| {d:.3e}"

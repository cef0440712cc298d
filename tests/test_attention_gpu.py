"""Varlen FlashAttention (layers/attention_gpu.py) against the portable per-segment SDPA path,
on plain packed batches and on the shapes prefix trees and chunk caches make (context spans)."""

from __future__ import annotations

import pytest
import torch

from logprobe.layers import attention
from logprobe.layers.attention import AttentionMeta, KVCache, Segment
from logprobe.layers.attention_gpu import flash_varlen_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_not_applicable_returns_none():
    q = torch.randn(5, 4, 16)
    assert flash_varlen_attention(q, q[:, :2], q[:, :2], [0, 5], [0, 5], 0.25) is None  # CPU: portable path


def _portable(q, k, v, meta, scale, window):
    """The CPU float32 reference: packed_attention with the GPU path out of the way."""
    return attention.packed_attention(q, k, v, meta, 0, scale, window)


@cuda
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_matches_portable(window, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 37, 300, 5, 128]
    T, Hq, Hkv, D = sum(lengths), 8, 2, 64
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    ref = _portable(q, k, v, AttentionMeta.packed(lengths), D**-0.5, window)
    out = attention.packed_attention(*(x.to("cuda", dtype) for x in (q, k, v)), AttentionMeta.packed(lengths), 0,
                                     D**-0.5, window)
    assert out.shape == (T, Hq, D)
    err = (out.float().cpu() - ref).abs().max().item()
    assert err < 2e-2, err


@cuda
@pytest.mark.parametrize("window", [None, 8])
def test_flash_tree_and_cache_match_portable(window):
    """A prefix (rows 0:40) with two branches seeing it, and a chunk that sees 50 cached rows."""
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D = 4, 2, 64
    tree = AttentionMeta([Segment(0, 40), Segment(40, 57, ((0, 40),)), Segment(57, 60, ((0, 40),))])
    q, k, v = (torch.randn(60, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    ref = _portable(q, k, v, tree, D**-0.5, window)
    gpu_tree = AttentionMeta(list(tree.segments))
    out = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), gpu_tree, 0, D**-0.5, window)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2

    past_k, past_v = (torch.randn(50, Hkv, D, generator=g) for _ in range(2))
    q, k, v = (torch.randn(30, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    cpu_cache = KVCache([past_k], [past_v])
    ref = _portable(q, k, v, AttentionMeta([Segment(0, 30, ((0, 50),))], cache=cpu_cache, past=50), D**-0.5, window)
    gpu_cache = KVCache([past_k.to("cuda", torch.bfloat16)], [past_v.to("cuda", torch.bfloat16)])
    meta = AttentionMeta([Segment(0, 30, ((0, 50),))], cache=gpu_cache, past=50)
    out = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), meta, 0, D**-0.5, window)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2


def _dense64(q, k, v, causal, scale):
    """Float64 attention of one sequence, top-left causal, with its log-sum-exp: the ``dense``
    contract of ``causal_tail_attention``, computed independently."""
    s = torch.einsum("nhd,mhd->hnm", q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    if causal:
        n, m = s.shape[1:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, n]
    o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
    return o, lse.t()


@pytest.mark.parametrize("n,m", [(5, 5), (3, 11), (1, 4), (7, 8)])
def test_causal_tail_split_equals_bottom_right(n, m):
    """Split in two (the m - n earlier keys in full, the n own keys causally) and merged by the
    log-sum-exps, against one float64 bottom-right causal softmax over all m keys."""
    from logprobe.layers.attention_gpu import causal_tail_attention

    g = torch.Generator().manual_seed(n * 100 + m)
    q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(m, 2, 8, generator=g), torch.randn(m, 2, 8, generator=g)
    out = causal_tail_attention(q.double(), k.double(), v.double(), lambda a, b, c, causal: _dense64(a, b, c, causal, 0.3))
    s = torch.einsum("nhd,mhd->hnm", q.double(), k.double().repeat_interleave(2, 1)) * 0.3
    visible = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]  # query i sees keys 0 .. m - n + i
    ref = torch.einsum("hnm,mhd->nhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1),
                       v.double().repeat_interleave(2, 1))
    assert (out - ref).abs().max().item() < 1e-12
    # a wrong alignment (top-left over all m keys) is far from it: the test can fail
    wrong = _dense64(q, k, v, True, 0.3)[0]
    assert m == n or (wrong - ref).abs().max().item() > 1e-3


def test_segment_keys_slices_a_chunk_and_gathers_a_branch():
    x = torch.arange(10.0)[:, None, None]  # key source rows 0..9
    chunk = attention._segment_keys(x, Segment(0, 4, ((0, 6),)), past=6)  # 6 cached rows, then its own 4
    assert chunk.data_ptr() == x.data_ptr() and chunk.shape[0] == 10
    branch = attention._segment_keys(x, Segment(7, 9, ((0, 3),)), past=0)  # a prefix 0:3, own rows 7:9
    assert branch.flatten().tolist() == [0, 1, 2, 7, 8]


def test_flash_plan_once_per_batch_and_key_source_uncopied(monkeypatch):
    """``_flash`` (run here on CPU tensors, the kernel replaced by a recorder): cu_q / cu_k reach the
    device once per batch (each build is a host-to-device copy that waits for the stream), not once
    per layer; a sequence over its cached rows (a chunk, a resumed request) passes the key source
    as it is, no gather; keys that do not follow each other are gathered."""
    seen = []
    monkeypatch.setattr(attention, "flash_varlen_attention",
                        lambda q, k, v, cu_q, cu_k, *a, cu=None, **kw: seen.append((k, cu_q, cu_k, cu)) or q)
    q, k = torch.randn(3, 2, 8), torch.randn(8, 2, 8)  # 5 cached rows, then 3 new
    meta = AttentionMeta([Segment(0, 3, ((0, 5),))], past=5)
    for _layer in range(2):
        attention._flash(q, k, k, meta, 0.5, None)
    (k0, cq, ck, cu0), (k1, _, _, cu1) = seen
    assert k0 is k and k1 is k and cq == [0, 3] and ck == [0, 8]
    assert cu0 is cu1 and [c.tolist() for c in cu0] == [[0, 3], [0, 8]]
    seen.clear()
    tree = AttentionMeta([Segment(0, 3), Segment(3, 5, ((0, 3),)), Segment(5, 8, ((0, 3),))])  # a prefix, 2 branches
    attention._flash(k, k, k, tree, 0.5, None)
    assert seen[0][0][:, 0, 0].tolist() == k[[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7], 0, 0].tolist()


def test_varlen_plan_agrees_with_varlen_index():
    """``varlen_plan`` (runs of key-source rows, a slice when one) gives the keys ``varlen_index``
    lists, on random segments and context spans (empty segments and spans included)."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        past, at, segs = rng.randint(0, 20), 0, []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(0, 5)
            ctx = []
            for _ in range(rng.randint(0, 3)):
                a = rng.randint(0, past + at + 3)
                ctx.append((a, a + rng.randint(0, 4)))
            segs.append(Segment(at, at + n, tuple(ctx)))
            at += n
        meta = AttentionMeta(segs, past=past)
        cu_q, cu_k, keys, _ = attention.varlen_plan(meta, past + at, torch.device("cpu"))
        got = keys.tolist() if isinstance(keys, torch.Tensor) else list(range(*keys))
        assert (cu_q, cu_k, got) == meta.varlen()


def test_portable_path_reads_a_resumed_segments_keys_uncopied(monkeypatch):
    """The portable path hands SDPA the key source's rows as they are when a segment's context and
    own rows follow each other there (a chunk or a resumed request over its cache)."""
    seen = []
    real = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda q, k, v, *a: seen.append(k) or real(q, k, v, *a))
    cache = KVCache([torch.randn(5, 2, 8)], [torch.randn(5, 2, 8)])
    q, k = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    attention.packed_attention(q, k, k, AttentionMeta([Segment(0, 3, ((0, 5),))], cache=cache, past=5), 0, 0.5)
    assert seen[0].data_ptr() == cache.keys[0].data_ptr() and seen[0].shape[0] == 8


@cuda
@pytest.mark.parametrize("long_rows", [None, 64])
def test_long_segments_on_cudnn_match_portable(monkeypatch, long_rows):
    """Default mode: segments of LONG_ROWS rows or more go to cuDNN (split at the cache / prefix
    boundary), the rest to FlashAttention; the whole against the float32 portable path. With
    long_rows = 64 the threshold falls between the batch's segments (a mixed batch)."""
    if long_rows is not None:
        monkeypatch.setattr(attention, "LONG_ROWS", long_rows)
    g = torch.Generator().manual_seed(2)
    Hq, Hkv, D = 8, 2, 128
    n = 4200 if long_rows is None else 300
    segs = [Segment(0, n, ((0, 700),)), Segment(n, n + 40, ((0, 100),)), Segment(n + 40, n + 50)]
    past_k, past_v = (torch.randn(700, Hkv, D, generator=g) for _ in range(2))
    q, k, v = (torch.randn(n + 50, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    ref = _portable(q, k, v, AttentionMeta(segs, cache=KVCache([past_k], [past_v]), past=700), D**-0.5, None)
    cache = KVCache([past_k.to("cuda", torch.bfloat16)], [past_v.to("cuda", torch.bfloat16)])
    meta = AttentionMeta(list(segs), cache=cache, past=700)
    out = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), meta, 0, D**-0.5)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2
    det = AttentionMeta(list(segs), cache=KVCache([past_k.to("cuda", torch.bfloat16)],
                                                  [past_v.to("cuda", torch.bfloat16)]), past=700, kv_block=64)
    flash = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), det, 0, D**-0.5)
    assert (flash.float().cpu() - ref).abs().max().item() < 2e-2

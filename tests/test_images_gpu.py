"""Text given images on CUDA beyond Qwen3.5 (whose CUDA test is in tests/test_qwen3_5_images.py).
Gemma's bidirectional image spans on CUDA: the spans' rows in one non-causal varlen
FlashAttention call (``attention._gpu_spans``) against the float64 dense mask, and Gemma 3 / 4
scored given images on CUDA against transformers' float64 forward (the CPU tests of the same
models are tests/test_gemma3_images.py and tests/test_gemma4_images.py)."""

from __future__ import annotations

import pytest
import torch
from test_gemma3_images import _dense_reference
from test_gemma3_images import _reference as _reference3
from test_gemma3_images import _sequences as _sequences3
from test_gemma3_images import gemma_vl as gemma_vl  # noqa: F401 (fixtures used by name)
from test_gemma4_images import _reference as _reference4
from test_gemma4_images import _sequences as _sequences4
from test_gemma4_images import gemma4_vl as gemma4_vl  # noqa: F401
from test_qwen3_vl import _reference as _reference_vl
from test_qwen3_vl import _sequences as _sequences_vl
from test_qwen3_vl import vl_dirs as vl_dirs  # noqa: F401

from logprobe import Scorer
from logprobe.layers import attention
from logprobe.layers.attention import AttentionMeta, Segment, packed_attention, span_plan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_span_plan_gold_table():
    """Each span's query rows and its segment's first e keys (context runs, then own rows) in the
    key source, over a cache of 4 rows: segment 0 (own rows 0..5 of the batch, keys 4..9) with a
    span at key indices 1..2; segment 1 (context cache rows 0..3, own rows 6..9 = keys 10..13)
    with spans at key indices 4..5 and 7."""
    segs = [Segment(0, 6, (), ((1, 3),)), Segment(6, 10, ((0, 4),), ((4, 6), (7, 8)))]
    rows, keys, cu_q, cu_k, _ = span_plan(segs, 4, torch.device("cpu"))
    assert rows.tolist() == [1, 2, 6, 7, 9]
    assert keys.tolist() == [4, 5, 6, 0, 1, 2, 3, 10, 11, 0, 1, 2, 3, 10, 11, 12, 13]
    assert (cu_q, cu_k) == ([0, 2, 4, 5], [0, 3, 9, 17])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("window", [None, 24])
def test_spans_on_flash_match_the_dense_mask(block, window, monkeypatch):
    """bf16 on CUDA: a sequence with two image runs, whole and as a branch over a shared prefix,
    beside a text sequence: within bf16 rounding of the float64 dense mask; the spans ran on the
    non-causal FlashAttention call; in deterministic mode (block) a span row's bits are its own."""
    calls = []
    real = attention.flash_varlen_attention
    monkeypatch.setattr(attention, "flash_varlen_attention",
                        lambda *a, **kw: calls.append(kw.get("causal", True)) or real(*a, **kw))
    torch.manual_seed(0)
    T, blocks, D = 160, [(20, 68), (90, 110)], 64
    q, k, v = torch.randn(T, 8, D), torch.randn(T, 2, D), torch.randn(T, 2, D)
    want = _dense_reference(q, k, v, D**-0.5, window, blocks)
    dev = [x.to("cuda", torch.bfloat16) for x in (q, k, v)]
    whole = packed_attention(*dev, AttentionMeta([Segment(0, T, (), tuple(blocks))], kv_block=block), 0, D**-0.5,
                             window)
    assert False in calls
    assert (whole.double().cpu() - want).abs().max() < 3e-2
    text = [torch.randn(33, h, D).to("cuda", torch.bfloat16) for h in (8, 2, 2)]
    meta = AttentionMeta([Segment(0, 33), Segment(33, 33 + T, (), tuple(blocks))], kv_block=block)
    both = packed_attention(*(torch.cat([a, b]) for a, b in zip(text, dev)), meta, 0, D**-0.5, window)
    tree = AttentionMeta([Segment(0, 80, (), ((20, 68),)), Segment(80, T, ((0, 80),), ((90, 110),))], kv_block=block)
    branch = packed_attention(*dev, tree, 0, D**-0.5, window)
    assert (branch.double().cpu() - want).abs().max() < 3e-2
    if block is not None:
        assert torch.equal(both[33:], whole)
        assert torch.equal(branch[20:68], whole[20:68]) and torch.equal(branch[90:110], whole[90:110])
    causal = packed_attention(*dev, AttentionMeta([Segment(0, T)], kv_block=block), 0, D**-0.5, window)
    assert (causal[20:67] - whole[20:67]).abs().max() > 1e-2  # the spans changed the image rows


def _on_cuda(path, ref, seqs, reference):
    """float32 on CUDA against float64; bf16 deterministic alone = batched with a text request."""
    out = Scorer(str(path), device="cuda", dtype="float32", progress=False).logprobs(seqs)
    worst = max((res.logprobs.double().cpu() - reference(ref, path, seq)[0]).abs().max().item()
                for seq, res in zip(seqs, out))
    text = {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))}
    scorer = Scorer(str(path), device="cuda", dtype="bfloat16", progress=False, deterministic=True)
    together = scorer.logprobs([text, *seqs])
    alone = [scorer.logprobs([s])[0] for s in (text, *seqs)]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, together))
    return worst


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_images_on_cuda(family, request):
    fixture, sequences, reference = {"gemma3": ("gemma_vl", _sequences3, _reference3),
                                     "gemma4": ("gemma4_vl", _sequences4, _reference4)}[family]
    path, ref = request.getfixturevalue(fixture)
    worst = _on_cuda(path, ref, sequences(), reference)
    print(f"{family} images on CUDA, float32: max |delta| against float64 {worst:.2e}")
    assert worst < 1e-4


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qwen3_vl_images_on_cuda(kind, vl_dirs):  # noqa: F811
    path, ref = vl_dirs[kind]
    worst = _on_cuda(path, ref, _sequences_vl(), lambda r, p, seq: _reference_vl(r, p, seq)[:2])
    print(f"qwen3-vl {kind} images on CUDA, float32: max |delta| against float64 {worst:.2e}")
    assert worst < 1e-4

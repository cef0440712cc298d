"""The Triton short conv (``kernels.short_conv``, the conv on CUDA) where the model calls it, against
the PyTorch reference ``layers.gated_delta.causal_conv1d``.

* The conv alone, as ``packed_gated_delta`` calls it: the taps and the carried state (each
  sequence's last K - 1 inputs) bit for bit, a strided input (read in place) as a contiguous one,
  SiLU to 1e-6; a sequence cut anywhere and carried through its final state equals the uncut run
  bit for bit; a sequence alone equals it packed.
* The packed mixer core (``layers.linear_state.packed_gated_delta``) with the Triton conv: within
  1e-5 of the reference conv (float32); on CPU also batch-invariant, chunk-carried through the cache
  and prefix-shared bit for bit (the reference rule is).
* A whole tiny Qwen3.5 (``test_hybrid_engine``'s) through the engine with the Triton conv: log-probs
  within 1e-5 of the reference conv's, and deterministic mode bitwise alone vs packed in a shuffled
  mix under budgets that cut long requests into chunks and share prefixes (slow tier).

CPU: Triton's interpreter in a fresh process (``helpers.run_interpreted``). CUDA (``-m gpu``): the
conv and layer checks on the GPU (the rule's bits there are fla's business: ``test_hybrid_gpu``).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
from helpers import run_interpreted

from logprobe.kernels import triton_available
from logprobe.layers.attention import AttentionMeta, KVCache, Segment
from logprobe.layers.gated_delta import GatedDeltaNet, causal_conv1d
from logprobe.layers.linear_state import DeltaInputs, packed_gated_delta

HK, HV, DK, DV, HID = 2, 4, 8, 8, 32
C = 2 * HK * DK + HV * DV  # the conv's channels, [q | k | v]

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")


def _conv(block_t: int = 16, block_c: int = 32):
    """The Triton conv; small tiles so that tiny shapes still span several of each."""
    from logprobe.kernels.short_conv import causal_conv1d_triton

    return lambda *a, **k: causal_conv1d_triton(*a, **k, block_t=block_t, block_c=block_c)


def check_conv(device: str) -> None:
    conv = _conv()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 0, 1, 2, 3, 40, 17]  # empty, shorter than K - 1, across token tiles
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(cu[-1], C, generator=gen).to(dtype).to(device)
        w = torch.randn(C, 4, generator=gen).to(dtype).to(device)
        s0 = torch.randn(len(lengths), C, 3, generator=gen).to(dtype).to(device)
        y, f = conv(x, w, cu, s0, activation=None)
        y_ref, f_ref = causal_conv1d(x, w, cu, s0, activation=None)
        assert y.dtype == dtype and f.dtype == dtype and f.shape == (len(lengths), C, 3)
        assert torch.equal(y, y_ref) and torch.equal(f, f_ref), dtype  # taps and state: bit for bit
        y, f = conv(x, w, cu, s0)
        wide = torch.cat([x, x[:, :3]], dim=1)[:, :C]  # rows C + 3 apart, as a slice of a fused projection
        y_w, f_w = conv(wide, w, cu, s0)
        assert not wide.is_contiguous() and torch.equal(y_w, y) and torch.equal(f_w, f), dtype
        y_ref, _ = causal_conv1d(x, w, cu, s0)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # SiLU: a few float32 ulp, then rounded
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
        i = lengths.index(40)
        a, b = cu[i], cu[i + 1]
        alone, alone_f = conv(x[a:b], w, None, s0[i:i + 1])
        assert torch.equal(alone, y[a:b]) and torch.equal(alone_f[0], f[i])
        for cut in (2, 21):  # the carried state reaches into the initial one below K - 1
            y1, f1 = conv(x[a:a + cut], w, None, s0[i:i + 1])
            y2, f2 = conv(x[a + cut:b], w, None, f1)
            assert torch.equal(torch.cat([y1, y2]), y[a:b]) and torch.equal(f2[0], f[i]), cut


def _net(device: str) -> GatedDeltaNet:
    torch.manual_seed(0)
    net = GatedDeltaNet(HID, HK, HV, DK, DV)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    return net.to(device)


def _inputs(net: GatedDeltaNet, x: torch.Tensor) -> DeltaInputs:
    with torch.no_grad():
        return DeltaInputs(net.in_proj_qkv(x), net.in_proj_a(x), net.in_proj_b(x), net.conv_weight, net.A_log,
                           net.dt_bias, net.key_dim, HK, HV, DK, DV)


def check_layer(device: str) -> None:
    conv, net = _conv(64, 64), _net(device)  # tiles cut the 64 channels' [q | k | v] ranges
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 63, 64, 65, 130]
    full = _inputs(net, torch.randn(sum(lengths), HID, generator=gen).to(device))
    meta = AttentionMeta.packed(lengths)
    packed = packed_gated_delta(full, meta, 0, conv=conv)
    ref = packed_gated_delta(full, AttentionMeta.packed(lengths), 0)
    assert (packed - ref).abs().max() < 1e-5
    if device != "cpu":
        return  # the reference rule's products may tile by batch count on a GPU
    start = 0
    for n in lengths:  # alone = packed
        part = replace(full, mixed=full.mixed[start:start + n], a=full.a[start:start + n], b=full.b[start:start + n])
        assert torch.equal(packed_gated_delta(part, AttentionMeta.packed([n]), 0, conv=conv), packed[start:start + n])
        start += n
    x = _inputs(net, torch.randn(300, HID, generator=gen))
    whole = packed_gated_delta(x, AttentionMeta.packed([300]), 0, conv=conv)
    cache, outs = KVCache.empty(1), []
    for b, e in ((0, 128), (128, 192), (192, 300)):  # chunks carried through the cache
        piece = replace(x, mixed=x.mixed[b:e], a=x.a[b:e], b=x.b[b:e])
        m = AttentionMeta([Segment(0, e - b, ((0, b),) if b else ())], cache=cache, past=b)
        outs.append(packed_gated_delta(piece, m, 0, conv=conv))
        cache.commit()
    assert torch.equal(torch.cat(outs), whole)
    # a shared 64-row prefix, then two branches from its final state (the second: rows 64..127 again)
    m = AttentionMeta([Segment(0, 64), Segment(64, 300, ((0, 64),)), Segment(300, 364, ((0, 64),))])
    rows = replace(x, **{k: torch.cat([getattr(x, k), getattr(x, k)[64:128]]) for k in ("mixed", "a", "b")})
    o = packed_gated_delta(rows, m, 0, conv=conv)
    assert torch.equal(o[:300], whole) and torch.equal(o[300:], whole[64:128])


def check_model(path: str) -> None:
    """The tiny Qwen3.5 at ``path`` through the engine, its conv Triton's (the CPU selection patched
    to what CUDA selects): log-probs against the float64 transformers ones saved at ``path/want.pt``
    and against the reference conv's; deterministic mode alone vs packed, bitwise."""
    from test_hybrid_engine import mix, packed_like_alone

    from logprobe import Scorer
    from logprobe.loading import load_model
    from logprobe.models import qwen3_next

    loaded = load_model(path, "cpu", "float32")
    reqs, want = mix(1), torch.load(f"{path}/want.pt")
    ref = Scorer(loaded).engine.run(reqs)
    conv = _conv(64, 64)
    qwen3_next.gated_delta_kernels = lambda device, deterministic, triton=True, dtype=None: (None, conv)
    for a, b, w in zip(ref, Scorer(loaded).engine.run(reqs), want):
        # float32's floor here: the reference conv's run is ~7e-5 from float64 (|log-prob| up to ~9)
        assert (b.logprobs.double() - w).abs().max() < 1e-4
        assert (a.logprobs - b.logprobs).abs().max() < 3e-5  # seen: 1.1e-5 (SiLU's ulps, 4 layers on)
    packed_like_alone(loaded, reqs, (64, 1 << 20))


def _interpreted(code: str) -> None:
    r = run_interpreted(code + "\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@needs_triton
def test_conv_and_layer_interpreted():
    _interpreted("from test_short_conv_model import check_conv, check_layer\ncheck_conv('cpu')\ncheck_layer('cpu')")


@pytest.fixture
def hf_torch_kernels(monkeypatch):
    """transformers' own PyTorch rule and conv for the float64 reference (fla-core's Triton ones,
    which it picks where fla is installed, do not run on CPU)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(mod, name, inspect.unwrap(getattr(mod, name)))


@pytest.mark.slow
@needs_triton
def test_tiny_qwen35_interpreted(tmp_path, hf_torch_kernels):
    from test_hybrid_engine import mix, save_tiny_qwen35

    save_tiny_qwen35(tmp_path, mix(1))
    _interpreted(f"from test_short_conv_model import check_model\ncheck_model({str(tmp_path)!r})")


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")


@pytest.mark.gpu
@cuda
def test_conv_and_layer_on_cuda():
    check_conv("cuda")
    check_layer("cuda")

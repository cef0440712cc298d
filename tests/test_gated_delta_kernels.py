"""The gated delta rule's fast paths (``kernels/gated_delta.py``) against the references in
``layers/gated_delta.py``.

CPU (always run): the batched rule against ``gated_delta_rule_chunked`` on packed sequences of
mixed lengths (1, 63, 64, 65, 200 and an empty one), grouped value attention (Hv = 2 Hk), initial
states, outputs and final states: 1e-6 relative in float32, 1e-12 in float64 (on the CPUs seen it
is even bit-identical, the same operations on the same values; not asserted, BLAS may block
batched products differently elsewhere). The batched conv is asserted bit-identical to
``causal_conv1d`` (same taps in the same order, SiLU applied the same way).

CUDA (``-m gpu``, skipped without a GPU): the batched rule and conv against the references on the
GPU, and fla-core's rule (skipped where fla does not import) against the float32 reference on the
bf16-rounded inputs, plus its batch invariance (a sequence alone and packed among others, bit for
bit), which deterministic mode relies on (``gated_delta_kernels``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logprobe.kernels.gated_delta import (
    causal_conv1d_batched,
    causal_conv1d_fast,
    chunk_gated_delta_batched,
    chunk_gated_delta_fixed,
    chunk_gated_delta_fla,
    fla_available,
    gated_delta_kernels,
)
from logprobe.layers.gated_delta import causal_conv1d, gated_delta_rule_chunked

HK, HV, DK, DV = 2, 4, 16, 8  # grouped value attention: two value heads per key head
LENGTHS = [1, 63, 64, 65, 200, 0, 130]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(T, seed=0, dtype=torch.float32, device="cpu", hk=HK, hv=HV, dk=DK, dv=DV):
    """Random q, k [T, Hk, Dk], v [T, Hv, Dv], weak log decays g and beta [T, Hv] (as the layer
    tests: exp(g) near 1, so the carried state matters)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=gen, dtype=dtype)
    g = F.logsigmoid(2 * torch.randn(T, hv, generator=gen, dtype=dtype) + 4)
    beta = torch.rand(T, hv, generator=gen, dtype=dtype)
    return tuple(x.to(device) for x in (q, k, v, g, beta))


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("group", [1024, 3])  # all chunks together; groups of whole sequences
def test_batched_rule_matches_reference(dtype, tol, with_state, group):
    cu = _cu(LENGTHS)
    x = _inputs(cu[-1], dtype=dtype)
    s0 = torch.randn(len(LENGTHS), HV, DK, DV, dtype=dtype, generator=torch.Generator().manual_seed(1)) if with_state else None
    o_ref, s_ref = gated_delta_rule_chunked(*x, cu, s0)
    o, s = chunk_gated_delta_batched(*x, cu, s0, max_group_chunks=group)
    assert o.dtype == o_ref.dtype and s.dtype == s_ref.dtype and s.shape == s_ref.shape
    assert _rel(o, o_ref) < tol and _rel(s, s_ref) < tol
    if with_state:  # the empty sequence keeps its initial state
        assert torch.equal(s[LENGTHS.index(0)], s0[LENGTHS.index(0)])


def test_batched_rule_options_and_one_sequence():
    """No cu_seqlens (one sequence), a custom scale, no L2 norm, a smaller chunk, bf16 inputs."""
    x = _inputs(150)
    for kw in [{}, {"scale": 0.3}, {"qk_l2norm": False}, {"chunk_size": 16}]:
        o_ref, s_ref = gated_delta_rule_chunked(*x, **kw)
        o, s = chunk_gated_delta_batched(*x, **kw)
        assert _rel(o, o_ref) < 1e-6 and _rel(s, s_ref) < 1e-6, kw
    xb = tuple(t.to(torch.bfloat16) for t in x)
    o_ref, s_ref = gated_delta_rule_chunked(*xb, [0, 50, 150])
    o, s = chunk_gated_delta_batched(*xb, [0, 50, 150])
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert _rel(o, o_ref) < 1e-2 and _rel(s, s_ref) < 1e-6


def test_batched_rule_sequence_alone_or_packed():
    """A sequence's results do not depend on its neighbours beyond rounding (and it continues
    from a carried state as the whole run does at a chunk-aligned split)."""
    cu = _cu(LENGTHS)
    x = _inputs(cu[-1], seed=3)
    o, s = chunk_gated_delta_batched(*x, cu)
    i = LENGTHS.index(200)
    a, b = cu[i], cu[i + 1]
    o1, s1 = chunk_gated_delta_batched(*(t[a:b] for t in x))
    assert _rel(o1, o[a:b]) < 1e-6 and _rel(s1[0], s[i]) < 1e-6
    head, tail = chunk_gated_delta_batched(*(t[a:a + 128] for t in x)), None
    tail = chunk_gated_delta_batched(*(t[a + 128:b] for t in x), initial_state=head[1])
    assert _rel(torch.cat([head[0], tail[0]]), o[a:b]) < 1e-6 and _rel(tail[1][0], s[i]) < 1e-6


def test_batched_rule_refuses_bad_shapes():
    x = _inputs(10)
    with pytest.raises(ValueError):
        chunk_gated_delta_batched(*x, [0, 4, 9])
    with pytest.raises(ValueError):
        chunk_gated_delta_batched(*x, [0, 10], torch.zeros(2, HV, DK, DV))
    q, k, v, g, beta = _inputs(10, hk=3, hv=4)
    with pytest.raises(ValueError):
        chunk_gated_delta_batched(q, k, v, g, beta)


@pytest.mark.parametrize("channels", [40, 64])  # 40: the CPU SiLU's scalar tail (row_invariant's padding)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batched_conv_bit_identical(channels, dtype):
    cu = _cu([1, 2, 3, 0, 64, 65, 7])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cu[-1], channels, generator=gen).to(dtype)
    w = torch.randn(channels, 4, generator=gen).to(dtype)
    st = torch.randn(len(cu) - 1, channels, 3, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype)
    for init in (None, st):
        for bias in (None, b):
            for act in ("silu", None):
                y_ref, f_ref = causal_conv1d(x, w, cu, init, bias, act)
                y, f = causal_conv1d_batched(x, w, cu, init, bias, act)
                assert y.dtype == y_ref.dtype and f.dtype == f_ref.dtype
                assert torch.equal(y, y_ref) and torch.equal(f, f_ref)
    y_ref, f_ref = causal_conv1d(x, w)
    y, f = causal_conv1d_batched(x, w)  # one sequence
    assert torch.equal(y, y_ref) and torch.equal(f, f_ref)
    with pytest.raises(ValueError):
        causal_conv1d_batched(x, w, activation="gelu")


@pytest.mark.parametrize("has_triton", [True, False])
def test_selector_policy(monkeypatch, has_triton):
    """The conv on CUDA: Triton's where it imports and ``Numerics.triton`` is on, in both modes;
    the batched one otherwise. The rule: fla's for 16-bit activations, else batched (default) or the
    reference (None)."""
    from logprobe.kernels import gated_delta as kgd

    assert gated_delta_kernels("cpu", False) == (None, None)
    assert gated_delta_kernels(torch.device("cpu"), True) == (None, None)
    monkeypatch.setattr(kgd, "triton_available", lambda: has_triton)
    fast = causal_conv1d_fast if has_triton else causal_conv1d_batched
    for has_fla in (True, False):
        monkeypatch.setattr(kgd, "fla_available", lambda has_fla=has_fla: has_fla)
        rule, conv = gated_delta_kernels("cuda", False)
        assert conv is fast
        assert rule is (chunk_gated_delta_fla if has_fla else chunk_gated_delta_batched)
        rule, conv = gated_delta_kernels("cuda:0", True)
        assert conv is fast
        assert rule is (chunk_gated_delta_fla if has_fla else chunk_gated_delta_fixed)
        assert gated_delta_kernels("cuda", True, triton=False)[1] is causal_conv1d_batched
        # float32 activations never go to fla (its float32 products are TF32)
        assert gated_delta_kernels("cuda", False, dtype=torch.float32)[0] is chunk_gated_delta_batched
        assert gated_delta_kernels("cuda", True, dtype=torch.float32)[0] is chunk_gated_delta_fixed
        assert gated_delta_kernels("cuda", False, dtype=torch.float16)[0] is (
            chunk_gated_delta_fla if has_fla else chunk_gated_delta_batched)


def test_fast_conv_keeps_float64_on_the_reference():
    """The Triton kernel computes in float32: a float64 input (the tests' reference precision)
    goes to the batched conv, bit-identical to the reference; no Triton needed."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 8, generator=gen, dtype=torch.float64), torch.randn(8, 4, generator=gen, dtype=torch.float64)
    for xx in (x, x.float()):  # float64 activations, or float32 ones with a float64 weight
        y, f = causal_conv1d_fast(xx, w, [0, 4, 9])
        y_ref, f_ref = causal_conv1d(xx, w, [0, 4, 9])
        assert y.dtype == xx.dtype and torch.equal(y, y_ref) and torch.equal(f, f_ref)


# --------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@cuda
def test_batched_rule_and_conv_on_cuda():
    cu = _cu(LENGTHS)
    x = _inputs(cu[-1], device="cuda")
    s0 = torch.randn(len(LENGTHS), HV, DK, DV, device="cuda")
    o_ref, s_ref = gated_delta_rule_chunked(*x, cu, s0)
    o, s = chunk_gated_delta_batched(*x, cu, s0)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    xc = torch.randn(cu[-1], 96, device="cuda")
    w = torch.randn(96, 4, device="cuda")
    st = torch.randn(len(LENGTHS), 96, 3, device="cuda")
    y_ref, f_ref = causal_conv1d(xc, w, cu, st)
    y, f = causal_conv1d_batched(xc, w, cu, st)
    assert torch.equal(y, y_ref) and torch.equal(f, f_ref)


fla = pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")


@pytest.mark.gpu
@fla
@pytest.mark.parametrize("hk,hv,dk,dv", [(HK, HV, 64, 64), (4, 8, 128, 128)])
def test_fla_rule_matches_reference(hk, hv, dk, dv):
    cu = _cu(LENGTHS)
    x = _inputs(cu[-1], device="cuda", hk=hk, hv=hv, dk=dk, dv=dv)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (x[0], x[1], x[2], x[4]))
    g = x[3]
    s0 = torch.randn(len(LENGTHS), hv, dk, dv, device="cuda") * 0.1
    o_ref, s_ref = gated_delta_rule_chunked(q.float(), k.float(), v.float(), g, beta.float(), cu, s0)
    o, s = chunk_gated_delta_fla(q, k, v, g, beta, cu, s0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert _rel(o, o_ref) < 2e-2 and _rel(s, s_ref) < 2e-2
    assert torch.equal(s[LENGTHS.index(0)], s0[LENGTHS.index(0)])


@pytest.mark.gpu
@fla
def test_fla_rule_batch_invariant():
    """A sequence alone and packed among others: the same bits (outputs and final state)."""
    cu = _cu(LENGTHS)
    q, k, v, g, beta = _inputs(cu[-1], device="cuda", hk=4, hv=8, dk=128, dv=128)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    s0 = torch.randn(len(LENGTHS), 8, 128, 128, device="cuda") * 0.1
    o, s = chunk_gated_delta_fla(q, k, v, g, beta, cu, s0)
    for i in (LENGTHS.index(200), LENGTHS.index(65)):
        a, b = cu[i], cu[i + 1]
        o1, s1 = chunk_gated_delta_fla(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], None, s0[i:i + 1])
        assert torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[i])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_rule_alone_or_packed_bitwise(device, dtype):
    """Deterministic mode's rule without fla: a sequence alone, packed among others, and split at a
    chunk multiple with its state carried, bit for bit; and the batched rule's numbers to rounding."""
    cu = _cu(LENGTHS)
    q, k, v, g, beta = _inputs(cu[-1], seed=5, device=device, hk=2, hv=4, dk=32, dv=16)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    s0 = torch.randn(len(LENGTHS), 4, 32, 16).to(device) * 0.1
    o, s = chunk_gated_delta_fixed(q, k, v, g, beta, cu, s0)
    o_b, s_b = chunk_gated_delta_batched(q, k, v, g, beta, cu, s0)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert _rel(o, o_b) < (1e-6 if dtype == torch.float32 else 1e-2) and _rel(s, s_b) < 1e-5
    i = LENGTHS.index(200)
    a, b = cu[i], cu[i + 1]
    x = tuple(t[a:b] for t in (q, k, v, g, beta))
    o1, s1 = chunk_gated_delta_fixed(*x, None, s0[i:i + 1])
    assert torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[i])
    head = chunk_gated_delta_fixed(*(t[:128] for t in x), None, s0[i:i + 1])
    tail = chunk_gated_delta_fixed(*(t[128:] for t in x), None, head[1])
    assert torch.equal(torch.cat([head[0], tail[0]]), o[a:b]) and torch.equal(tail[1][0], s[i])


@pytest.mark.gpu
@cuda
def test_batched_rule_alone_or_packed_on_cuda():
    """A sequence alone and packed among others: the same to rounding. Not asserted bit for bit:
    on an H100 it was not at these shapes (cuBLAS picks batched kernels by batch count), which is
    why deterministic mode without fla runs ``chunk_gated_delta_fixed`` (``gated_delta_kernels``)."""
    cu = _cu(LENGTHS)
    q, k, v, g, beta = _inputs(cu[-1], device="cuda", hk=4, hv=8, dk=128, dv=128)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    s0 = torch.randn(len(LENGTHS), 8, 128, 128, device="cuda") * 0.1
    o, s = chunk_gated_delta_batched(q, k, v, g, beta, cu, s0)
    for i in (LENGTHS.index(200), LENGTHS.index(65)):
        a, b = cu[i], cu[i + 1]
        o1, s1 = chunk_gated_delta_batched(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], None, s0[i:i + 1])
        assert _rel(o1, o[a:b]) < 1e-2 and _rel(s1[0], s[i]) < 1e-5

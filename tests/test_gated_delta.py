"""Gated DeltaNet layers (``layers/gated_delta.py``) against transformers' Qwen3-Next / Qwen3.5 code.

The reference is transformers' own torch code run in float64. Its gated-delta-rule functions and
gated norm cast to float32 inside (``.to(torch.float32)``), so ``_float64`` runs the very same code
objects with ``torch.float32`` read as ``torch.float64``: the comparison is then float64 against
float64 and differences are rounding only (~1e-15; asserted at 1e-10, far below any real error,
which would show at 1e-2..1e-4).

Tolerances: float64 against float64: 1e-10. Our float32 results against the float64 reference:
1e-5 absolute, for outputs and states of magnitude ~1: float32 rounds at ~6e-8 relative, and a
chunk's triangular solve and matmuls sum 64 terms (the errors seen are ~2e-7). Bitwise where the
module docstring promises it: a sequence packed alone or among others, the recurrent form and the
conv split anywhere, the chunked form split at a multiple of the chunk size.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import torch.nn.functional as F

from logprobe.layers.gated_delta import (
    CHUNK_SIZE,
    GatedDeltaNet,
    GatedDeltaState,
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_rms_norm,
    split_qwen3_next_projections,
)

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext  # noqa: E402

F64_TOL = 1e-10
F32_TOL = 1e-5
HK, HV, DK, DV = 2, 4, 16, 8  # grouped value attention: two value heads per key head
RULES = [gated_delta_rule_recurrent, gated_delta_rule_chunked]


class _TorchFloat32IsFloat64:
    """``torch`` with ``float32`` meaning float64 (for transformers' float32 casts)."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _float64(fn):
    """transformers' function ``fn`` (unwrapped of its hub-kernel decorator), computing in float64."""
    fn = inspect.unwrap(fn)
    scope = dict(fn.__globals__, torch=_TorchFloat32IsFloat64())
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


HF_CHUNK = _float64(hfnext.torch_chunk_gated_delta_rule)
HF_RECURRENT = _float64(hfnext.torch_recurrent_gated_delta_rule)


def _inputs(T: int, seed: int = 0, dtype=torch.float64, decay_scale: float = 1.0):
    """Random q, k [T, HK, DK], v [T, HV, DV], log decay g and beta [T, HV]. Most decays are weak
    (exp(g) near 1), so the state remembers far back and carried-state errors would show."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, HK, DK, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(T, HV, DV, generator=gen, dtype=dtype)
    g = F.logsigmoid(2 * torch.randn(T, HV, generator=gen, dtype=dtype) + 4) * decay_scale
    beta = torch.rand(T, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _states(n: int, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, HV, DK, DV, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _hf(fn, q, k, v, g, beta, h0):
    """transformers' rule on one sequence (batch of one), its output [T, HV, DV] and state."""
    o, s = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# The rule


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("with_state", [False, True])
def test_rule_matches_transformers_in_float64(rule, with_state):
    """Both forms equal both of transformers' forms, with and without an initial state, across
    chunk boundaries (150 = 64 + 64 + 22)."""
    q, k, v, g, beta = _inputs(150)
    h0 = _states(1) if with_state else None
    for hf in (HF_CHUNK, HF_RECURRENT):
        ref, ref_state = _hf(hf, q, k, v, g, beta, h0)
        o, s = rule(q, k, v, g, beta, initial_state=h0)
        assert o.dtype == s.dtype == torch.float64
        assert _max_err(o, ref) < F64_TOL and _max_err(s, ref_state) < F64_TOL


def test_initial_state_is_honoured():
    """The initial state changes the result (it is read), and a zero state equals none."""
    q, k, v, g, beta = _inputs(70)
    zero, _ = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=torch.zeros(1, HV, DK, DV,
                                                                                  dtype=torch.float64))
    none, _ = gated_delta_rule_chunked(q, k, v, g, beta)
    given, _ = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=_states(1))
    assert torch.equal(zero, none)
    assert _max_err(given, none) > 1e-2


@pytest.mark.parametrize("rule", RULES)
def test_float32_matches_float64_reference(rule):
    """Our float32 forms against transformers' code in float64."""
    q, k, v, g, beta = _inputs(200, seed=3)
    h0 = _states(1, seed=4)
    ref, ref_state = _hf(HF_RECURRENT, q, k, v, g, beta, h0)
    o, s = rule(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float())
    assert o.dtype == s.dtype == torch.float32
    assert _max_err(o, ref) < F32_TOL and _max_err(s, ref_state) < F32_TOL


@pytest.mark.parametrize("rule", RULES)
def test_low_precision_inputs_compute_in_float32(rule):
    """bfloat16 inputs: computed in float32, the output rounded once to bfloat16, the state kept in
    float32."""
    inputs = [x.bfloat16() for x in _inputs(70, seed=21)]
    o, s = rule(*inputs)
    o32, s32 = rule(*(x.float() for x in inputs))
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(o, o32.bfloat16()) and torch.equal(s, s32)


def test_recurrent_equals_chunked_in_float32():
    q, k, v, g, beta = _inputs(200, seed=5, dtype=torch.float32)
    h0 = _states(1, seed=6, dtype=torch.float32)
    o1, s1 = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0)
    o2, s2 = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0)
    assert _max_err(o1, o2) < F32_TOL and _max_err(s1, s2) < F32_TOL


def test_strong_decay_does_not_overflow():
    """Decays of e^-60 per token: a chunk's cumulated log decay reaches -3840, yet the chunked
    form exponentiates only differences <= 0 and stays finite and equal to the recurrence."""
    q, k, v, g, beta = _inputs(130, seed=7, dtype=torch.float32)
    g = torch.full_like(g, -60.0)
    o1, s1 = gated_delta_rule_recurrent(q, k, v, g, beta)
    o2, s2 = gated_delta_rule_chunked(q, k, v, g, beta)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert _max_err(o1, o2) < F32_TOL and _max_err(s1, s2) < F32_TOL


@pytest.mark.parametrize("rule", RULES)
def test_varlen_packing_equals_per_sequence_runs(rule):
    """Packed sequences (lengths around the chunk size, one empty), each with its own initial
    state, equal transformers on each sequence alone; an empty sequence keeps its state."""
    lengths = [1, 63, 0, 64, 65, 130]
    cu = _cu(lengths)
    q, k, v, g, beta = _inputs(cu[-1], seed=8)
    h0 = _states(len(lengths), seed=9)
    o, s = rule(q, k, v, g, beta, cu_seqlens=torch.tensor(cu), initial_state=h0)
    assert s.shape == (len(lengths), HV, DK, DV)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        if a == b:
            assert torch.equal(s[i], h0[i])
            continue
        ref, ref_state = _hf(HF_CHUNK, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], h0[i : i + 1])
        assert _max_err(o[a:b], ref) < F64_TOL and _max_err(s[i], ref_state[0]) < F64_TOL


@pytest.mark.parametrize("rule", RULES)
def test_batch_invariance_is_bitwise(rule):
    """A sequence's float32 outputs and final state are identical, bit for bit, packed alone or
    between others (chunks are counted from its own start)."""
    q, k, v, g, beta = _inputs(40 + 150 + 77, seed=10, dtype=torch.float32)
    h0 = _states(3, seed=11, dtype=torch.float32)
    o, s = rule(q, k, v, g, beta, cu_seqlens=[0, 40, 190, 267], initial_state=h0)
    alone = [x[40:190] for x in (q, k, v, g, beta)]
    o1, s1 = rule(*alone, initial_state=h0[1:2])
    assert torch.equal(o1, o[40:190]) and torch.equal(s1[0], s[1])


def _run_in_pieces(rule, inputs, cuts, h0):
    """The sequence run piece by piece, the state carried: outputs concatenated, last state."""
    outs, state, bounds = [], h0, [0, *cuts, inputs[0].shape[0]]
    for a, b in zip(bounds, bounds[1:]):
        o, state = rule(*(x[a:b] for x in inputs), initial_state=state)
        outs.append(o)
    return torch.cat(outs), state


@pytest.mark.parametrize("cuts", [[1], [37], [64], [100], [128], [20, 64, 140], [64, 128]])
def test_split_sequence_continues_from_carried_state(cuts):
    """Split anywhere, the carried state continues exactly (float64: to rounding, against
    transformers' whole run; float32: to 1e-5). Bitwise in float32 where the contract says so:
    the recurrent form at any cut, the chunked form at cuts on multiples of the chunk size."""
    T = 150
    inputs64 = _inputs(T, seed=12)
    h64 = _states(1, seed=13)
    ref, ref_state = _hf(HF_CHUNK, *inputs64, h64)
    inputs32, h32 = [x.float() for x in inputs64], h64.float()
    for rule in RULES:
        o, s = _run_in_pieces(rule, inputs64, cuts, h64)
        assert _max_err(o, ref) < F64_TOL and _max_err(s, ref_state) < F64_TOL
        whole, whole_state = rule(*inputs32, initial_state=h32)
        o, s = _run_in_pieces(rule, inputs32, cuts, h32)
        assert _max_err(o, whole) < F32_TOL and _max_err(s, whole_state) < F32_TOL
        if rule is gated_delta_rule_recurrent or all(c % CHUNK_SIZE == 0 for c in cuts):
            assert torch.equal(o, whole) and torch.equal(s, whole_state)


# --------------------------------------------------------------------------------------------
# The convolution and the gated norm


def _conv_weights(C: int, K: int, seed: int = 14, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(C, K, generator=gen, dtype=dtype), torch.randn(C, generator=gen, dtype=dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_matches_transformers(bias):
    """Whole sequences against transformers' ``causal_conv1d_fn``; a sequence split at p against
    its ``causal_conv1d_update`` continuing from our carried state (the last K - 1 inputs)."""
    C, K, T = 12, 4, 50
    w, b = _conv_weights(C, K)
    b = b if bias else None
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    ref = hfnext.causal_conv1d_fn(x.T[None], w, b, activation="silu")[0].T  # [1, C, T] -> [T, C]
    y, state = causal_conv1d(x, w, bias=b)
    assert _max_err(y, ref) < F64_TOL
    assert torch.equal(state[0], x[-(K - 1) :].T)
    for p in (1, 2, 30):
        y1, s1 = causal_conv1d(x[:p], w, bias=b)
        y2, _ = causal_conv1d(x[p:], w, initial_state=s1, bias=b)
        hf_state = s1.clone()  # [1, C, K - 1]
        hf2 = hfnext.causal_conv1d_update(x[p:].T[None], hf_state, w, b, "silu")[0].T
        assert _max_err(y2, hf2) < F64_TOL and _max_err(torch.cat([y1, y2]), ref) < F64_TOL


def test_conv_varlen_split_and_batch_invariance_are_bitwise():
    """float32: packing and splitting anywhere (state carried, including a piece shorter than
    K - 1 whose state reaches into the previous one) give the same bits as the whole run."""
    C, K = 12, 4
    w, b = (t.float() for t in _conv_weights(C, K))
    x = torch.randn(90, C, generator=torch.Generator().manual_seed(16))
    s0 = torch.randn(3, C, K - 1, generator=torch.Generator().manual_seed(17))
    y, s = causal_conv1d(x, w, cu_seqlens=[0, 20, 70, 90], initial_state=s0, bias=b)
    alone, alone_state = causal_conv1d(x[20:70], w, initial_state=s0[1:2], bias=b)
    assert torch.equal(alone, y[20:70]) and torch.equal(alone_state[0], s[1])
    pieces, state = [], s0[1:2]
    for a, e in [(20, 21), (21, 22), (22, 55), (55, 70)]:
        out, state = causal_conv1d(x[a:e], w, initial_state=state, bias=b)
        pieces.append(out)
    assert torch.equal(torch.cat(pieces), alone) and torch.equal(state, alone_state)


@pytest.mark.parametrize("family", [hfnext.Qwen3NextRMSNormGated, hf35.Qwen3_5RMSNormGated])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gated_norm_matches_transformers(family, dtype):
    """Norm, then multiply by SiLU(z), the weight applied as stored (``w``): equal to both
    families' modules on a random weight (bitwise in float32 and bfloat16: the same operations in
    the same order; float64 against their code read in float64)."""
    gen = torch.Generator().manual_seed(18)
    x, z = (torch.randn(7, DV, generator=gen).to(dtype) for _ in range(2))
    hf = family(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(DV, generator=gen))
    forward = _float64(type(hf).forward) if dtype == torch.float64 else type(hf).forward
    ref = forward(hf, x, z)
    out = gated_rms_norm(x, z, hf.weight.detach(), 1e-6)
    assert out.dtype == dtype
    if dtype == torch.float64:
        assert _max_err(out, ref) < F64_TOL
    else:
        assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------------
# The whole mixer against transformers' layers


def _config(cls):
    return cls(hidden_size=32, num_hidden_layers=4, linear_num_key_heads=HK, linear_num_value_heads=HV,
               linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)


def _randomise(layer: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (the norm's weight and A_log included), O(1) activations."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen))


def _ours_from(hf_layer, projections: dict[str, torch.Tensor]) -> GatedDeltaNet:
    ours = GatedDeltaNet(32, HK, HV, DK, DV, conv_kernel_size=4, eps=hf_layer.layer_norm_epsilon).double()
    with torch.no_grad():
        for name, w in projections.items():
            getattr(ours, name).weight.copy_(w)
        ours.conv_weight.copy_(hf_layer.conv1d.weight.squeeze(1))  # [C, 1, K] -> [C, K]
        for name in ("A_log", "dt_bias", "out_proj.weight", "norm.weight"):
            ours.get_parameter(name).copy_(hf_layer.get_parameter(name))
    return ours


def _hf_layer(module, layer_cls, config_cls, monkeypatch):
    """transformers' layer in float64 (its rule and gated norm read in float64 too)."""
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _float64(module.torch_chunk_gated_delta_rule))
    norm_cls = type(layer_cls(_config(config_cls), 0).norm)
    monkeypatch.setattr(norm_cls, "forward", _float64(norm_cls.forward))
    layer = layer_cls(_config(config_cls), 0).double().eval()
    _randomise(layer, seed=19)
    return layer


def _check_against(hf_layer, ours: GatedDeltaNet) -> None:
    """Two sequences of 70 tokens (a batch for transformers, packed for us); then the same
    sequences cut at 64 and 67 with the state carried, recurrent and chunked."""
    B, L = 2, 70
    x = torch.randn(B, L, 32, generator=torch.Generator().manual_seed(20), dtype=torch.float64)
    with torch.no_grad():
        ref = hf_layer(x).reshape(B * L, 32)
        cu = [0, L, 2 * L]
        for recurrent in (False, True):
            y, state = ours(x.reshape(B * L, 32), cu_seqlens=cu, recurrent=recurrent)
            assert state.conv.shape == (B, ours.conv_weight.shape[0], 3)
            assert _max_err(y, ref) < F64_TOL
            pieces, state = [], None
            for a, b in [(0, 64), (64, 67), (67, L)]:
                piece = x[:, a:b].reshape(-1, 32)
                y, state = ours(piece, cu_seqlens=[0, b - a, 2 * (b - a)], state=state, recurrent=recurrent)
                pieces.append(y.view(B, b - a, 32))
            assert _max_err(torch.cat(pieces, dim=1).reshape(B * L, 32), ref) < F64_TOL
            assert isinstance(state, GatedDeltaState)


def test_qwen3_next_layer_matches_transformers(monkeypatch):
    hf = _hf_layer(hfnext, hfnext.Qwen3NextGatedDeltaNet, transformers.Qwen3NextConfig, monkeypatch)
    projections = split_qwen3_next_projections(hf.in_proj_qkvz.weight, hf.in_proj_ba.weight, HK, DK, HV, DV)
    _check_against(hf, _ours_from(hf, projections))


def test_qwen3_5_layer_matches_transformers(monkeypatch):
    hf = _hf_layer(hf35, hf35.Qwen3_5GatedDeltaNet, Qwen3_5TextConfig, monkeypatch)
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    _check_against(hf, _ours_from(hf, {n: hf.get_parameter(f"{n}.weight") for n in names}))

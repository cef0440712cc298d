"""layers.linear_state: which state each packed segment starts from, and the mixer core over a
packed batch, chunked or prefix-shared, against the same sequence run whole.

Bits: float32 on CPU. A cut at a multiple of 64 rows from the sequence start (the chunk grid of the
chunked rule) reproduces the whole run bit for bit; a cut elsewhere agrees to rounding (~1e-6)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from logprobe.errors import LogprobeError
from logprobe.layers.attention import AttentionMeta, KVCache, Segment
from logprobe.layers.gated_delta import GatedDeltaNet, gated_delta_rule_recurrent
from logprobe.layers.linear_state import CACHE, DeltaInputs, StateRoute, packed_gated_delta, route_states

HK, HV, DK, DV, HID = 2, 4, 8, 8, 32


@pytest.mark.parametrize("segments, past, cache, gold", [
    ([Segment(0, 3), Segment(3, 5)], 0, False, StateRoute((None, None), ((0, 1),))),
    ([Segment(0, 3), Segment(3, 5, ((0, 3),)), Segment(5, 6, ((0, 3),))], 0, False,
     StateRoute((None, 0, 0), ((0,), (1, 2)))),
    ([Segment(0, 2), Segment(2, 4), Segment(4, 6, ((2, 4),))], 0, False, StateRoute((None, None, 1), ((0, 1), (2,)))),
    ([Segment(0, 50, ((0, 128),))], 128, True, StateRoute((CACHE,), ((0,),))),
    ([], 0, False, StateRoute((), ())),
])
def test_route_states_gold(segments, past, cache, gold):
    meta = AttentionMeta(segments, cache=KVCache.empty(1) if cache else None, past=past)
    assert route_states(meta) == gold


@pytest.mark.parametrize("segments", [
    [Segment(0, 3), Segment(3, 5, ((0, 2),))],  # part of a segment: no state was ever formed there
    [Segment(0, 3, ((3, 5),)), Segment(3, 5)],  # a later segment
    [Segment(0, 2), Segment(2, 4), Segment(4, 6, ((0, 2), (2, 4)))],  # two spans
])
def test_route_states_refuses_other_contexts(segments):
    with pytest.raises(LogprobeError, match="context"):
        route_states(AttentionMeta(segments))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    m = GatedDeltaNet(HID, HK, HV, DK, DV)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def inputs(net, x):
    with torch.no_grad():
        return DeltaInputs(net.in_proj_qkv(x), net.in_proj_a(x), net.in_proj_b(x), net.conv_weight, net.A_log,
                           net.dt_bias, net.key_dim, HK, HV, DK, DV)


def run(net, x, meta, layer=0):
    return packed_gated_delta(inputs(net, x), meta, layer)


def test_matches_the_recurrent_reference_float64(net):
    x = torch.randn(150, HID, dtype=torch.float64)
    n64 = GatedDeltaNet(HID, HK, HV, DK, DV).double()
    n64.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    got = packed_gated_delta(inputs(n64, x), AttentionMeta.packed([70, 80]), 0)
    with torch.no_grad():
        from logprobe.layers.gated_delta import causal_conv1d, decay_and_beta
        y, _ = causal_conv1d(n64.in_proj_qkv(x), n64.conv_weight, [0, 70, 150])
        q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
        g, beta = decay_and_beta(n64.in_proj_a(x), n64.in_proj_b(x), n64.A_log, n64.dt_bias)
        want, _ = gated_delta_rule_recurrent(q.reshape(150, HK, DK), k.reshape(150, HK, DK), v.reshape(150, HV, DV),
                                             g, beta, [0, 70, 150])
    assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("cut", [64, 128])
def test_shared_prefix_at_a_block_boundary_is_bitwise(net, cut):
    torch.manual_seed(1)
    a, b = torch.randn(200, HID), torch.randn(40, HID)
    whole_a = run(net, a, AttentionMeta.packed([200]))
    whole_b = run(net, torch.cat([a[:cut], b]), AttentionMeta.packed([cut + 40]))
    # the prefix once, then both branches from its final state
    rows = torch.cat([a[:cut], a[cut:], b])
    meta = AttentionMeta([Segment(0, cut), Segment(cut, 200, ((0, cut),)), Segment(200, 240, ((0, cut),))])
    o = run(net, rows, meta)
    assert torch.equal(o[:200], whole_a)
    assert torch.equal(o[200:], whole_b[cut:])


def test_shared_prefix_off_the_grid_agrees_to_rounding(net):
    torch.manual_seed(2)
    a = torch.randn(150, HID)
    whole = run(net, a, AttentionMeta.packed([150]))
    o = run(net, a, AttentionMeta([Segment(0, 100), Segment(100, 150, ((0, 100),))]))
    assert torch.equal(o[:64], whole[:64])  # before the cut's chunk nothing moved
    assert not torch.equal(o, whole)  # the grid moved after 64: other rounding ...
    assert (o - whole).abs().max() < 1e-5  # ... of the same numbers


def test_batch_invariant(net):
    torch.manual_seed(3)
    lengths = [1, 63, 64, 65, 130]
    full = inputs(net, torch.randn(sum(lengths), HID))  # projected once: the core alone is under test
    packed = packed_gated_delta(full, AttentionMeta.packed(lengths), 0)
    start = 0
    for n in lengths:
        part = DeltaInputs(*(t[start:start + n] for t in (full.mixed, full.a, full.b)), full.conv_weight, full.A_log,
                           full.dt_bias, full.key_dim, HK, HV, DK, DV)
        assert torch.equal(packed_gated_delta(part, AttentionMeta.packed([n]), 0), packed[start:start + n])
        start += n


def test_chunks_carry_state_through_the_cache(net):
    torch.manual_seed(4)
    x = torch.randn(300, HID)
    whole = run(net, x, AttentionMeta.packed([300]))
    cache, outs = KVCache.empty(1), []
    for b, e in ((0, 128), (128, 192), (192, 300)):
        meta = AttentionMeta([Segment(0, e - b, ((0, b),) if b else ())], cache=cache, past=b)
        outs.append(run(net, x[b:e], meta))
        assert 0 in cache.pending and cache.pending[0].recurrent.shape == (1, HV, DK, DV)
        cache.commit()
    assert torch.equal(torch.cat(outs), whole)


def test_a_discarded_pass_leaves_the_carried_state(net):
    torch.manual_seed(5)
    x = torch.randn(192, HID)
    whole = run(net, x, AttentionMeta.packed([192]))
    cache = KVCache.empty(1)
    first = run(net, x[:64], AttentionMeta([Segment(0, 64)], cache=cache))
    cache.commit()
    run(net, x[64:128], AttentionMeta([Segment(0, 64, ((0, 64),))], cache=cache, past=64))
    cache.discard()  # that pass "ran out of memory": run rows 64.. again from the state after 64
    rest = run(net, x[64:], AttentionMeta([Segment(0, 128, ((0, 64),))], cache=cache, past=64))
    assert torch.equal(torch.cat([first, rest]), whole)


def test_a_cache_without_state_is_refused(net):
    x = torch.randn(10, HID)
    with pytest.raises(LogprobeError, match="no state"):
        run(net, x, AttentionMeta([Segment(0, 10, ((0, 64),))], cache=KVCache.empty(1), past=64))


def test_levels_as_row_ranges_or_gathers(net):
    """A level whose segments are one row range is read and written through views, other levels
    through gathers; both give each segment its alone-run bits, and a strided ``mixed`` (the fused
    projection's columns, read in place) the contiguous one's."""
    torch.manual_seed(4)
    a, p, b, c = (torch.randn(n, HID) for n in (30, 64, 26, 20))
    alone = {name: run(net, t, AttentionMeta.packed([len(t)])) for name, t in (("a", a), ("c", c))}
    pb = run(net, torch.cat([p, b]), AttentionMeta.packed([90]))
    layouts = {  # level 0 (a, p[, c]) one range in the first, split by b in the second
        "range": ([a, p, b], [Segment(0, 30), Segment(30, 94), Segment(94, 120, ((30, 94),))]),
        "gather": ([a, p, b, c], [Segment(0, 30), Segment(30, 94), Segment(94, 120, ((30, 94),)), Segment(120, 140)]),
    }
    for name, (parts, segments) in layouts.items():
        rows = torch.cat(parts)
        o = run(net, rows, AttentionMeta(segments))
        assert torch.equal(o[:30], alone["a"]) and torch.equal(o[30:120], pb), name
        if name == "gather":
            assert torch.equal(o[120:], alone["c"])
        x = inputs(net, rows)
        wide = torch.cat([x.mixed, torch.randn(len(rows), 5)], dim=1)[:, :x.mixed.shape[1]]  # row stride C + 5
        assert not wide.is_contiguous()
        assert torch.equal(packed_gated_delta(replace(x, mixed=wide), AttentionMeta(segments), 0), o), name

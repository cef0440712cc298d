"""Hook points, capture and steering: names, positions, equality with transformers, invariances."""

from __future__ import annotations

import pytest
import torch

from logprobe import Scorer
from logprobe.errors import LogprobeError
from logprobe.interp import point_names, resolve_points, resolve_positions
from logprobe.interp.vectors import direction_from_states, read_vector_file, write_gguf, write_safetensors
from logprobe.layers.hooks import add_rows

# -- names (pure) ------------------------------------------------------------------------------

POINT_GOLD = [  # (name, canonical points) for a 4-block model
    ("embed", ["embed"]),
    ("final_norm", ["final_norm"]),
    ("blocks.2.resid_post", ["blocks.2.resid_post"]),
    ("blocks.-1.attn_out", ["blocks.3.attn_out"]),
    ("blocks.1:3.mlp_out", ["blocks.1.mlp_out", "blocks.2.mlp_out"]),
    ("blocks.2:.resid_mid", ["blocks.2.resid_mid", "blocks.3.resid_mid"]),
    ("blocks.:-2.resid_pre", ["blocks.0.resid_pre", "blocks.1.resid_pre"]),
    ("blocks.*.resid_post", [f"blocks.{i}.resid_post" for i in range(4)]),
    ("blocks.0.hook_resid_post", ["blocks.0.resid_post"]),
    ("blocks.3.hook_attn_out", ["blocks.3.attn_out"]),
    ("hidden_states.0", ["embed"]),
    ("hidden_states.1", ["blocks.0.resid_post"]),
    ("hidden_states.3", ["blocks.2.resid_post"]),
    ("hidden_states.4", ["final_norm"]),
    ("hidden_states.-1", ["final_norm"]),
    ("l_out-2", ["blocks.2.resid_post"]),
    ("hook_embed", ["embed"]),
    ("ln_final", ["final_norm"]),
]


@pytest.mark.parametrize(("name", "want"), POINT_GOLD)
def test_point_names_gold(name, want):
    assert resolve_points(name, 4) == want


@pytest.mark.parametrize("name", ["blocks.4.resid_post", "blocks.-5.resid_post", "blocks.1.resid", "nonsense",
                                  "blocks.x.attn_out", "blocks.3:1.mlp_out", "hidden_states.5", "l_out-9", ""])
def test_point_name_errors_list_valid_points(name):
    with pytest.raises(LogprobeError) as e:
        resolve_points(name, 4)
    assert e.value.field == "at"
    assert "resid_post" in str(e.value)  # the message lists what is valid


def test_point_names_in_forward_order():
    names = point_names(2)
    assert names[0] == "embed" and names[-1] == "final_norm" and len(names) == 2 + 2 * 5
    assert names[1:6] == ["blocks.0.resid_pre", "blocks.0.attn_out", "blocks.0.resid_mid", "blocks.0.mlp_out",
                          "blocks.0.resid_post"]


# n = 6 tokens, p = 5 of prompt: "The capital of France is" | " Paris"
POSITION_GOLD = [
    ("all", (0, 1, 2, 3, 4, 5)),
    ("prompt", (0, 1, 2, 3, 4)),
    ("continuation", (5,)),
    ("last", (5,)),
    ("last_prompt", (4,)),
    (2, (2,)),
    (-1, (5,)),
    ((1, 3), (1, 2)),
    ((-2, None), (4, 5)),
    ((3, 3), ()),
    ((0, -4), (0, 1)),
]


@pytest.mark.parametrize(("positions", "want"), POSITION_GOLD)
def test_positions_gold(positions, want):
    assert resolve_positions(positions, 6, 5, "positions") == want


@pytest.mark.parametrize("positions", [6, -7, (0, 7), (-8, None), (5, 9)])
def test_positions_outside_request(positions):
    with pytest.raises(LogprobeError, match="outside the request"):
        resolve_positions(positions, 6, 5, "capture[0].positions")


# -- tiny native model vs transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    d, ref = tiny_dirs["llama"]
    return Scorer(str(d), device="cpu", dtype="float32", progress=False), ref


def _ids(n, seed=0, lo=2, hi=250):
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_capture_equals_transformers_hidden_states(tiny):
    s, ref = tiny
    ids = _ids(20)
    seq = [{"prompt_token_ids": ids[:12], "completion_token_ids": ids[12:]}]
    L = ref.config.num_hidden_layers
    got = s.logprobs(seq, capture=[{"at": "hidden_states.*" if False else [f"hidden_states.{i}" for i in range(L + 1)],
                                    "positions": "all"}])[0].captures
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert [c.at for c in got] == ["embed"] + [f"blocks.{i}.resid_post" for i in range(L - 1)] + ["final_norm"]
    for c, h in zip(got, hs):
        assert c.positions == list(range(20))
        assert c.value.shape == (20, ref.config.hidden_size)
        torch.testing.assert_close(c.value.double(), h[0], atol=1e-5, rtol=0)


def test_every_point_against_a_manual_forward(tiny):
    """Each layer's points equal an independent module-by-module forward, and neighbouring layers
    differ, so a capture read one layer off would fail."""
    s, _ = tiny
    model = s.loaded.model
    ids = _ids(15, seed=1)
    names = point_names(len(model.layers))
    got = {c.at: c.value for c in s.logprobs([{"prompt_token_ids": ids[:5], "completion_token_ids": ids[5:]}],
                                             capture=[{"at": names, "positions": "all"}])[0].captures}
    from logprobe.layers.attention import AttentionMeta

    meta = AttentionMeta.packed([15])
    with torch.no_grad():
        h = model.embed_tokens(torch.tensor(ids))
        cis = model.rotary(torch.arange(15))
        want = {"embed": h}
        for i, layer in enumerate(model.layers):
            want[f"blocks.{i}.resid_pre"] = h
            a = layer.self_attn(layer.input_layernorm(h), cis, meta)
            want[f"blocks.{i}.attn_out"] = a
            h = h + a
            want[f"blocks.{i}.resid_mid"] = h
            m = layer.mlp(layer.post_attention_layernorm(h))
            want[f"blocks.{i}.mlp_out"] = m
            h = h + m
            want[f"blocks.{i}.resid_post"] = h
        want["final_norm"] = model.norm(h)
    assert list(got) == names
    for name in names:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=0, msg=name)
    for i in range(len(model.layers) - 1):
        for p in ("resid_post", "mlp_out", "attn_out"):
            assert (got[f"blocks.{i}.{p}"] - got[f"blocks.{i + 1}.{p}"]).abs().max() > 1e-2


def test_capture_reductions(tiny):
    s, _ = tiny
    ids = _ids(18, seed=2)
    seq = [{"prompt_token_ids": ids[:7], "completion_token_ids": ids[7:]}]
    v = torch.randn(64)
    caps = [{"at": "blocks.1.resid_mid", "positions": "all", "reduce": "none"},
            {"at": "blocks.1.resid_mid", "positions": "continuation", "reduce": "mean"},
            {"at": "blocks.1.resid_mid", "positions": [2, 5], "reduce": "sum"},
            {"at": "blocks.1.resid_mid", "positions": "prompt", "reduce": "last"},
            {"at": "blocks.1.resid_mid", "positions": "last_prompt", "reduce": "none"},
            {"at": "blocks.1.resid_mid", "positions": "all", "reduce": "project", "vector": v.tolist()}]
    full, mean, sm, last, lp, proj = s.logprobs(seq, capture=caps)[0].captures
    x = full.value.double()
    assert mean.positions == list(range(7, 18))
    torch.testing.assert_close(mean.value.double(), x[7:].mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(sm.value.double(), x[2:5].sum(0), atol=1e-5, rtol=0)
    assert last.positions == [6] and torch.equal(last.value, full.value[6])
    assert lp.positions == [6] and torch.equal(lp.value[0], full.value[6])
    torch.testing.assert_close(proj.value.double(), x @ v.double(), atol=1e-4, rtol=0)


def _hf_steered_logprobs(ref, ids, layer, vec, coeff, positions, op="add", module="layer"):
    """Independent reference: a transformers forward with a forward hook editing a layer's output."""
    v = vec.double()

    def edit(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        x = h[0, positions]
        if op == "add":
            x = x + coeff * v
        elif op == "add_signed":
            x = x + coeff * torch.sign(x @ v)[:, None] * v
        else:
            u = v / v.norm()
            x = x - coeff * (x @ u)[:, None] * u
        h[0, positions] = x
        return (h, *out[1:]) if isinstance(out, tuple) else h

    target = ref.model.layers[layer] if module == "layer" else ref.model.layers[layer].self_attn
    handle = target.register_forward_hook(edit)
    try:
        with torch.no_grad():
            logits = ref(torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        handle.remove()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("op", ["add", "add_signed", "project_out"])
def test_steering_equals_a_transformers_forward_hook(tiny, op):
    s, ref = tiny
    ids = _ids(24, seed=3)
    vec = torch.randn(64) * 0.5
    seq = [{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]}]
    got = s.logprobs(seq, steer=[{"at": "blocks.0.resid_post", "vector": vec, "coeff": 3.0, "op": op,
                                  "positions": [4, 20]}])[0].logprobs
    want = _hf_steered_logprobs(ref, ids, 0, vec, 3.0, list(range(4, 20)), op)
    plain = _hf_steered_logprobs(ref, ids, 0, vec, 0.0, [], "add")
    assert (want - plain).abs().max() > 1e-3  # the steering matters
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


def test_steering_attn_out_equals_hook_on_attention(tiny):
    s, ref = tiny
    ids = _ids(16, seed=4)
    vec = torch.randn(64)
    seq = [{"prompt_token_ids": ids[:3], "completion_token_ids": ids[3:]}]
    got = s.logprobs(seq, steer=[{"at": "blocks.1.attn_out", "vector": vec.tolist(), "coeff": -2.0}])[0].logprobs
    want = _hf_steered_logprobs(ref, ids, 1, vec, -2.0, list(range(16)), "add", module="attn")[2:]
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


def test_noop_steering_is_bitwise_plain(tiny):
    s, _ = tiny
    seqs = [{"prompt_token_ids": _ids(9, seed=i), "completion_token_ids": _ids(14, seed=10 + i)} for i in range(3)]
    plain = s.logprobs(seqs)
    v = torch.randn(64)
    for steer in ([{"at": "blocks.0.resid_post", "vector": v, "coeff": 0}],
                  [{"at": "blocks.*.resid_mid", "vector": torch.zeros(64), "coeff": 5.0}],
                  [{"at": "blocks.1.mlp_out", "vector": v, "coeff": 2.0, "positions": [3, 3]}],
                  [{"at": "blocks.0.resid_pre", "vector": {1: v.tolist()}, "coeff": 1.0}]):  # no vector at layer 0
        got = s.logprobs(seqs, steer=steer)
        for a, b in zip(got, plain):
            assert torch.equal(a.logprobs, b.logprobs), steer


def test_capture_leaves_logprobs_bitwise_unchanged(tiny):
    s, _ = tiny
    seqs = [{"prompt_token_ids": _ids(9, seed=i), "completion_token_ids": _ids(30, seed=20 + i)} for i in range(4)]
    plain = s.logprobs(seqs)
    for caps in ([{"at": "blocks.*.resid_post", "positions": "prompt"}],
                 [{"at": "blocks.0.mlp_out", "positions": "all", "reduce": "mean"}],  # feeds the last token too
                 [{"at": "final_norm", "positions": "last"}]):
        got = s.logprobs(seqs, capture=caps)
        for a, b in zip(got, plain):
            assert torch.equal(a.logprobs, b.logprobs), caps


def test_steering_later_positions_leaves_earlier_bitwise(tiny):
    s, _ = tiny
    ids = _ids(30, seed=5)
    seq = [{"prompt_token_ids": ids[:10], "completion_token_ids": ids[10:]}]  # logprobs[j] scores ids[10 + j]
    plain = s.logprobs(seq)[0].logprobs
    p = 18
    got = s.logprobs(seq, steer=[{"at": "blocks.*.resid_post", "vector": torch.randn(64), "coeff": 4.0,
                                  "positions": [p, None]}])[0].logprobs
    k = p - 10 + 1  # tokens up to and including ids[p] are predicted by rows < p
    assert torch.equal(got[:k], plain[:k])
    assert (got[k:] - plain[k:]).abs().max() > 1e-3


def test_companions_do_not_change_captures_or_scores(tiny):
    s, _ = tiny
    v = torch.randn(64)
    mine = {"prompt_token_ids": _ids(20, seed=7), "completion_token_ids": _ids(25, seed=8)}
    others = [{"prompt_token_ids": _ids(20, seed=7) if i % 2 else _ids(12, seed=30 + i),
               "completion_token_ids": _ids(10 + i, seed=40 + i)} for i in range(5)]
    steer = [{"at": "blocks.0.resid_post", "vector": v, "coeff": 2.0, "positions": "continuation"}]
    caps = [{"at": "blocks.1.resid_post", "positions": "all", "reduce": "mean"},
            {"at": "blocks.0.attn_out", "positions": "continuation"}]
    alone = s.logprobs([mine], capture=caps, steer=steer)[0]
    # companions with other (or no) steering, sharing a prefix with an unsteered twin, in small chunks
    for scorer in (s, Scorer(s.loaded, max_batch_tokens=16, progress=False)):
        jobs = [scorer.logprobs_job(others[:2]), scorer.logprobs_job([mine], capture=caps, steer=steer),
                scorer.logprobs_job(others[2:], steer=[{"at": "blocks.1.mlp_out", "vector": -v, "coeff": 1.0}])]
        results = scorer.engine.run([r for j in jobs for r in j.requests])
        got = jobs[1].finish(results[2:3])[0]
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-6, rtol=0)
        for a, b in zip(got.captures, alone.captures):
            assert a.positions == b.positions
            torch.testing.assert_close(a.value, b.value, atol=1e-5, rtol=0)


def test_deterministic_mode_captures_and_steering_are_bitwise_batch_invariant(tiny):
    s, _ = tiny
    det = Scorer(s.loaded, deterministic=True, progress=False)
    det_small = Scorer(s.loaded, deterministic=True, max_batch_tokens=24, progress=False)
    v = torch.randn(64)
    mine = {"prompt_token_ids": _ids(20, seed=9), "completion_token_ids": _ids(30, seed=10)}
    others = [{"prompt_token_ids": _ids(20, seed=9), "completion_token_ids": _ids(12, seed=50 + i)} for i in range(3)]
    steer = [{"at": "blocks.1.resid_pre", "vector": v, "coeff": 1.5}]
    caps = [{"at": "blocks.*.resid_post", "positions": "all", "reduce": "sum"},
            {"at": "final_norm", "positions": "last"}]
    alone = det.logprobs([mine], capture=caps, steer=steer)[0]
    for scorer in (det, det_small):
        got = scorer.logprobs(others + [mine], capture=caps, steer=steer)[-1]
        assert torch.equal(got.logprobs, alone.logprobs)
        for a, b in zip(got.captures, alone.captures):
            assert torch.equal(a.value, b.value), a.at


def test_chunked_capture_matches_whole(tiny):
    s, _ = tiny
    small = Scorer(s.loaded, max_batch_tokens=8, progress=False)
    seq = [{"prompt_token_ids": _ids(5, seed=11), "completion_token_ids": _ids(27, seed=12)}]
    caps = [{"at": "blocks.1.resid_post", "positions": "all"},
            {"at": "blocks.0.mlp_out", "positions": "all", "reduce": "mean"},
            {"at": "embed", "positions": "last"}]
    steer = [{"at": "blocks.0.resid_post", "vector": torch.randn(64), "coeff": 1.0, "positions": [6, 20]}]
    a = s.logprobs(seq, capture=caps, steer=steer)[0]
    b = small.logprobs(seq, capture=caps, steer=steer)[0]
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    for x, y in zip(a.captures, b.captures):
        assert x.positions == y.positions
        torch.testing.assert_close(x.value, y.value, atol=1e-5, rtol=0)


def test_perplexity_capture_and_steer(tiny):
    s, ref = tiny
    ids = _ids(40, seed=13)
    res = s.perplexity(ids, context_length=16, stride=8, capture=[{"at": "blocks.0.resid_post", "positions": "all"}])
    (cap,) = res.captures[0]
    assert cap.positions == list(range(40))  # text tokens, the prefix token not counted
    stream = [s.tokenizer.prefix_id] + ids
    from logprobe.scoring.windows import make_windows

    last = make_windows("sliding", len(stream), 16, 8)[-1]  # the window that scores the last token
    assert last.begin == 32
    with torch.no_grad():
        hs = ref(torch.tensor([stream[last.begin:]]), output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(cap.value[-1].double(), hs[0, -1], atol=1e-5, rtol=0)
    plain = s.perplexity(ids, context_length=16, stride=8)
    zero = s.perplexity(ids, context_length=16, stride=8, steer=[{"at": "embed", "vector": torch.randn(64), "coeff": 0}])
    assert zero.nll_mean == plain.nll_mean
    steered = s.perplexity(ids, context_length=16, stride=8, steer=[{"at": "embed", "vector": torch.randn(64),
                                                                      "coeff": 1.0}])
    assert steered.nll_mean != plain.nll_mean
    with pytest.raises(LogprobeError, match="prompt/continuation"):
        s.perplexity(ids, capture=[{"at": "embed", "positions": "prompt"}])


# -- vectors ---------------------------------------------------------------------------------------


def test_vector_files_round_trip_and_gguf_layer_semantics(tiny, tmp_path):
    s, ref = tiny
    dirs = {1: torch.randn(64)}
    gg = write_gguf(tmp_path / "cv.gguf", dirs)
    st = write_safetensors(tmp_path / "cv.safetensors", dirs)
    for path in (gg, st):
        got = read_vector_file(path, 64, 2)
        assert list(got) == ["blocks.1.resid_post"] and torch.equal(got["blocks.1.resid_post"], dirs[1])
    ids = _ids(12, seed=14)
    seq = [{"prompt_token_ids": ids[:2], "completion_token_ids": ids[2:]}]
    a = s.logprobs(seq, steer=[{"vector": str(gg), "coeff": 2.0}])[0].logprobs  # no 'at': blocks.1.resid_post
    b = s.logprobs(seq, steer=[{"at": "l_out-1", "vector": dirs[1], "coeff": 2.0}])[0].logprobs
    assert torch.equal(a, b)
    with pytest.raises(LogprobeError, match="layer 0"):
        write_gguf(tmp_path / "bad.gguf", {0: torch.randn(64)})


def test_direction_from_states():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(8, generator=g)
    d /= d.norm()
    neg = torch.randn(20, 8, generator=g)
    pos = neg + 3.0 * d + 0.01 * torch.randn(20, 8, generator=g)
    torch.testing.assert_close(direction_from_states(pos, neg, "mean_diff").double(), (pos - neg).double().mean(0))
    pca = direction_from_states(pos, neg, "pca_diff")
    assert float(pca @ d) > 0.99  # unit, signed toward the positives
    assert float(direction_from_states(neg, pos, "pca_diff") @ d) < -0.99


def test_train_vector_steers_toward_positive(tiny, tmp_path):
    s, _ = tiny
    pos, neg = ["ab ab ab", "cd cd ab", "ab ef ab"], ["xy xy xy", "zw zw xy", "xy uv xy"]
    vec = s.train_vector(pos, neg, layers=[1], method="pca_diff")
    assert vec.layers == [1] and abs(float(vec.directions[1].norm()) - 1) < 1e-5
    states = s.last_token_states(pos + neg, [1])[:, 0]  # [6, H]
    proj = states @ vec.directions[1]
    assert proj[:3].mean() > proj[3:].mean()
    path = vec.save_gguf(tmp_path / "v.gguf")
    assert torch.equal(read_vector_file(path, 64, 2)["blocks.1.resid_post"], vec.directions[1])


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field", "text"), [
    ({"steer": [{"at": "blocks.0.resid_post", "vector": [1.0, 2.0]}]}, "steer[0].vector", "hidden size is 64"),
    ({"steer": [{"at": "blocks.2.resid_post", "vector": [0.0] * 64}]}, "steer[0].at", "out of range"),
    ({"capture": [{"at": "blocks.0.resid"}]}, "capture[0].at", "valid points"),
    ({"capture": [{"at": "embed", "positions": [0, 99]}]}, "capture[0].positions", "outside the request"),
    ({"steer": [{"at": "embed", "vector": [0.0] * 64, "positions": 40}]}, "steer[0].positions", "outside"),
    ({"capture": [{"at": "embed", "reduce": "max"}]}, "capture[0].reduce", "unknown reduction"),
    ({"capture": [{"at": "embed", "reduce": "project"}]}, "capture[0].vector", "is missing"),
    ({"steer": [{"at": "embed", "vector": [0.0] * 64, "op": "mul"}]}, "steer[0].op", "unknown op"),
    ({"steer": [{"at": "embed", "vector": [float("nan")] * 64}]}, "steer[0].vector", "NaN"),
    ({"steer": [{"at": "embed", "vector": [1.0] * 64, "coeff": {5: 1.0}}]}, "steer[0].coeff", "out of range"),
    ({"steer": [{"vector": [1.0] * 64}]}, "steer[0].at", "is missing"),
    ({"steer": [{"at": "embed", "vector": "/no/such.gguf"}]}, "steer[0].vector", "not a file"),
    ({"capture": [{"at": "embed", "colour": 1}]}, "capture[0].colour", "not a known field"),
    ({"capture": [{"at": "embed", "positions": [3, 3]}]}, "capture[0].positions", "selects no token"),
])
def test_bad_hook_input(tiny, kwargs, field, text):
    s, _ = tiny
    with pytest.raises(LogprobeError) as e:
        s.logprobs([{"prompt_token_ids": [5, 6], "completion_token_ids": [7, 8]}], **kwargs)
    assert e.value.field.startswith(field) or field in str(e.value), str(e.value)
    assert text in str(e.value)


def test_transformers_backend_refuses_hooks(tiny_dirs):
    d, _ = tiny_dirs["gpt2"]
    s = Scorer(str(d), device="cpu", progress=False)
    with pytest.raises(LogprobeError, match="no hook points"):
        s.logprobs([{"prompt_token_ids": [5], "completion_token_ids": [6]}], capture=[{"at": "embed"}])


# -- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_captures_and_steering_vs_transformers(default_scorer, default_reference):
    s, ref = default_scorer, default_reference
    ids = s.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    seq = [{"prompt_token_ids": ids[:6], "completion_token_ids": ids[6:]}]
    got = s.logprobs(seq, capture=[{"at": ["hidden_states.0", "hidden_states.10", "hidden_states.30"]}])[0]
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for c, h in zip(got.captures, (hs[0], hs[10], hs[30])):
        torch.testing.assert_close(c.value.double(), h[0], atol=1e-4, rtol=1e-5)
    vec = torch.randn(576, generator=torch.Generator().manual_seed(0))
    steered = s.logprobs(seq, steer=[{"at": "blocks.12.resid_post", "vector": vec, "coeff": 2.0,
                                      "positions": "prompt"}])[0].logprobs
    want = _hf_steered_logprobs(ref, ids, 12, vec, 2.0, list(range(6)))
    torch.testing.assert_close(steered.double(), want[5:], atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_group_sums_repeat_bitwise_on_cuda():
    """A "sum" capture's rows (and stacked steering deltas) are added in one fixed order on CUDA:
    20 runs give the same bits (CUDA's index_add_ does not), those of the CPU's row-order sum."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(50_000, 256, device="cuda", generator=g) * 100
    groups = torch.randint(0, 3, (50_000,), device="cuda", generator=g)
    runs = [add_rows(torch.zeros(3, 256, device="cuda"), groups, x) for _ in range(20)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    cpu = add_rows(torch.zeros(3, 256), groups.cpu(), x.cpu())  # index_add_: row order
    assert torch.equal(runs[0].cpu(), cpu)

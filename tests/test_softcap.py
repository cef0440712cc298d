"""Final-logit soft-capping: ``cap * tanh(logits / cap)`` in float32 inside the log-prob head,
before the temperature (transformers' order: the model caps its logits, generation's temperature
warper then divides them), with every head option, against a float64 full-logits reference.

* The chunked PyTorch head: plain and deterministic mode, odd chunk sizes, per-row temperatures,
  entropy, ranks and top-k (20 and 64).
* The fused Triton head on CPU under ``TRITON_INTERPRET=1`` (a fresh process), tiny shapes.
* Gemma 3 with ``final_logit_softcapping`` set: a tiny random checkpoint saved by transformers,
  scored natively, against transformers' own forward in float64 (which caps its logits), with
  the cap small enough that it changes the numbers (checked), bitwise across chunks and shared
  prefixes in deterministic mode.
"""

from __future__ import annotations

import importlib.util
import json
import random
import textwrap

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, run_interpreted

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.layers.logprob_head import HeadParams, logprob_head
from logprobe.loading import load_model

CAP = 3.0
TOL = 1e-4


def reference(h, p: HeadParams, temp, cap_first: bool = True):
    """float64 logits [N, V] and log-probs: softcap, then / T (``cap_first=False``: the other order)."""
    z = h.double() @ p.weight.double().T
    if p.bias is not None:
        z = z + p.bias.double()
    z = z * p.scale
    t = torch.as_tensor(temp, dtype=torch.float64).reshape(-1, 1)
    if cap_first:
        z = torch.tanh(z / p.softcap) * p.softcap / t
    else:
        z = torch.tanh(z / t / p.softcap) * p.softcap
    return z, torch.log_softmax(z, -1)


def check(out, z, lp, y, top_k: int) -> None:
    """Every head output against the float64 reference (ids exactly: ties broken by smaller id)."""
    tgt = lp.gather(1, y[:, None])[:, 0]
    assert (out.logprobs.double() - tgt).abs().max() < TOL
    assert (out.logsumexp.double() - torch.logsumexp(z, -1)).abs().max() < TOL
    assert (out.entropy.double() - (-(lp.exp() * lp).sum(-1))).abs().max() < TOL
    assert torch.equal(out.ranks, (z > z.gather(1, y[:, None])).sum(-1))
    if top_k:
        vals, ids = lp.sort(dim=1, descending=True, stable=True)
        assert (out.topk_logprobs.double() - vals[:, :top_k]).abs().max() < TOL
        assert_ids(out.topk_ids, ids[:, :top_k], lp)


def assert_ids(got, want, lp) -> None:
    """Top-k ids equal to the float64 order, except where float32 cannot tell two logits apart
    (a cap bends large logits together: they may round to one float32 value, then the smaller
    id comes first): there the two float64 log-probs are within 1e-5."""
    diff = got != want
    gap = (lp.gather(1, got) - lp.gather(1, want)).abs()
    assert diff.float().mean() < 0.05 and (gap[diff].max() if diff.any() else 0.0) < 1e-5


def case(N=29, H=32, V=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    # logits of spread ~6: a cap of 3 bends most of them
    p = HeadParams(weight=torch.randn(V, H, generator=g) / H**0.5 * 6, bias=torch.randn(V, generator=g) * 0.1,
                   scale=0.9, softcap=CAP)
    y = torch.randint(0, V, (N,), generator=g)
    temp = torch.rand(N, generator=g) * 1.5 + 0.4  # per-row temperatures
    return h, p, y, temp


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("chunks", [(512, 8192), (7, 96)])
@pytest.mark.parametrize("top_k", [0, 20, 64])
def test_torch_head_softcap_matches_float64(deterministic, chunks, top_k):
    h, p, y, temp = case()
    out = logprob_head(h, p, y, temp, top_k=top_k, entropy=True, token_chunk=chunks[0], vocab_chunk=chunks[1],
                       deterministic=deterministic, backend="torch")
    z, lp = reference(h, p, temp)
    check(out, z, lp, y, top_k)
    # the cap and its place before the temperature both matter at this size
    _, plain = reference(h, HeadParams(p.weight, p.bias, p.scale, 1e9), temp)
    _, swapped = reference(h, p, temp, cap_first=False)
    got = out.logprobs.double()
    assert (got - plain.gather(1, y[:, None])[:, 0]).abs().max() > 0.1
    assert (got - swapped.gather(1, y[:, None])[:, 0]).abs().max() > 0.1


def test_softcap_bounds_logits():
    """A capped head's log-probs stay within the bound the cap implies: |z| <= cap, so every
    log-prob is >= -2 cap - log V, whatever the hidden states' size."""
    h, p, y, _ = case()
    out = logprob_head(h * 1000, p, y, top_k=5)
    assert bool((out.logprobs >= -2 * CAP - torch.log(torch.tensor(700.0))).all())
    assert bool((out.topk_logprobs <= 0).all())


@pytest.mark.slow  # slow tier (pytest -m slow): 7 s in the interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_fused_kernel_softcap_matches_float64():
    code = textwrap.dedent("""
        import json, torch
        from test_softcap import case, reference
        from logprobe.kernels.logprob_head import KernelConfig, fused_logprob_head
        cfg = KernelConfig(block_m=16, block_n=64, block_k=16, group_m=2, waves=2, wide_block_m=16,
                           topk_waves=2)
        res = {}
        for top_k, det in ((0, False), (7, False), (64, True)):
            h, p, y, temp = case(N=13, H=24, V=300, seed=top_k)
            out = fused_logprob_head(h, p.weight, y, 1.0 / temp, bias=p.bias, scale=p.scale, softcap=p.softcap,
                                     top_k=top_k, entropy=True, config=cfg, deterministic=det)
            z, lp = reference(h, p, temp)
            r = {"logprobs": (out[0].double() - lp.gather(1, y[:, None])[:, 0]).abs().max().item(),
                 "lse": (out[1].double() - torch.logsumexp(z, -1)).abs().max().item(),
                 "entropy": (out[3].double() + (lp.exp() * lp).sum(-1)).abs().max().item(),
                 "ranks": torch.equal(out[2], (z > z.gather(1, y[:, None])).sum(-1))}
            if top_k:
                vals, ids = lp.sort(dim=1, descending=True, stable=True)
                diff = out[4] != ids[:, :top_k]
                r["ids"] = not diff.any() or (lp.gather(1, out[4]) - lp.gather(1, ids[:, :top_k])).abs()[diff].max().item() < 1e-5
                r["topk"] = (out[5].double() - vals[:, :top_k]).abs().max().item()
            res[f"k{top_k}"] = r
        print(json.dumps(res))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(res) == ["k0", "k64", "k7"]
    for name, d in res.items():
        assert d["ranks"] and d.get("ids", True), (name, d)
        assert max(d["logprobs"], d["lse"], d["entropy"], d.get("topk", 0.0)) < TOL, (name, d)


# --- Gemma 3 with a final logit soft-cap --------------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers.models.gemma3 import modeling_gemma3 as hfg3  # noqa: E402

GEMMA_CAP = 2.0
WINDOW = 12


def _norm64(self, x):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.double())


@pytest.fixture(scope="module")
def capped_gemma(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg3.Gemma3RMSNorm, "forward", _norm64)
    d = tmp_path_factory.mktemp("gemma3_capped")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, query_pre_attn_scalar=12, sliding_window=WINDOW, max_position_embeddings=256,
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=GEMMA_CAP, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM._from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else 0.15) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))
    yield d, model.double()
    mp.undo()


def _ref_logprobs(model, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits / temperature, -1)  # transformers caps in forward; T comes after


def test_gemma3_final_softcap_matches_float64(capped_gemma):
    path, ref = capped_gemma
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    model = scorer.loaded.model
    assert scorer.info.backend == "native" and model.head_params().softcap == GEMMA_CAP
    rng = random.Random(2)
    seqs = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (40, 75)]
    worst = 0.0
    worst_uncapped = 0.0
    for temp in (1.0, 0.6):
        reqs = [ScoreRequest(t, 1, temperature=temp, top_k=64, entropy=True) for t in seqs]
        for r, res in zip(reqs, scorer.engine.run(reqs)):
            lp = _ref_logprobs(ref, r.tokens, temp)[:-1]
            y = torch.tensor(r.tokens[1:])
            worst = max(worst, (res.logprobs.double() - lp.gather(1, y[:, None])[:, 0]).abs().max().item())
            vals, ids = lp.sort(dim=1, descending=True, stable=True)
            assert_ids(res.topk_ids, ids[:, :64], lp)
            assert (res.topk_logprobs.double() - vals[:, :64]).abs().max() < TOL
            assert (res.entropy.double() + (lp.exp() * lp).sum(-1)).abs().max() < TOL
    ref.config.final_logit_softcapping = None  # the cap matters: the uncapped model is far off
    try:
        for t in seqs:
            lp = _ref_logprobs(ref, t)[:-1].gather(1, torch.tensor(t[1:])[:, None])[:, 0]
            got = scorer.engine.run([ScoreRequest(t, 1)])[0].logprobs.double()
            worst_uncapped = max(worst_uncapped, (got - lp).abs().max().item())
    finally:
        ref.config.final_logit_softcapping = GEMMA_CAP
    print(f"gemma3 capped: max |delta| {worst:.2e}; uncapped reference {worst_uncapped:.2e}")
    assert worst < TOL and worst_uncapped > 0.1


def test_gemma3_softcap_chunks_and_prefixes_bitwise(capped_gemma):
    path, _ = capped_gemma
    rng = random.Random(4)
    ctx = [rng.randrange(2, VOCAB) for _ in range(30)]  # a shared prefix longer than the window
    reqs = [ScoreRequest(ctx + [rng.randrange(2, VOCAB) for _ in range(n)], len(ctx), top_k=k, entropy=True)
            for n, k in ((20, 64), (35, 0), (9, 3))]
    reqs.append(ScoreRequest([rng.randrange(2, VOCAB) for _ in range(90)], 5, top_k=30))
    loaded = load_model(str(path), "cpu", "float32")
    single = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [single.engine.run([r])[0] for r in reqs]
    for budget, share in ((40, True), (64, False), (1 << 20, True)):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=share)
        out = Scorer(loaded, config=cfg).engine.run(reqs)
        for a, b in zip(alone, out):
            for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (budget, share, name)

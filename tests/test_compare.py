"""``Scorer.compare`` / ``logprobe compare``: KL(R || Q) and friends against float64 full-logits references."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import make_hf_dir, write_tiny_gguf

import logprobe.cli.compare as compare_cmd
from logprobe import LogprobeError, Scorer
from logprobe.cli.main import main
from logprobe.layers.logprob_head import HeadParams
from logprobe.scoring.compare import kl_head

TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
        "Locally nicknamed 'La dame de fer', it was constructed as the centrepiece of the 1889 World's Fair, "
        "and to crown the centennial anniversary of the French Revolution. Although initially criticised by "
        "some of France's leading artists and intellectuals for its design, it has since become a global "
        "cultural icon of France and one of the most recognisable structures in the world. ")


def _ref_kl(hq, pq: HeadParams, hr, pr: HeadParams, y):
    """float64 full logits -> log_softmax -> KL(R || Q), target log-probs, argmaxes."""
    def lp(h, p):
        z = h.double() @ p.weight.double().T  # [N, V]
        if p.bias is not None:
            z = z + p.bias.double()
        z = z * p.scale
        if p.softcap is not None:
            z = torch.tanh(z / p.softcap) * p.softcap
        return torch.log_softmax(z, -1)

    lq, lr = lp(hq, pq), lp(hr, pr)
    kl = (lr.exp() * (lr - lq)).sum(-1)
    return kl, lq.gather(1, y[:, None])[:, 0], lr.gather(1, y[:, None])[:, 0], lq.argmax(-1), lr.argmax(-1)


def _heads(variant, seed=0, N=37, H=32, V=300):
    g = torch.Generator().manual_seed(seed)
    hr = torch.randn(N, H, generator=g)
    hq = hr + 0.3 * torch.randn(N, H, generator=g)  # a perturbed model: KL of order 0.1
    wr = torch.randn(V, H, generator=g) * 2 / H**0.5
    wq = wr + 0.2 * torch.randn(V, H, generator=g) / H**0.5
    kw = {}
    if variant == "bias_scale":
        kw = {"bias": torch.randn(V, generator=g), "scale": 0.7}
    if variant == "softcap":
        kw = {"softcap": 5.0}
    y = torch.randint(0, V, (N,), generator=g)
    return hq, HeadParams(wq, **kw), hr, HeadParams(wr, **kw), y


@pytest.mark.parametrize("variant", ["plain", "bias_scale", "softcap"])
def test_kl_head_matches_float64_full_logits(variant):
    hq, pq, hr, pr, y = _heads(variant)
    got = kl_head(hq, pq, hr, pr, y, token_chunk=7, vocab_chunk=64)  # several token and vocab chunks
    kl, lq, lr, aq, ar = _ref_kl(hq, pq, hr, pr, y)
    assert kl.min() > 0.01  # a real difference, so the check below is not of zeros
    assert (got.kl.double() - kl).abs().max() < 2e-5
    assert (got.logprobs_q.double() - lq).abs().max() < 2e-5
    assert (got.logprobs_r.double() - lr).abs().max() < 2e-5
    assert torch.equal(got.same_top, aq == ar) and not got.same_top.all()


def test_kl_head_equal_models_is_exactly_zero():
    _, _, hr, pr, y = _heads("plain", seed=1)
    got = kl_head(hr, pr, hr.clone(), HeadParams(pr.weight.clone()), y, token_chunk=16, vocab_chunk=100)
    assert torch.equal(got.kl, torch.zeros_like(got.kl)) and got.same_top.all()
    assert torch.equal(got.logprobs_q, got.logprobs_r)


def test_kl_head_vocab_mismatch():
    hq, pq, hr, pr, y = _heads("plain")
    with pytest.raises(LogprobeError, match="vocabulary"):
        kl_head(hq, pq, hr, HeadParams(pr.weight[:-1]), y)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """One tiny Llama written twice: Q4_0 (Q) and F32 (R), with float64 transformers models of each."""
    d = tmp_path_factory.mktemp("cmp")
    (d / "src").mkdir()
    hf = make_hf_dir(d / "src", "llama", seed=21)
    out = {}
    for name in ("Q4_0", "F32"):
        decoded = write_tiny_gguf(d / f"{name}.gguf", hf, name)
        ref = type(hf)(hf.config).double().eval()
        ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).double() for k, v in decoded.items()})
        out[name] = (d / f"{name}.gguf", ref)
    return out


def test_compare_end_to_end_matches_float64(tiny_pair):
    (q_path, q_ref), (r_path, r_ref) = tiny_pair["Q4_0"], tiny_pair["F32"]
    q = Scorer(str(q_path), device="cpu", dtype="float32", progress=False)
    r = Scorer(str(r_path), device="cpu", dtype="float32", progress=False)
    res = q.compare(r, TEXT, context_length=64, stride=16, return_token_stats=True)
    # the same windows, by hand: float64 reference models on each window's token ids
    job = q.perplexity_job(TEXT, context_length=64, stride=16)
    kls, nq, nr, same = [], [], [], []
    for req in job.requests:
        with torch.no_grad():
            lq = torch.log_softmax(q_ref(torch.tensor([req.tokens[:-1]])).logits[0].double(), -1)
            lr = torch.log_softmax(r_ref(torch.tensor([req.tokens[:-1]])).logits[0].double(), -1)
        rows = slice(req.score_begin - 1, None)
        y = torch.tensor(req.tokens[req.score_begin:])
        kls.append((lr[rows].exp() * (lr[rows] - lq[rows])).sum(-1))
        nq.append(-lq[rows].gather(1, y[:, None])[:, 0])
        nr.append(-lr[rows].gather(1, y[:, None])[:, 0])
        same.append(lq[rows].argmax(-1) == lr[rows].argmax(-1))
    kl, nq, nr, same = torch.cat(kls), torch.cat(nq), torch.cat(nr), torch.cat(same)
    assert res.num_tokens == len(kl) and res.num_windows == len(job.requests) > 1
    assert (torch.tensor(res.token_kl) - kl).abs().max() < 1e-5
    assert math.isclose(res.kl_mean, float(kl.mean()), rel_tol=1e-4)
    assert math.isclose(res.kl_percentiles["50.0"], float(np.percentile(kl.numpy(), 50)), rel_tol=1e-3)
    assert math.isclose(res.ppl_q, math.exp(float(nq.mean())), rel_tol=1e-5)
    assert math.isclose(res.ppl_r, math.exp(float(nr.mean())), rel_tol=1e-5)
    assert math.isclose(res.ln_ppl_ratio, float((nq - nr).mean()), abs_tol=1e-6)
    assert math.isclose(res.same_top, float(same.double().mean()), abs_tol=1e-12)
    dp = (-nq).exp() - (-nr).exp()
    assert math.isclose(res.dp_mean, float(dp.mean()), abs_tol=1e-6)
    assert math.isclose(res.dp_rms, float(dp.pow(2).mean().sqrt()), rel_tol=1e-4)
    assert res.kl_mean > 0 and res.kl_max >= res.kl_percentiles["99.0"] >= res.kl_percentiles["50.0"]


def test_compare_reference_against_itself_is_exactly_zero(tiny_pair):
    r = Scorer(str(tiny_pair["F32"][0]), device="cpu", dtype="float32", progress=False)
    res = r.compare(r, TEXT, context_length=64, stride=16, return_token_stats=True)
    assert all(k == 0.0 for k in res.token_kl) and res.kl_max == 0.0 and res.same_top == 1.0
    assert res.ppl_q == res.ppl_r and res.ln_ppl_ratio == 0.0 and res.dp_rms == 0.0


def test_compare_refuses_another_vocabulary(tiny_pair, tiny_dirs):
    q = Scorer(str(tiny_pair["Q4_0"][0]), device="cpu", progress=False)
    with pytest.raises(LogprobeError, match="vocabulary"):
        q.compare(str(tiny_dirs["llama"][0]), TEXT, context_length=64)


def test_cli_compare(tiny_pair, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    args = ["compare", "--model", str(tiny_pair["Q4_0"][0]), "--reference", str(tiny_pair["F32"][0]),
            "--text-file", str(f), "--context-length", "64", "--device", "cpu"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kl_mean"] > 0 and d["num_tokens"] > 100 and set(d["kl_percentiles"]) >= {"99.9", "99.0", "50.0"}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Mean    KLD:" in out and "Same top p:" in out and "Mean PPL(Q)/PPL(R)" in out
    assert main(args[:1] + ["--model", str(tiny_pair["Q4_0"][0]), "--reference", str(tmp_path / "nope"),
                            "--text-file", str(f), "--device", "cpu"]) == 2
    # --plot: an HTML page with one point per scored token, the report below it
    page = tmp_path / "kl.html"
    assert main(args + ["--json", "--plot", str(page)]) == 0
    n = json.loads(capsys.readouterr().out)["num_tokens"]
    text = page.read_text()
    raw = text.split('<polyline points="')[1].split('"')[0].split()
    assert len(raw) == n and "Mean    KLD:" in text and text.startswith("<!doctype html>")
    assert main(args + ["--plot", str(tmp_path / "no" / "dir" / "kl.html")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_cli_compare_reads_every_model_option(tmp_path, monkeypatch):
    """compare builds its EngineConfig where every command does: --no-tp-invariant, --quiet and
    --max-batch-tokens reach it (they were dropped silently when compare built its own)."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    seen = []

    class Built(Exception):
        pass

    def scorer(loaded, config, cache=None):
        seen.append(config)
        raise Built

    monkeypatch.setattr(compare_cmd, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(compare_cmd, "Scorer", scorer)
    with pytest.raises(Built):
        main(["compare", "--reference", "r", "--text-file", str(f), "--deterministic", "--no-tp-invariant",
              "--quiet", "--max-batch-tokens", "96"])
    config = seen[0]
    assert config.progress is False and config.max_batch_tokens == 96
    assert config.deterministic and config.deterministic.tp_invariant is False


def test_kl_plot_html_points():
    from logprobe.scoring.compare import kl_plot_html

    page = kl_plot_html([0.0, 2.0, 1.0], "t <q>", "sum & more", smooth=2)
    raw = [tuple(map(float, p.split(","))) for p in page.split('<polyline points="')[1].split('"')[0].split()]
    assert [p[0] for p in raw] == [40.0, 500.0, 960.0]  # first and last token at the plot edges
    assert raw[1][1] == 40.0 and raw[0][1] == 280.0  # max at the top, 0 at the bottom
    smooth = [tuple(map(float, p.split(","))) for p in page.split('<polyline points="')[2].split('"')[0].split()]
    assert [p[1] for p in smooth] == [280.0, 160.0, 100.0]  # moving averages 0, 1, 1.5 of 2-token windows
    assert "t &lt;q&gt;" in page and "sum &amp; more" in page
    with pytest.raises(LogprobeError, match="token_kl"):
        kl_plot_html([], "t", "s")


@pytest.fixture(scope="session")
def smollm_f16_q40(default_scorer, tmp_path_factory):
    """The default model's weights as an F16 GGUF (the reference R) and that reference
    re-quantized to Q4_0 by gguf-py (Q, embedding Q8_0), metadata copied."""
    from pathlib import Path

    from quant_helpers import requantize_gguf

    d = tmp_path_factory.mktemp("smollm2-gguf")
    src = Path(default_scorer.info.path)
    r = requantize_gguf(src, d / "f16.gguf", "F16")
    q = requantize_gguf(r, d / "q4_0.gguf", "Q4_0", "Q8_0")
    return r, q


@pytest.mark.slow  # slow tier (pytest -m slow): the default model against its float32 self
def test_default_model_compare(default_scorer, smollm_f16_q40):
    r_path, q_path = smollm_f16_q40
    r = Scorer(str(r_path), device="cpu", dtype="float32", progress=False)
    q = Scorer(str(q_path), device="cpu", dtype="float32", progress=False)
    text = TEXT * 3
    rq = q.compare(r, text, context_length=256, stride=64)
    assert rq.kl_mean > 0.01 and rq.ppl_q >= rq.ppl_r and rq.same_top < 1.0
    rr = r.compare(r, text, context_length=256, stride=64)
    assert rr.kl_max == 0.0 and rr.kl_min == 0.0 and rr.ppl_ratio == 1.0
    # the Q4_1 default against F16 of its own dequantized weights: only f16 rounding differs
    qd = default_scorer.compare(r, text, context_length=256, stride=64)
    assert 0 < qd.kl_mean < 1e-3 < rq.kl_mean

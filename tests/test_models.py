"""Native model and transformers backend vs an independent float64 transformers forward."""

from __future__ import annotations

import pytest
import torch
from helpers import random_sequences, ref_logprobs

from logprobe import Scorer
from logprobe.engine.request import ScoreRequest

KINDS = ["llama", "llama3", "qwen2", "qwen3", "mistral", "gpt2"]
TOL = 1e-4


@pytest.fixture(scope="module")
def scorers(tiny_dirs):
    return {k: Scorer(str(d), device="cpu", dtype="float32", progress=False) for k, (d, _) in tiny_dirs.items()}


def test_backends(scorers):
    assert {k: s.info.backend for k, s in scorers.items()} == {
        "llama": "native", "llama3": "native", "qwen2": "native", "qwen3": "native",
        "mistral": "native", "gpt2": "transformers"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_reference(kind, temperature, scorers, tiny_dirs):
    scorer, ref = scorers[kind], tiny_dirs[kind][1]
    seqs = random_sequences()
    out = scorer.logprobs(seqs, temperature=temperature, top_k=5, entropy=True)
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp = ref_logprobs(ref, ids, temperature)  # [L, V]
        rows = lp[len(seq["prompt_token_ids"]) - 1: len(ids) - 1]  # rows predicting completion tokens
        tgt = rows.gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        assert (res.logprobs.double() - tgt).abs().max() < TOL
        ent = -(rows.exp() * rows).sum(-1)
        assert (res.entropy.double() - ent).abs().max() < TOL
        top_lp, top_ids = rows.topk(5, dim=-1)
        assert (res.topk_logprobs.double() - top_lp).abs().max() < TOL
        assert torch.equal(res.topk_ids, top_ids)
        assert torch.equal(res.ranks == 0, rows.argmax(-1) == torch.tensor(seq["completion_token_ids"]))


@pytest.mark.parametrize("kind", KINDS)
def test_score_and_perplexity_match_reference(kind, scorers, tiny_dirs):
    scorer, ref = scorers[kind], tiny_dirs[kind][1]
    tok = scorer.tokenizer
    # score: byte tokens, prompt + continuation
    res = scorer.score("hello wor", ["ld", "ms"])
    for r, cont in zip(res, ["ld", "ms"]):
        ids = tok.encode("hello wor" + cont)
        lp = ref_logprobs(ref, ids)
        n = len(tok.encode(cont))
        tgt = lp[len(ids) - n - 1: len(ids) - 1].gather(1, torch.tensor(ids[-n:])[:, None])[:, 0]
        assert abs(r.log_prob - float(tgt.sum())) < TOL
        assert r.num_tokens == n
    # perplexity: sliding windows of 24 tokens, stride 8, with the prefix token
    text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs."
    pr = scorer.perplexity(text, context_length=24, stride=8, return_token_nlls=True)
    stream = [tok.prefix_id] + tok.encode(text)
    ref_nll = []
    from logprobe.scoring.windows import sliding_windows
    for w in sliding_windows(len(stream), 24, 8):
        lp = ref_logprobs(ref, stream[w.begin:w.end])
        for j in range(w.score_begin, w.end):
            ref_nll.append(-float(lp[j - w.begin - 1, stream[j]]))
    assert pr.num_tokens == len(tok.encode(text)) == len(ref_nll)
    got = pr.token_nlls[0]
    assert max(abs(a - b) for a, b in zip(got, ref_nll)) < TOL
    assert abs(pr.nll_mean - sum(ref_nll) / len(ref_nll)) < TOL


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gpt2"])
def test_packing_is_exact(kind, scorers):
    """A sequence alone and inside a packed batch with others gives the same numbers."""
    scorer = scorers[kind]
    seqs = random_sequences(6, seed=3)
    alone = [scorer.logprobs([s])[0].logprobs for s in seqs]
    packed = scorer.logprobs(seqs)
    for a, b in zip(alone, packed):
        assert (a - b.logprobs).abs().max() < 1e-5
    # and the engine did pack them into one forward pass
    reqs = scorer.logprobs_job(seqs).requests
    from logprobe.engine.scheduler import plan_batches
    assert len(plan_batches([r.num_inputs for r in reqs], scorer.config.max_batch_tokens)) == 1


def test_attention_does_not_cross_sequences(scorers):
    """Changing another sequence in the batch never changes this one's scores."""
    scorer = scorers["llama"]
    a = ScoreRequest(list(range(2, 40)), 5)
    b1, b2 = ScoreRequest(list(range(100, 160)), 1), ScoreRequest(list(range(160, 220)), 1)
    r1 = scorer.engine.run([b1, a])[1]
    r2 = scorer.engine.run([b2, a])[1]
    assert (r1.logprobs - r2.logprobs).abs().max() < 1e-5


def test_suffix_does_not_change_prefix_scores(scorers):
    scorer = scorers["qwen2"]
    p = [5, 6, 7, 8]
    short = scorer.logprobs([{"prompt_token_ids": p, "completion_token_ids": [9, 10, 11]}])[0]
    long = scorer.logprobs([{"prompt_token_ids": p, "completion_token_ids": [9, 10, 11, 12, 13]}])[0]
    assert (short.logprobs - long.logprobs[:3]).abs().max() < 1e-5


def test_fused_projections_equal_separate(tiny_dirs):
    """q/k/v and gate/up fused at load: same numbers as the separate layers, no extra weight memory,
    the old parameter names still there (views into the fused weights)."""
    from logprobe.loading import load_model

    d, _ = tiny_dirs["qwen2"]  # q/k/v biases too
    loaded = load_model(str(d), "cpu", "float32")
    attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
    assert attn.k_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    assert attn.v_proj.bias.data_ptr() > attn.qkv_proj.bias.data_ptr()
    assert "layers.0.self_attn.q_proj.weight" in loaded.model.state_dict()
    seqs = [{"prompt_token_ids": [5, 6, 7], "completion_token_ids": [8, 9, 10, 11]}]
    fused = Scorer(loaded, progress=False).logprobs(seqs)[0].logprobs
    for layer in loaded.model.layers:
        layer.self_attn.qkv_proj = None
        layer.mlp.gate_up_proj = None
    separate = Scorer(loaded, progress=False).logprobs(seqs)[0].logprobs
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=0)

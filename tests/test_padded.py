"""RL trainers' padded and packed layouts (scoring.padded, Scorer.logprobs_padded / logprobs_packed).

Layout arithmetic is pinned by literal gold tables; numbers are checked against ``Scorer.logprobs``
on the same sequences (bitwise: the same requests) and against the float64 transformers reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_dir, random_sequences, ref_logprobs

from logprobe import Scorer
from logprobe.errors import LogprobeError
from logprobe.scoring.padded import plan_packed, plan_padded, plan_requests, scatter

# -- gold tables: the module docstring's example --------------------------------------------------

#            col:  0  1  2  3  4  5  6
ATTENTION = [[0, 0, 1, 1, 1, 1, 0],   # row 0: . . p0 p1 | r0 r1 .
             [1, 1, 1, 1, 1, 1, 1],   # row 1: p0 p1 p2 p3 | r0 r1 r2
             [0, 0, 0, 1, 1, 0, 0]]   # row 2: . . . p0 | r0 . .
RESPONSE = [[1, 1, 0],
            [1, 0, 1],
            [0, 0, 0]]


def test_plan_padded_gold():
    plan = plan_padded(torch.tensor(ATTENTION), torch.tensor(RESPONSE))
    # row 0 feeds columns 2..5 (its last scored token is column 5), row 1 all 7; row 2 scores nothing
    assert plan.index.tolist() == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    assert plan.lengths == [4, 7]
    assert plan.score_begin == [2, 4]
    # engine values: row 0 -> r0 r1 (out 0, 1); row 1 -> r0 r1 r2 (out 3, dropped, 5)
    assert plan.dest.tolist() == [0, 1, 3, -1, 5]
    assert plan.in_shape == (3, 7) and plan.out_shape == (3, 3)
    assert plan.names == ["input_ids[0]", "input_ids[1]"]


def test_plan_padded_trl_default_mask_gold():
    # logits_to_keep = 2: the response mask is attention_mask[:, -2:]
    plan = plan_padded(torch.tensor(ATTENTION), num_response_tokens=2)
    assert plan.index.tolist() == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    assert plan.lengths == [4, 7] and plan.score_begin == [3, 5]
    assert plan.dest.tolist() == [0, 2, 3]  # row 0: r1 -> out (0, 0); row 1: r1, r2 -> (1, 0), (1, 1)


def test_plan_packed_gold():
    #        index:  0  1  2  3 | 4  5  6 | 7  8
    plan = plan_packed(torch.zeros(9, dtype=torch.long), torch.tensor([0, 4, 7, 9]), torch.tensor([2, 1, 2]))
    assert plan.index.tolist() == [0, 1, 2, 3, 4, 5, 6]  # sequence 2 (length 2, score_start 2) scores nothing
    assert plan.lengths == [4, 3] and plan.score_begin == [2, 1]
    assert plan.dest.tolist() == [2, 3, 5, 6]
    assert plan.out_shape == (9,) and plan.names == ["sequence 0", "sequence 1"]


def test_scatter_and_requests_gold():
    plan = plan_padded(torch.tensor(ATTENTION), torch.tensor(RESPONSE))
    out = scatter(torch.tensor([10.0, 11.0, 20.0, 21.0, 22.0]), plan)
    assert out.tolist() == [[10.0, 11.0, 0.0], [20.0, 0.0, 22.0], [0.0, 0.0, 0.0]]
    top = scatter(torch.arange(10).view(5, 2), plan)  # [N, k] -> [bs, R, k]
    assert top.shape == (3, 3, 2) and top[1].tolist() == [[4, 5], [0, 0], [8, 9]]
    ids = torch.arange(100, 121).view(3, 7)
    reqs = plan_requests(plan, ids, 300, 512)
    assert [(r.tokens, r.score_begin) for r in reqs] == [([102, 103, 104, 105], 2),
                                                         ([107, 108, 109, 110, 111, 112, 113], 4)]


@pytest.mark.parametrize("call, field", [
    (lambda: plan_padded(torch.tensor(ATTENTION), torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]])), "response_mask[0][2]"),
    (lambda: plan_padded(torch.tensor([[1, 1, 0]]), num_response_tokens=3), "attention_mask[0]"),
    (lambda: plan_padded(torch.tensor([[1, 1, 2]]), num_response_tokens=1), "attention_mask"),
    (lambda: plan_padded(torch.tensor(ATTENTION).float(), num_response_tokens=1), "attention_mask"),
    (lambda: plan_padded(torch.tensor(ATTENTION)), "response_mask"),
    (lambda: plan_padded(torch.tensor(ATTENTION), torch.tensor(RESPONSE), num_response_tokens=2), "num_response_tokens"),
    (lambda: plan_padded(torch.tensor(ATTENTION), num_response_tokens=8), "num_response_tokens"),
    (lambda: plan_padded(torch.tensor(ATTENTION), torch.ones(2, 3)), "response_mask"),
    (lambda: plan_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), torch.tensor([0])), "score_start[0]"),
    (lambda: plan_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 4]), torch.tensor([1])), "cu_seqlens"),
    (lambda: plan_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 3, 3, 5]), torch.tensor([1, 1, 1])),
     "cu_seqlens[2]"),
    (lambda: plan_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), torch.tensor([6])), "score_start[0]"),
    (lambda: plan_requests(plan_padded(torch.tensor(ATTENTION), num_response_tokens=2), torch.zeros(3, 6).long(),
                           300, 512), "input_ids"),
])
def test_layout_errors_name_the_field(call, field):
    with pytest.raises(LogprobeError) as e:
        call()
    assert e.value.field == field


# -- numbers ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind, seed in (("llama", 0), ("qwen3", 3)):
        d = tmp_path_factory.mktemp(f"padded-{kind}")
        out[kind] = (d, make_hf_dir(d, kind, seed=seed))
    return out


@pytest.fixture(scope="module")
def scorers(models):
    return {kind: Scorer(str(d), device="cpu", dtype="float32", progress=False) for kind, (d, _) in models.items()}


@pytest.fixture(scope="module")
def det_scorer(models):
    return Scorer(str(models["qwen3"][0]), device="cpu", dtype="float32", progress=False, deterministic=True)


def verl_batch(seqs, holes: bool, seed: int = 0, pad_id: int = 0):
    """Left-padded prompts + right-padded responses (verl / OpenRLHF), response_mask with random
    zeros inside when ``holes``; also the ``logprobs`` sequences that score the same tokens."""
    g = torch.Generator().manual_seed(seed)
    P = max(len(s["prompt_token_ids"]) for s in seqs)
    R = max(len(s["completion_token_ids"]) for s in seqs) + 2
    bs = len(seqs)
    ids = torch.full((bs, P + R), pad_id, dtype=torch.long)
    am = torch.zeros(bs, P + R, dtype=torch.long)
    rm = torch.zeros(bs, R, dtype=torch.long)
    for b, s in enumerate(seqs):
        p, c = s["prompt_token_ids"], s["completion_token_ids"]
        ids[b, P - len(p):P], ids[b, P:P + len(c)] = torch.tensor(p), torch.tensor(c)
        am[b, P - len(p):P + len(c)] = 1
        rm[b, :len(c)] = 1
        if holes:
            rm[b, :len(c)] *= (torch.rand(len(c), generator=g) > 0.3).long()
    return ids, am, rm


def check_against_logprobs(scorer, ids, am, rm, out, **kw):
    """Each row alone through ``Scorer.logprobs`` (real tokens before the first scored one as the
    prompt, the rest up to the last scored one as the completion), compared bitwise."""
    L, R = ids.shape[1], rm.shape[1]
    seqs, where = [], []
    for b in range(ids.shape[0]):
        cols = [L - R + j for j in range(R) if rm[b, j]]
        if not cols:
            assert not out.logprobs[b].any()
            continue
        real = [c for c in range(L) if am[b, c] and c <= cols[-1]]
        k = real.index(cols[0])
        toks = ids[b, real].tolist()
        seqs.append({"prompt_token_ids": toks[:k], "completion_token_ids": toks[k:]})
        where.append((b, [real.index(c) - k for c in cols], [c - (L - R) for c in cols]))
    ref = scorer.logprobs(seqs, **kw)
    for (b, picks, js), r in zip(where, ref):
        assert torch.equal(out.logprobs[b, js], r.logprobs[picks])
        masked = torch.ones(R, dtype=torch.bool)
        masked[js] = False
        assert not out.logprobs[b, masked].any() and out.logprobs.dtype == torch.float32
        if r.entropy is not None:
            assert torch.equal(out.entropy[b, js], r.entropy[picks]) and not out.entropy[b, masked].any()
        if r.topk_ids is not None:
            assert torch.equal(out.topk_ids[b, js], r.topk_ids[picks])
            assert torch.equal(out.topk_logprobs[b, js], r.topk_logprobs[picks])
    return ref


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_verl_layout_matches_logprobs_and_float64(kind, models, scorers):
    scorer, ref_model = scorers[kind], models[kind][1]
    seqs = random_sequences(6, seed=11)
    ids, am, rm = verl_batch(seqs, holes=True)
    out = scorer.logprobs_padded(ids, am, rm)
    assert out.logprobs.shape == rm.shape and out.entropy is None and out.topk_ids is None
    check_against_logprobs(scorer, ids, am, rm, out)
    for b, s in enumerate(seqs):  # independent reference: float64 transformers on the row's real tokens
        p, c = s["prompt_token_ids"], s["completion_token_ids"]
        lp = ref_logprobs(ref_model, p + c)  # [n, V]
        want = torch.tensor([float(lp[len(p) - 1 + j, c[j]]) for j in range(len(c))])
        got = out.logprobs[b, :len(c)].double()
        keep = rm[b, :len(c)].bool()
        assert (got[keep] - want[keep]).abs().max() < 1e-4
        assert torch.all(got[~keep] == 0)


def test_trl_layout_right_padded_and_options(scorers):
    """TRL: input_ids/attention_mask with logits_to_keep; right-padded prompts (real tokens then
    padding then the completion) and entropy, top-k and temperature."""
    scorer = scorers["llama"]
    ids = torch.tensor([[5, 6, 7, 0, 0, 40, 41, 42, 0],
                        [9, 8, 7, 6, 5, 50, 51, 0, 0],
                        [3, 0, 0, 0, 0, 60, 61, 62, 63]])
    am = (ids != 0).long()
    out = scorer.logprobs_padded(ids, am, num_response_tokens=4, temperature=0.7, entropy=True, top_k=5)
    assert out.topk_ids.shape == (3, 4, 5) and out.topk_ids.dtype == torch.int64
    check_against_logprobs(scorer, ids, am, am[:, -4:], out, temperature=0.7, entropy=True, top_k=5)


def test_openrlhf_action_mask_both_padded(scorers):
    """OpenRLHF: sequences left-padded, action_mask [B, A] aligned to the last A positions, padding
    after the response too; a bool mask works as well as an int one."""
    scorer = scorers["qwen3"]
    seqs = random_sequences(4, seed=5)
    ids, am, rm = verl_batch(seqs, holes=False, pad_id=7)
    out = scorer.logprobs_padded(ids, am.bool(), rm.bool())
    check_against_logprobs(scorer, ids, am, rm, out)


def test_deterministic_rows_bitwise_alone_and_in_any_batch(det_scorer):
    seqs = random_sequences(5, seed=2)
    ids, am, rm = verl_batch(seqs, holes=True, seed=3)
    out = det_scorer.logprobs_padded(ids, am, rm, entropy=True)
    check_against_logprobs(det_scorer, ids, am, rm, out, entropy=True)
    for b in (0, 3):  # a row alone, and the batch reversed, give the same bits
        alone = det_scorer.logprobs_padded(ids[b:b + 1], am[b:b + 1], rm[b:b + 1], entropy=True)
        assert torch.equal(alone.logprobs[0], out.logprobs[b]) and torch.equal(alone.entropy[0], out.entropy[b])
    rev = det_scorer.logprobs_padded(ids.flip(0), am.flip(0), rm.flip(0), entropy=True)
    assert torch.equal(rev.logprobs.flip(0), out.logprobs)


def test_packed_matches_padded_and_logprobs(scorers):
    scorer = scorers["llama"]
    seqs = random_sequences(5, seed=8)
    flat = [s["prompt_token_ids"] + s["completion_token_ids"] for s in seqs]
    ids = torch.tensor([t for f in flat for t in f])
    cu = torch.tensor([0] + [len(f) for f in flat]).cumsum(0)
    ss = torch.tensor([len(s["prompt_token_ids"]) for s in seqs])
    out = scorer.logprobs_packed(ids, cu, ss, top_k=2)
    assert out.logprobs.shape == ids.shape and out.topk_ids.shape == (len(ids), 2)
    ref = scorer.logprobs(seqs, top_k=2)
    for i, r in enumerate(ref):
        a, b = int(cu[i]) + int(ss[i]), int(cu[i + 1])
        assert torch.equal(out.logprobs[a:b], r.logprobs) and torch.equal(out.topk_ids[a:b], r.topk_ids)
        assert not out.logprobs[int(cu[i]):a].any()


def test_nothing_scored_and_errors(scorers):
    scorer = scorers["llama"]
    ids = torch.tensor([[0, 5, 6, 7]])
    out = scorer.logprobs_padded(ids, torch.tensor([[0, 1, 1, 1]]), torch.zeros(1, 2, dtype=torch.long),
                                 entropy=True, top_k=3)
    assert out.logprobs.tolist() == [[0.0, 0.0]] and out.entropy.shape == (1, 2) and out.topk_ids.shape == (1, 2, 3)
    bad = [
        (dict(input_ids=ids.float()), "input_ids"),
        (dict(input_ids=torch.tensor([[0, 5, 6, 300]])), "input_ids"),  # outside the vocabulary of 300
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(entropy=1), "entropy"),
        (dict(input_ids=[[0, 5, 6, 7]]), "input_ids"),
    ]
    for kw, field in bad:
        args = dict(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]), num_response_tokens=2) | kw
        with pytest.raises(LogprobeError) as e:
            scorer.logprobs_padded(**args)
        assert e.value.field == field, kw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inputs_come_back_on_cuda(scorers):
    scorer = scorers["llama"]
    ids, am, rm = verl_batch(random_sequences(3, seed=1), holes=True)
    out = scorer.logprobs_padded(ids.cuda(), am.cuda(), rm.cuda())
    assert out.logprobs.is_cuda
    assert torch.equal(out.logprobs.cpu(), scorer.logprobs_padded(ids, am, rm).logprobs)

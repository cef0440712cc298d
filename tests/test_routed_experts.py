"""Routed experts (R3, SGLang's shape): ``return_routed_experts`` gives each token's experts at every
MoE layer, a sequence's ``routed_experts`` forces them. Tiny Qwen3-MoE (renormalised top-k),
Qwen2-MoE (a dense block, a shared expert, weights not renormalised) and gpt-oss (a biased router
choosing by logits, the chosen logits' softmax as weights) against float64 transformers with the
router's choice read (and, for replays, replaced) by a forward hook on each gate."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch
from helpers import byte_tokenizer, make_hf_dir
from server_util import serve
from test_moe import make_moe_dir

from logprobe import LogprobeError, Scorer
from logprobe.server import ServerConfig, create_app
from logprobe.server.schemas_rl import GenerateRequest
from logprobe.server.sglang_compat import generate_job

TOL = 1e-4
KINDS = ["qwen3_moe", "qwen2_moe", "gpt_oss"]
PROMPT = [5, 71, 72, 3, 140, 8, 200, 17]
SEQS = [{"prompt_token_ids": PROMPT, "completion_token_ids": [9, 66, 250, 12, 33]},
        {"prompt_token_ids": PROMPT, "completion_token_ids": [34, 35, 36]},  # shares the prompt
        {"prompt_token_ids": [7, 101, 45], "completion_token_ids": [46, 47, 48, 49, 50, 51, 52, 53]}]


def scorer(path, **kw) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True, **kw)


def make_gpt_oss_dir(path):
    """A tiny random gpt-oss (``test_gpt_oss``'s config: sliding and full blocks, 4 experts, 2 per
    token), every parameter drawn (transformers zeroes the router); its float64 model, RMSNorm in
    float64."""
    import test_gpt_oss

    torch.manual_seed(0)
    model = test_gpt_oss._model().float().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("sinks") else 0.3 if p.dim() == 1 else 0.1)
                    * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return model.double()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import test_gpt_oss
    from transformers.models.gpt_oss import modeling_gpt_oss as hfo

    mp = pytest.MonkeyPatch()
    mp.setattr(hfo.GptOssRMSNorm, "forward", test_gpt_oss._norm64)  # its float32 cast would round
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"r3-{kind}")
        out[kind] = (d, make_gpt_oss_dir(d) if kind == "gpt_oss" else make_moe_dir(d, kind), scorer(d))
    yield out
    mp.undo()


def gates(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def reference(model, ids: list[int], force: torch.Tensor | None = None):
    """float64 transformers on ``ids``: (log-probs [n, V] of each row, routed experts [n, L, k], the
    smallest top-k margin p_(k) - p_(k+1) of each token and layer). ``force`` [n - 1, L, k]: each
    gate's choice for tokens 0..n-2 replaced, weights its probabilities gathered there and
    normalised as the gate normalises its own choice."""
    chosen, margins, handles = [], [], []

    def hook(layer):
        def fn(module, inputs, out):
            logits, weights, idx = out
            probs = torch.softmax(logits.double(), dim=-1)
            top = torch.topk(probs, idx.shape[-1] + 1, dim=-1).values
            margins.append(float((top[:, -2] - top[:, -1]).min()))
            if force is None:
                chosen.append(idx.clone())
                return None
            idx = idx.clone()
            idx[:force.shape[0]] = force[:, layer]
            w = probs.gather(1, idx)
            if getattr(module, "norm_topk_prob", True):
                w = w / w.sum(dim=-1, keepdim=True)
            chosen.append(idx)
            return logits, w.to(weights.dtype), idx
        return fn

    for layer, g in enumerate(gates(model)):
        handles.append(g.register_forward_hook(hook(layer)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits, dim=-1), torch.stack(chosen, dim=1), min(margins)


@pytest.mark.parametrize("kind", KINDS)
def test_returned_experts_are_the_routers_choice(models, kind):
    d, ref_model, s = models[kind]
    out = s.logprobs(SEQS, return_routed_experts=True)
    layers = len(gates(ref_model))
    for seq, res in zip(SEQS, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, chosen, margin = reference(ref_model, ids)
        assert margin > 1e-5, f"a near-tie in the router ({margin}): pick other tokens"
        assert res.routed_experts.dtype == torch.int32
        assert tuple(res.routed_experts.shape) == (len(ids) - 1, layers, 2)
        assert torch.equal(res.routed_experts.long(), chosen[:-1])  # every token fed; the router's order
        want = torch.tensor([lp[j - 1, ids[j]] for j in range(len(seq["prompt_token_ids"]), len(ids))])
        assert (res.logprobs.double() - want).abs().max() < TOL
        assert res.to_dict()["routed_experts"] == res.routed_experts.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_replay_is_bitwise_and_perturbed_replay_matches_reference(models, kind):
    d, ref_model, s = models[kind]
    plain = s.logprobs(SEQS, return_routed_experts=True)
    # replay sequences 0 and 2 (0 no longer shares its prompt with 1), in chunks of 6 rows too
    for sc in (s, scorer(d, max_batch_tokens=6)):
        replay = [dict(SEQS[0], routed_experts=plain[0].routed_experts), SEQS[1],
                  dict(SEQS[2], routed_experts=plain[2].routed_experts.tolist())]
        again = sc.logprobs(replay, return_routed_experts=True)
        for a, b in zip(plain, again):
            assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.routed_experts, b.routed_experts)

    g = torch.Generator().manual_seed(1)
    n_experts = s.context.routing[2]
    perturbed = plain[0].routed_experts.clone()
    for t in range(perturbed.shape[0]):
        for layer in range(perturbed.shape[1]):
            perturbed[t, layer] = torch.randperm(n_experts, generator=g)[:2].to(torch.int32)
    got = s.logprobs([dict(SEQS[0], routed_experts=perturbed), SEQS[1]], return_routed_experts=True)
    assert torch.equal(got[0].routed_experts, perturbed)
    assert torch.equal(got[1].logprobs, plain[1].logprobs)  # its neighbour is untouched
    ids = SEQS[0]["prompt_token_ids"] + SEQS[0]["completion_token_ids"]
    lp, chosen, _ = reference(ref_model, ids, perturbed.long())
    want = torch.tensor([lp[j - 1, ids[j]] for j in range(len(PROMPT), len(ids))])
    assert (got[0].logprobs.double() - want).abs().max() < TOL
    assert (got[0].logprobs - plain[0].logprobs).abs().max() > 1e-3  # the routing mattered


def test_base64_round_trip_and_server(models):
    d, ref_model, s = models["qwen3_moe"]
    ids = SEQS[0]["prompt_token_ids"] + SEQS[0]["completion_token_ids"]
    lib = s.logprobs(SEQS[:1], return_routed_experts=True)[0]
    L, k = s.context.routing[:2]
    off = GenerateRequest.model_validate({"input_ids": ids, "return_routed_experts": True})
    with pytest.raises(LogprobeError) as e:
        generate_job(off, s, 20, False)
    assert e.value.field == "return_routed_experts"

    app = create_app(scorer(d), ServerConfig(enable_return_routed_experts=True))
    with serve(app) as url:
        r = requests.post(url + "/generate", json={"input_ids": ids, "return_routed_experts": True,
                                                   "return_logprob": True, "logprob_start_len": 0,
                                                   "sampling_params": {"max_new_tokens": 0}}, timeout=60)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, L, k)
        assert torch.equal(torch.from_numpy(got.copy()), lib.routed_experts)
        assert [e[0] for e in meta["input_token_logprobs"][1 + len(PROMPT) - 1:]] == lib.logprobs.tolist()
        # native: base64 back, and a base64 routing replayed (perturbed: the first token's experts swapped)
        body = {"sequences": [SEQS[0]], "return_routed_experts": True}
        nat = requests.post(url + "/v1/logprobs", json=body, timeout=60).json()["results"][0]
        assert nat["routed_experts"] == meta["routed_experts"] and nat["logprobs"] == lib.logprobs.tolist()
        swapped = lib.routed_experts.clone()
        swapped[:, :, [0, 1]] = swapped[:, :, [1, 0]]  # the same experts, listed in the other order
        b64 = base64.b64encode(swapped.numpy().astype("<i4").tobytes()).decode()
        rep = requests.post(url + "/v1/logprobs", json={"sequences": [dict(SEQS[0], routed_experts=b64)],
                                                        "return_routed_experts": True}, timeout=60)
        assert rep.status_code == 200, rep.text
        want = s.logprobs([dict(SEQS[0], routed_experts=swapped)])[0].logprobs.tolist()
        assert rep.json()["results"][0]["logprobs"] == want
        bad = requests.post(url + "/v1/logprobs", json={"sequences": [dict(SEQS[0], routed_experts=[[[0, 1]]])]},
                            timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sequences[0].routed_experts"


def test_dense_model_refuses(tmp_path):
    make_hf_dir(tmp_path, "llama", seed=3)
    s = scorer(tmp_path)
    with pytest.raises(LogprobeError) as e:
        s.logprobs(SEQS[:1], return_routed_experts=True)
    assert e.value.field == "return_routed_experts"
    with pytest.raises(LogprobeError) as e:
        s.logprobs([dict(SEQS[0], routed_experts=[[[0, 1]]] * 12)])
    assert e.value.field == "sequences[0].routed_experts"


def _sglang(routes: torch.Tensor, blocks: list[int], num_layers: int) -> torch.Tensor:
    """[n, moe_layers, k] -> SGLang's capturer layout: [n, num_hidden_layers, k] int32, zeros in dense blocks."""
    out = torch.zeros(routes.shape[0], num_layers, routes.shape[2], dtype=torch.int32)
    out[:, blocks] = routes.to(torch.int32)
    return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().astype("<i4").tobytes()).decode()


def test_sglang_layout_with_a_dense_block(models):
    """Qwen2-MoE's block 1 is dense (``mlp_only_layers``): ``/generate`` returns SGLang's layout,
    a row per hidden layer with zeros there (clients reshape by ``num_hidden_layers``), while the
    library and ``/v1/logprobs`` keep one row per MoE layer. A routing in SGLang's layout is taken
    as input (lists and base64): the same numbers as the compact one; a dense row that is not zero
    is refused, naming the field, token and layer."""
    d, _, s = models["qwen2_moe"]
    assert (s.context.route_blocks, s.context.num_blocks) == ((0, 2), 3)
    ids = SEQS[0]["prompt_token_ids"] + SEQS[0]["completion_token_ids"]
    lib = s.logprobs(SEQS[:1], return_routed_experts=True)[0]
    assert tuple(lib.routed_experts.shape) == (len(ids) - 1, 2, 2)
    forced = lib.routed_experts.clone()
    forced[:, :, [0, 1]] = forced[:, :, [1, 0]]
    for layer in (0, 1):  # a scored row's experts replaced (its log-prob moves)
        forced[len(PROMPT), layer] = torch.tensor([6, 7] if set(forced[len(PROMPT), layer].tolist()) != {6, 7}
                                                  else [0, 1])
    want = s.logprobs([dict(SEQS[0], routed_experts=forced)])[0].logprobs
    assert not torch.equal(want, lib.logprobs)
    full = _sglang(forced, [0, 2], 3)
    for given in (full, full.tolist(), _b64(full)):  # SGLang's layout in
        assert torch.equal(s.logprobs([dict(SEQS[0], routed_experts=given)])[0].logprobs, want)
    dense = full.clone()
    dense[4, 1] = torch.tensor([3, 0])
    with pytest.raises(LogprobeError, match="token 4 has experts \\[3, 0\\] at layer 1, a dense block") as e:
        s.logprobs([dict(SEQS[0], routed_experts=dense)])
    assert e.value.field == "sequences[0].routed_experts"

    app = create_app(scorer(d), ServerConfig(enable_return_routed_experts=True))
    with serve(app) as url:
        r = requests.post(url + "/generate", json={"input_ids": ids, "return_routed_experts": True,
                                                   "sampling_params": {"max_new_tokens": 0}}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.frombuffer(base64.b64decode(r.json()["meta_info"]["routed_experts"]), dtype=np.int32)
        assert got.size == (len(ids) - 1) * 3 * 2  # reshape(-1, num_hidden_layers, k), as from SGLang
        assert torch.equal(torch.from_numpy(got.reshape(-1, 3, 2).copy()), _sglang(lib.routed_experts, [0, 2], 3))
        body = {"sequences": [dict(SEQS[0], routed_experts=_b64(full))], "return_routed_experts": True}
        nat = requests.post(url + "/v1/logprobs", json=body, timeout=60).json()["results"][0]
        assert nat["logprobs"] == want.tolist()
        assert nat["routed_experts"] == _b64(forced)  # logprobe's own route: a row per MoE layer
        bad = requests.post(url + "/v1/logprobs", json={"sequences": [dict(SEQS[0], routed_experts=dense.tolist())]},
                            timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sequences[0].routed_experts"
        assert "layer 1, a dense block" in bad.json()["error"]["message"]


def test_an_expert_named_twice_is_refused(models):
    """A forced route naming one expert twice for a token (a router never does; the expert would
    run twice) is refused: library and HTTP (400 naming the field, the token and the layer)."""
    d, _, s = models["qwen2_moe"]
    plain = s.logprobs(SEQS[:1], return_routed_experts=True)[0]
    twice = plain.routed_experts.clone()
    twice[3, 1] = torch.tensor([5, 5])
    words = r"names expert 5 twice for token 3 at MoE layer 1 \(hidden layer 2\)"
    for given in (twice, _b64(_sglang(twice, [0, 2], 3))):
        with pytest.raises(LogprobeError, match=words) as e:
            s.logprobs([dict(SEQS[0], routed_experts=given)])
        assert e.value.field == "sequences[0].routed_experts"
    with serve(create_app(scorer(d))) as url:
        bad = requests.post(url + "/v1/logprobs", json={"sequences": [dict(SEQS[0], routed_experts=twice.tolist())]},
                            timeout=60)
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "sequences[0].routed_experts" and "expert 5 twice for token 3" in err["message"]

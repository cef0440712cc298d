"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) against float64 transformers.

Near-ties in the router. Top-k selection is discontinuous: where the k-th and (k+1)-th router
probabilities of a token are closer than the float32 forward's error, float32 and float64 may pick
different experts and the log-probs differ by far more than 1e-4, with neither being wrong. So
the tests do not rely on luck: ``router_margins`` runs the float64 reference over exactly the
tokens each test scores, takes per token and MoE block the gap p_(k) - p_(k+1) between the k-th
and (k+1)-th largest probability, and the tests assert that the smallest gap exceeds
``MARGIN_FACTOR`` times the largest float32-vs-float64 difference of any router probability
(measured through the ``blocks.l.router`` capture) and ``MIN_MARGIN``. The seeds were chosen so
that this holds (smallest gaps are printed in the assertion messages); then the same experts are
selected in both (asserted too) and the comparison at 1e-4 is exact, not lucky.
"""

from __future__ import annotations

import importlib.util
import json
import random
import textwrap

import numpy as np
import pytest
import torch
from helpers import VOCAB, byte_tokenizer, permute_for_gguf, random_sequences, ref_logprobs, run_interpreted

from logprobe import LogprobeError, Scorer
from logprobe.config import Deterministic, EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.layers.moe import MoeBlock, combine, route, sort_by_expert
from logprobe.loading import load_model

TOL = 1e-4
MIN_MARGIN = 1e-5
MARGIN_FACTOR = 10.0
KINDS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def moe_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
                  eos_token_id=0)
    if kind == "qwen3_moe":  # head_dim 32 != 64 / 4, renormalised top-k
        return tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, head_dim=32)
    if kind == "qwen2_moe":  # shared expert, qkv bias, a dense block (mlp_only_layers), weights not renormalised
        return tf.Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                 mlp_only_layers=[1])
    if kind == "mixtral":  # sliding window shorter than the test sequences
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=16)
    if kind == "olmoe":  # q/k norm over the whole projection, top-3 of 8 not renormalised
        return tf.OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=3)
    raise ValueError(kind)


SEEDS = {"qwen3_moe": 0, "qwen2_moe": 0, "mixtral": 0, "olmoe": 0}


def make_moe_dir(path, kind: str):
    """Save a tiny random MoE model + byte tokenizer; return the float64 transformers model (eager
    experts: transformers' grouped_mm path has no float64)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEEDS[kind])
    model = AutoModelForCausalLM.from_config(moe_config(kind), attn_implementation="eager",
                                             experts_implementation="eager").float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return model.double()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"moe-{kind}")
        out[kind] = (d, make_moe_dir(d, kind))
    return out


@pytest.fixture(scope="module")
def scorers(moe_dirs):
    return {k: Scorer(str(d), device="cpu", dtype="float32", progress=False) for k, (d, _) in moe_dirs.items()}


def _blocks(ref):
    return [(i, layer.mlp) for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")
            and not hasattr(layer.mlp, "gate_proj")]


def reference_router(ref, ids: list[int]) -> dict[int, torch.Tensor]:
    """float64 router probabilities [L, E] of each MoE block of the reference, for one sequence."""
    out, handles = {}, []
    for i, mlp in _blocks(ref):
        handles.append(mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: out.__setitem__(i, torch.softmax(o[0].double(), -1))))
    with torch.no_grad():
        ref(torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    return out


def router_margins(ref, seqs: list[list[int]], top_k: int) -> float:
    """The smallest gap p_(k) - p_(k+1) over every token of ``seqs`` and every MoE block (float64)."""
    gaps = []
    for ids in seqs:
        for p in reference_router(ref, ids).values():
            top = p.topk(top_k + 1, dim=-1).values  # [L, k+1]
            gaps.append((top[:, top_k - 1] - top[:, top_k]).min())
    return float(torch.stack(gaps).min())


def check_routing_is_decided(scorer, ref, seqs: list[list[int]] | list[dict], steer=None) -> float:
    """Assert the float32 model selects the float64 model's experts with a margin (module docstring);
    return the largest router-probability difference. ``seqs``: token lists or RL sequences (with
    ``steer``, the same steering as a hook on ``ref`` applies)."""
    top_k = scorer.loaded.model.config.moe.top_k
    blocks = sorted(scorer.loaded.model.router_points)
    caps = [{"at": blocks, "positions": "all"}]
    seqs = [s if isinstance(s, dict) else {"prompt_token_ids": s[:1], "completion_token_ids": s[1:]} for s in seqs]
    got = scorer.logprobs(seqs, capture=caps, steer=steer)
    seqs = [s["prompt_token_ids"] + s["completion_token_ids"] for s in seqs]
    err = 0.0
    for ids, res in zip(seqs, got):
        want = reference_router(ref, ids)
        for c in res.captures:
            layer = int(c.at.split(".")[1])
            p64, p32 = want[layer], c.value.double()  # [L, E]
            err = max(err, float((p32 - p64).abs().max()))
            assert torch.equal(p32.topk(top_k, -1).indices.sort(-1).values, p64.topk(top_k, -1).indices.sort(-1).values)
    margin = router_margins(ref, seqs, top_k)
    assert margin > max(MIN_MARGIN, MARGIN_FACTOR * err), f"router near-tie: margin {margin:.3g}, error {err:.3g}"
    return err


# -- pure pieces ---------------------------------------------------------------------------------

def test_route_sort_combine_gold():
    """The worked example of layers.moe: which expert gets which token, and the order of the sum."""
    probs, w, ids = route(torch.tensor([[0.0, 2.0, 1.0]]), 2, True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.7310586, 0.2689414]]))
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    _, w_raw, _ = route(torch.tensor([[0.0, 2.0, 1.0]]), 2, False)
    assert torch.allclose(w_raw, probs.topk(2).values)  # not renormalised: the softmax values themselves
    order, counts = sort_by_expert(torch.tensor([[2, 0], [0, 3], [2, 1]]), 4)
    assert order.tolist() == [1, 2, 5, 0, 4, 3] and counts == [2, 1, 2, 1]
    y = torch.arange(12.0).view(3, 2, 2)  # [T, k, H]
    wt = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.0, 2.0]])
    assert combine(y, wt).tolist() == [[0.5, 1.25], [4.0, 5.0], [20.0, 22.0]]


# -- against float64 transformers ----------------------------------------------------------------

def test_backend_is_native(scorers):
    assert {k: type(s.loaded.model).__name__ for k, s in scorers.items()} == {k: "MoeModel" for k in KINDS}
    assert sum(isinstance(m, MoeBlock) for m in scorers["qwen2_moe"].loaded.model.modules()) == 2  # block 1 dense


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_reference(kind, scorers, moe_dirs):
    scorer, ref = scorers[kind], moe_dirs[kind][1]
    seqs = random_sequences(5, seed=7)
    check_routing_is_decided(scorer, ref, [s["prompt_token_ids"] + s["completion_token_ids"] for s in seqs])
    out = scorer.logprobs(seqs, temperature=0.8, top_k=3, entropy=True)
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        rows = ref_logprobs(ref, ids, 0.8)[len(seq["prompt_token_ids"]) - 1: len(ids) - 1]
        tgt = rows.gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        assert (res.logprobs.double() - tgt).abs().max() < TOL
        assert (res.entropy.double() + (rows.exp() * rows).sum(-1)).abs().max() < TOL
        assert (res.topk_logprobs.double() - rows.topk(3, -1).values).abs().max() < TOL


def test_capture_router_and_mlp_out(scorers, moe_dirs):
    """blocks.l.router = the reference router's float64 softmax; blocks.l.mlp_out = its MoE output
    (shared expert included)."""
    scorer, ref = scorers["qwen2_moe"], moe_dirs["qwen2_moe"][1]
    ids = random_sequences(1, seed=11)[0]
    seq = {"prompt_token_ids": ids["prompt_token_ids"], "completion_token_ids": ids["completion_token_ids"]}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["blocks.0.router", "blocks.*.mlp_out"], "positions": "all"}])[0]
    mlp_out = {}
    hs = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: mlp_out.__setitem__(i, o[0]))
          for i, layer in enumerate(ref.model.layers)]
    router = reference_router(ref, tokens)
    for h in hs:
        h.remove()
    got = {c.at: c.value for c in res.captures}
    assert got["blocks.0.router"].shape == (len(tokens), 8)
    assert (got["blocks.0.router"].double() - router[0]).abs().max() < 1e-5
    for i in range(3):
        assert (got[f"blocks.{i}.mlp_out"].double() - mlp_out[i]).abs().max() < 1e-5
    with pytest.raises(LogprobeError, match="no router"):  # block 1 keeps a dense MLP
        scorer.logprobs([seq], capture=[{"at": "blocks.1.router"}])
    with pytest.raises(LogprobeError, match="capture-only"):
        scorer.logprobs([seq], steer=[{"at": "blocks.0.router", "vector": [1.0] * 64}])


def test_router_point_refused_on_dense_model(tiny_dirs):
    s = Scorer(str(tiny_dirs["llama"][0]), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="no router"):
        s.logprobs([{"prompt_token_ids": [5, 6], "completion_token_ids": [7]}], capture=[{"at": "blocks.0.router"}])


def test_steering_matches_reference(scorers, moe_dirs):
    """Adding c * v to blocks.0.mlp_out (continuation rows) = a forward hook doing it in transformers."""
    scorer, ref = scorers["mixtral"], moe_dirs["mixtral"][1]
    v = torch.randn(64, generator=torch.Generator().manual_seed(3)).tolist()
    seq = {"prompt_token_ids": list(range(40, 60)), "completion_token_ids": list(range(90, 110))}
    tokens, p = seq["prompt_token_ids"] + seq["completion_token_ids"], 20
    steer = [{"at": "blocks.0.mlp_out", "vector": v, "coeff": 0.5, "positions": "continuation"}]
    got = scorer.logprobs([seq], steer=steer)[0].logprobs

    def hook(m, a, o):
        o = o.clone()
        o[0, p:] += 0.5 * torch.tensor(v, dtype=o.dtype)
        return o
    h = ref.model.layers[0].mlp.register_forward_hook(hook)
    check_routing_is_decided(scorer, ref, [seq], steer)
    try:
        lp = ref_logprobs(ref, tokens)
    finally:
        h.remove()
    want = lp[p - 1:-1].gather(1, torch.tensor(tokens[p:])[:, None])[:, 0]
    assert (got.double() - want).abs().max() < TOL
    plain = scorer.logprobs([seq])[0].logprobs
    assert torch.equal(got[:1], plain[:1]) and (got - plain).abs().max() > 1e-3  # steering acted after p only


# -- packing, prefixes, chunks, deterministic mode -----------------------------------------------

def _mix(seed: int) -> list[ScoreRequest]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for _ in range(2):  # shared contexts (prefix trees)
        ctx = tok(rng.randint(16, 50))
        for _ in range(3):
            reqs.append(ScoreRequest(ctx + tok(rng.randint(1, 30)), len(ctx), top_k=rng.choice([0, 3])))
    for _ in range(3):
        t = tok(rng.randint(2, 90))
        reqs.append(ScoreRequest(t, rng.randint(1, len(t) - 1)))
    return reqs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_prefix_sharing_and_chunking(kind, deterministic, moe_dirs):
    """Each request alone is right (float64 reference); in shuffled mixes with prefix trees and
    chunked long requests (budgets 48, 100, all) its numbers are the same: bitwise in
    deterministic mode, within 1e-5 otherwise."""
    loaded = load_model(str(moe_dirs[kind][0]), "cpu", "float32")
    reqs = _mix(seed=len(kind))
    ref = moe_dirs[kind][1]
    check_routing_is_decided(Scorer(loaded, progress=False), ref, [r.tokens for r in reqs])
    alone_engine = Scorer(loaded, config=EngineConfig(deterministic=deterministic, share_prefixes=False)).engine
    alone = [alone_engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):
        lp = ref_logprobs(ref, r.tokens)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < TOL
    rng = random.Random(2)
    for budget in (48, 100, 1 << 20):
        order = list(range(len(reqs)))
        rng.shuffle(order)
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic, share_prefixes=True)
        out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
        for i, res in zip(order, out):
            if deterministic:
                assert torch.equal(_bits(res.logprobs), _bits(alone[i].logprobs))
            else:
                assert (res.logprobs - alone[i].logprobs).abs().max() < 1e-5


# -- refusals ------------------------------------------------------------------------------------

def test_unsupported_fields_are_not_run_natively():
    from logprobe.loading.hf import native_config

    base = moe_config("olmoe").to_dict()
    assert native_config(base)[0].moe.top_k == 3
    cfg, why = native_config({**base, "clip_qkv": 8.0})
    assert cfg is None and "clip_qkv" in why  # falls back to the transformers backend, which runs it
    cfg, why = native_config({**moe_config("qwen3_moe").to_dict(), "use_sliding_window": True})
    assert cfg is None and "sliding" in why
    cfg, why = native_config({**moe_config("mixtral").to_dict(), "scoring_func": "sigmoid"})
    assert cfg is None and "scoring_func" in why
    spec = native_config({**moe_config("qwen2_moe").to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": []})[0].moe
    assert spec.dense_layers == (0, 2)  # transformers: block i is sparse iff (i + 1) % step == 0


def test_tensor_parallel_sizes(moe_dirs):
    """TP = 2 splits (tests/test_moe_parallel.py runs it); OLMoE's whole-projection k norm needs the
    size to divide its 2 kv heads; a size not dividing the heads is refused."""
    from logprobe.loading.loader import describe_model, parallel_context

    cfg = describe_model(str(moe_dirs["qwen3_moe"][0]), "cpu").model.config
    assert parallel_context(cfg, 0, 2).size == 2
    with pytest.raises(LogprobeError, match="attention heads"):
        parallel_context(cfg, 0, 3)
    olmoe = describe_model(str(moe_dirs["olmoe"][0]), "cpu").model.config
    assert parallel_context(olmoe, 0, 2).size == 2
    with pytest.raises(LogprobeError, match="whole-projection k norm") as e:
        parallel_context(olmoe, 0, 4)
    assert e.value.field == "tensor_parallel_size"


# -- GGUF ----------------------------------------------------------------------------------------

def _gguf_header(w, cfg, head_dim: int) -> None:
    _, vocab = byte_tokenizer()
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_expert_count(cfg.num_experts if hasattr(cfg, "num_experts") else cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
               "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output",
               "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
               "post_attention_layernorm.weight": "ffn_norm", "mlp.gate.weight": "ffn_gate_inp",
               "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
               "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
               "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
               "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp"}


def write_moe_gguf(path, hf_model, arch: str, qtype: str, expert_qtype: str, extra=None) -> dict[str, np.ndarray]:
    """Write a tiny HF MoE model as a GGUF of ``arch`` (llama = Mixtral: q/k rows permuted as
    llama.cpp's converter does); matrices in ``qtype``, experts [E, out, in] in ``expert_qtype``.
    Returns the weights as gguf-py decodes them, under the HF model's own parameter names."""
    import gguf

    Q = gguf.GGMLQuantizationType
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch=arch)
    _gguf_header(w, cfg, head_dim)
    if extra is not None:
        extra(w)  # more metadata
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    decoded = {}

    def put(gname: str, arr: np.ndarray, q: str, hf_name: str) -> np.ndarray:  # -> decoded copy
        if arr.ndim == 1 or q == "F32":
            w.add_tensor(gname, arr.astype(np.float32))
            return arr
        data = gguf.quants.quantize(arr, Q[q])
        w.add_tensor(gname, data, raw_dtype=Q[q])
        return gguf.quants.dequantize(data, Q[q]).reshape(arr.shape)

    for hf_name, arr in sd.items():
        if not hf_name.startswith("model.layers."):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[hf_name]
            decoded[hf_name] = put(gname, arr, qtype if arr.ndim == 2 else "F32", hf_name)
            continue
        layer, rest = hf_name.split(".")[2], ".".join(hf_name.split(".")[3:])
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> gate, up
            gate, up = np.split(arr, 2, axis=1)
            dg = put(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate), expert_qtype, hf_name)
            du = put(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up), expert_qtype, hf_name)
            decoded[hf_name] = np.concatenate([dg, du], axis=1)
            continue
        if rest == "mlp.experts.down_proj":
            decoded[hf_name] = put(f"blk.{layer}.ffn_down_exps.weight", arr, expert_qtype, hf_name)
            continue
        gname = _GGUF_NAMES[rest]
        gname = f"blk.{layer}.{gname}" + ("" if gname.endswith(".bias") else ".weight")
        perm = None
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            n = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
            perm = np.argsort(permute_for_gguf(np.arange(arr.shape[0]), n))
            arr = permute_for_gguf(arr, n)
        if rest == "mlp.shared_expert_gate.weight":
            arr = arr.reshape(-1)  # llama.cpp: a vector [H]
        q = qtype if arr.ndim == 2 and rest not in ("mlp.gate.weight",) else "F32"
        dec = put(gname, arr, q, hf_name)
        decoded[hf_name] = (dec[perm] if perm is not None else dec).reshape(sd[hf_name].shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


@pytest.mark.parametrize("kind, arch, qtype, expert_qtype", [
    ("qwen3_moe", "qwen3moe", "Q8_0", "Q8_0"),
    ("qwen2_moe", "qwen2moe", "Q8_0", "Q4_0"),
    ("mixtral", "llama", "F16", "Q4_1"),
])
def test_gguf_moe_matches_reference(kind, arch, qtype, expert_qtype, tmp_path):
    """Experts stay packed (PackedExperts); packed and dense loads give the same bits; both match
    the same architecture holding gguf-py's decoded weights in float64."""
    from transformers import AutoModelForCausalLM

    from logprobe.layers.moe import PackedExperts
    from logprobe.layers.quant_linear import weight_bytes

    cfg = moe_config(kind)
    if kind == "qwen2_moe":
        cfg.mlp_only_layers = []  # llama.cpp's qwen2moe has experts in every block
    if kind == "mixtral":
        cfg.sliding_window = None  # llama-architecture GGUFs have no sliding window
    torch.manual_seed(5)
    src = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager").eval()
    path = tmp_path / f"{kind}.gguf"
    decoded = write_moe_gguf(path, src, arch, qtype, expert_qtype)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in decoded.items()})
    ref = ref.double().eval()
    seqs = random_sequences(3, seed=9)
    outs, sizes = [], []
    for weights in ("packed", "dense"):
        loaded = load_model(str(path), "cpu", "float32", weights=weights)
        experts = loaded.model.layers[0].mlp.experts
        assert isinstance(experts.down_proj, PackedExperts) == (weights == "packed")
        sizes.append(weight_bytes(loaded.model)["total"])
        if weights == "packed":  # flat rows [E*out, in] and one expert agree
            assert torch.equal(experts.down_proj.rows(slice(64, 128)), experts.down_proj.expert(1))
        s = Scorer(loaded, progress=False)
        if weights == "packed":
            check_routing_is_decided(s, ref, [q["prompt_token_ids"] + q["completion_token_ids"] for q in seqs])
        outs.append([r.logprobs for r in s.logprobs(seqs)])
    for seq, a, b in zip(seqs, *outs):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        rows = ref_logprobs(ref, ids)[len(seq["prompt_token_ids"]) - 1: len(ids) - 1]
        tgt = rows.gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        assert (a.double() - tgt).abs().max() < TOL
        assert torch.equal(a, b)
    assert sizes[0] < 0.6 * sizes[1]  # quantized experts stayed packed


def test_gguf_unsupported_expert_type_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"), experts_implementation="eager").eval()
    path = tmp_path / "q5.gguf"
    write_moe_gguf(path, src, "qwen3moe", "Q8_0", "Q5_0")
    with pytest.raises(LogprobeError, match="Q5_0"):
        load_model(str(path), "cpu", "float32")


@pytest.mark.parametrize("key, add", [
    ("expert_gating_func", lambda w: w.add_expert_gating_func(gguf_enum("ExpertGatingFuncType").SIGMOID)),
    ("expert_group_count", lambda w: w.add_expert_group_count(2)),
    ("expert_weights_scale", lambda w: w.add_expert_weights_scale(2.5)),
    ("expert_weights_norm", lambda w: w.add_expert_weights_norm(False)),
])
def test_gguf_moe_metadata_not_run_is_refused(key, add, tmp_path):
    """Routing metadata the native model would ignore is an error naming the key."""
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"), experts_implementation="eager").eval()
    path = tmp_path / "meta.gguf"
    write_moe_gguf(path, src, "qwen3moe", "F32", "F32", extra=add)
    with pytest.raises(LogprobeError, match=key):
        load_model(str(path), "cpu", "float32")


def gguf_enum(name: str):
    import gguf

    return getattr(gguf, name)


# -- the fused Triton kernel (kernels.moe) -------------------------------------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton; no CUDA needed)")
def test_fused_kernel_interpreted():
    """Under Triton's CPU interpreter, on shapes that leave partial tiles everywhere (H = 40, I = 24,
    tiles of 16): the expert alignment of the module docstring, float32 and float16 against the
    float64 reference, and a token's bits the same alone and among 37 tokens (batch invariance)."""
    code = textwrap.dedent("""
        import json, torch
        from logprobe.kernels.moe import MoeKernelConfig, align_by_expert, fused_moe, moe_reference
        out = {}
        s, t = align_by_expert(torch.tensor([[2, 0], [0, 3], [2, 1]]), 4, 2)
        out["align"] = [s.tolist(), t.tolist()]
        g = torch.Generator().manual_seed(0)
        T, H, I, E, k = 37, 40, 24, 5, 2
        x = torch.randn(T, H, generator=g)
        gate, up = torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5
        down = torch.randn(E, H, I, generator=g) / I**0.5
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        cfg = MoeKernelConfig(block_m=16, block_n=16, block_k=16)
        ref = moe_reference(x.double(), ids, gate.double(), up.double(), down.double())
        for dt in ("float32", "float16"):
            d = getattr(torch, dt)
            y = fused_moe(x.to(d), ids, gate.to(d), up.to(d), down.to(d), cfg)
            out[dt] = float((y.double() - ref).abs().max() / ref.abs().max())
        y_all = fused_moe(x, ids, gate, up, down, cfg)
        y_few = fused_moe(x[:9].clone(), ids[:9].clone(), gate, up, down, cfg)
        out["invariant"] = bool(torch.equal(y_few, y_all[: 9 * k]))
        out["scale"] = float(ref.abs().max())
        # expert parallelism: ids of other ranks' experts (>= 3 here) and pad rows (-1) get no tile;
        # one program per row tile (foreign) computes the held slots with the same bits
        ep = torch.where(ids < 3, ids, ids - 10)
        ep[::5] = -1
        held = (ep >= 0).reshape(-1)
        mats = gate[:3], up[:3], down[:3]
        a, b = fused_moe(x, ep, *mats, cfg), fused_moe(x, ep, *mats, cfg, foreign=True)
        out["foreign"] = bool(torch.equal(a[held], b[held]) and torch.equal(a[held], y_all[held]))
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["align"] == [[1, 2, 5, 6, 0, 4, 3, 6, 6, 6], [0, 1, 2, 3, 3]]  # a last tile of pad only
    assert out["scale"] > 0.5 and out["float32"] < 1e-6 and out["float16"] < 5e-3
    assert out["invariant"] and out["foreign"]


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton; no CUDA needed)")
def test_fused_fp8_experts_in_parts_interpreted():
    """FP8 block experts too large to expand at once (``Experts.STACK_BYTES`` set to two experts'
    worth here; DeepSeek-V3's 256 experts expand to 22.5 GB a layer) run the fused kernel over
    runs of experts into one buffer (``Experts.fused``): bitwise the single expansion, pad and
    other ranks' slots (ids -1 and >= E) left to no run; the float64 reference of the expanded
    weights within float32's rounding."""
    code = textwrap.dedent("""
        import json, torch
        from helpers import fp8_experts
        from logprobe.kernels.moe import moe_reference
        g = torch.Generator().manual_seed(0)
        T, H, I, E, k, bc = 29, 40, 24, 7, 2, 16
        e = fp8_experts(E, H, I, bc, g)
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E + 2, generator=g)[:k] for _ in range(T)]) - 1  # -1 .. E: some outside
        whole = e.fused(x, ids, foreign=True)
        per = 2 * 3 * I * H * 4  # two experts' expansion in float32
        e.STACK_BYTES = per
        chunks = e.stack_chunks(torch.float32)
        parts = e.fused(x, ids, foreign=True)
        held = ((ids >= 0) & (ids < E)).reshape(-1)
        mats = [m.double() for m in e.stacks(torch.float32)]
        ref = moe_reference(x.double(), ids.clamp(0, E - 1), *mats)
        out = dict(chunks=chunks, same=bool(torch.equal(whole[held], parts[held])),
                   err=float((parts[held].double() - ref[held]).abs().max() / ref[held].abs().max()))
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["chunks"] == [[0, 2], [2, 4], [4, 6], [6, 7]]
    assert out["same"] and out["err"] < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
def test_fused_fp8_experts_in_parts_cuda():
    """On CUDA in bfloat16 (the path DeepSeek-V3's FP8 experts take): the fused kernel over runs of
    experts is bitwise the single expansion, and within bfloat16's rounding of the float64
    reference of the expanded weights."""
    from helpers import fp8_experts

    from logprobe.kernels.moe import moe_reference

    g = torch.Generator().manual_seed(0)
    T, H, inter, E, k, bc = 301, 256, 384, 9, 3, 128
    e = fp8_experts(E, H, inter, bc, g).to("cuda")
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    ids = (torch.stack([torch.randperm(E + 2, generator=g)[:k] for _ in range(T)]) - 1).cuda()
    whole = e.fused(x, ids, foreign=True)
    e.STACK_BYTES = 2 * 3 * inter * H * 2  # two experts' expansion in bfloat16
    assert [tuple(c) for c in e.stack_chunks(torch.bfloat16)] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
    parts = e.fused(x, ids, foreign=True)
    held = ((ids >= 0) & (ids < E)).reshape(-1)
    assert torch.equal(whole[held], parts[held])
    mats = [m.double() for m in e.stacks(torch.bfloat16)]
    ref = moe_reference(x.double(), ids.clamp(0, E - 1), *mats)
    assert float((parts[held].double() - ref[held]).abs().max() / ref[held].abs().max()) < 2e-2


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton; no CUDA needed)")
def test_combine_kernel_interpreted_is_bitwise_the_pytorch_definition():
    """``combine_slots`` (one Triton pass) against ``layers.moe.combine(...).to(dtype)``: the same bits
    (FMA contraction off, the same order of products and sums), for k = 1, 3, 8, widths that leave a
    partial column block, float32 / bf16 inputs; and a gold row worked by hand. Outputs are float32
    here: the interpreter's float32 -> bf16 cast truncates (CUDA's rounds to nearest even, and the
    CUDA test below compares bf16 outputs bitwise)."""
    code = textwrap.dedent("""
        import json, torch
        from logprobe.kernels.moe import combine_slots
        from logprobe.layers.moe import combine
        out = {"equal": []}
        g = torch.Generator().manual_seed(3)
        for T, k, H, dt in [(5, 1, 40, torch.float32), (7, 3, 1100, torch.bfloat16), (4, 8, 64, torch.float32),
                            (3, 8, 96, torch.bfloat16)]:
            y = torch.randn(T * k, H, generator=g).to(dt)
            w = torch.softmax(torch.randn(T, k, generator=g), -1)
            ref = combine(y.view(T, k, H), w)  # float32
            out["equal"].append(bool(torch.equal(combine_slots(y, w, torch.float32), ref)))
        y = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        out["gold"] = combine_slots(y, torch.tensor([[0.5, 0.25]]), torch.float32).tolist()
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"] == [True] * 4
    assert out["gold"] == [[0.5 * 1 + 0.25 * 3, 0.5 * 2 + 0.25 * 4]]  # [[1.25, 2.0]]


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
def test_combine_kernel_cuda_is_bitwise_the_pytorch_definition():
    g = torch.Generator(device="cuda").manual_seed(0)
    for T, k, H, dt in [(4096, 8, 2048, torch.bfloat16), (333, 4, 1000, torch.float32)]:
        y = torch.randn(T * k, H, generator=g, device="cuda").to(dt)
        w = torch.softmax(torch.randn(T, k, generator=g, device="cuda"), -1)
        from logprobe.kernels.moe import combine_slots
        from logprobe.layers.moe import combine

        assert torch.equal(combine_slots(y, w, dt), combine(y.view(T, k, H), w).to(dt))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton; no CUDA needed)")
def test_combine_rows_kernel_interpreted_is_bitwise_the_pytorch_definition():
    """``combine_rows`` (a rank's own slots combined into a float32 partial, expert parallelism in
    default mode) against ``layers.moe.combine_local``: the same bits, for the slots of two experts
    of six (tokens with 0, 1 or more rows here), k = 1, 3, 8, float32 / bf16 rows, a partial column
    block, no rows at all; with every slot local, the one-process ``combine``'s bits; a gold row."""
    code = textwrap.dedent("""
        import json, torch
        from logprobe.kernels.moe import combine_rows
        from logprobe.layers.moe import combine, combine_local, local_slots
        out = {"equal": [], "whole": []}
        g = torch.Generator().manual_seed(4)
        for T, k, H, dt in [(9, 1, 40, torch.float32), (11, 3, 1100, torch.bfloat16), (6, 8, 64, torch.float32)]:
            ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(T)])
            y = torch.randn(T * k, H, generator=g).to(dt)
            w = torch.softmax(torch.randn(T, k, generator=g), -1)
            slots, _ = local_slots(ids, 2, 2)
            rows, rw = y[slots], w.reshape(-1)[slots]
            out["equal"].append(bool(torch.equal(combine_rows(rows, rw, slots, k, T), combine_local(rows, rw, slots, k, T))))
            every = torch.arange(T * k)
            out["whole"].append(bool(torch.equal(combine_rows(y, w.reshape(-1), every, k, T),
                                                 combine(y.view(T, k, H), w))))
        none = combine_rows(torch.empty(0, 8), torch.empty(0), torch.empty(0, dtype=torch.long), 2, 3)
        out["none"] = none.tolist()
        y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # slots 1 (t0, j1), 2 (t1, j0), 3 (t1, j1)
        out["gold"] = combine_rows(y, torch.tensor([0.5, 0.25, 2.0]), torch.tensor([1, 2, 3]), 2, 3).tolist()
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"] == [True] * 3 and out["whole"] == [True] * 3
    assert out["none"] == [[0.0] * 8] * 3
    assert out["gold"] == [[0.5, 1.0], [0.25 * 3 + 2.0 * 5, 0.25 * 4 + 2.0 * 6], [0.0, 0.0]]


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
def test_owned_partial_interpreted_is_bitwise_the_gathered_path():
    """Default mode's partial under data-parallel attention, the two ways, on the gathered rows of
    2 ranks (pad rows' ids -1) for the experts 2, 3 of ten: ``fused_moe`` on xs with ids outside
    this rank's experts left out, then ``combine_owned`` == the slots compacted (``local_slots``),
    their rows gathered, ``fused_moe`` on them, ``combine_rows``: bit for bit (k = 1, 2, 8; float32,
    float16: the interpreter has no bf16 products); and the float64 definition to rounding; a token
    with no slot here is 0. And ``Experts.owned_partial`` (rank 1 of 5) gives the same bits."""
    code = textwrap.dedent("""
        import json, torch
        from unittest import mock
        from logprobe.kernels.moe import combine_owned, combine_rows, fused_moe, MoeKernelConfig
        from logprobe.layers.moe import local_slots
        out = {"equal": [], "f64": [], "zero": []}
        g = torch.Generator().manual_seed(7)
        H, I = 32, 16
        for Pm, k, dt in [(10, 1, torch.float32), (12, 2, torch.float16), (9, 8, torch.float32)]:
            ids = torch.stack([torch.randperm(10, generator=g)[:k] for _ in range(Pm)])
            ids[Pm // 2] = -1  # a pad row
            xs = torch.randn(Pm, H, generator=g).to(dt)
            w = torch.softmax(torch.randn(Pm, k, generator=g), -1)
            gate, up = (torch.randn(2, I, H, generator=g).to(dt) * 0.3 for _ in range(2))
            down = torch.randn(2, H, I, generator=g).to(dt) * 0.3
            cfg = MoeKernelConfig(16, 16, 16, 4, 1)
            local = ids - 2
            own = (local >= 0) & (local < 2)
            new = combine_owned(fused_moe(xs, local, gate, up, down, cfg), w, own)
            slots, lid = local_slots(ids, 2, 2)
            ys = fused_moe(xs[slots // k], lid[:, None], gate, up, down, cfg)
            old = combine_rows(ys, w.reshape(-1)[slots], slots, k, Pm)
            out["equal"].append(bool(torch.equal(new, old)))
            ref = torch.zeros(Pm, H, dtype=torch.float64)
            for t in range(Pm):
                for j in range(k):
                    if own[t, j]:
                        e, x64 = int(local[t, j]), xs[t].double()
                        h = torch.nn.functional.silu(gate[e].double() @ x64) * (up[e].double() @ x64)
                        ref[t] += w[t, j].double() * (down[e].double() @ h)
            out["f64"].append(float((new.double() - ref).abs().max()))
            out["zero"].append(bool((new[~own.any(1)] == 0).all()))
            if dt == torch.float32:  # the layer's glue: rank 1 of 5 holds experts 2, 3 of ten
                from logprobe.layers.moe import Experts
                from logprobe.parallel.context import ParallelContext
                ex = Experts(10, H, I, ParallelContext(1, 5, experts=5))
                for name, t in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
                    getattr(ex, name).data.copy_(t)
                with mock.patch("logprobe.kernels.moe.default_config", lambda dtype: cfg):  # the small tiles
                    got = ex.owned_partial(xs, ids, w, triton=True)
                out["layer"] = out.get("layer", []) + [bool(torch.equal(got, new))]
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"] == [True] * 3 and out["zero"] == [True] * 3 and out["layer"] == [True, True]
    assert out["f64"][0] < 1e-4 and out["f64"][2] < 1e-4 and out["f64"][1] < 1e-2  # float16: 2^-11 relative


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
def test_combine_rows_kernel_cuda_is_bitwise_the_pytorch_definition():
    from logprobe.kernels.moe import combine_rows
    from logprobe.layers.moe import combine_local, local_slots

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, k, H, dt in [(4096, 8, 2048, torch.bfloat16), (333, 4, 1000, torch.float32)]:
        ids = torch.stack([torch.randperm(128, device="cuda", generator=g)[:k] for _ in range(T)])
        y = torch.randn(T * k, H, generator=g, device="cuda").to(dt)
        w = torch.softmax(torch.randn(T, k, generator=g, device="cuda"), -1)
        slots, _ = local_slots(ids, 64, 64)
        rows, rw = y[slots], w.reshape(-1)[slots]
        assert torch.equal(combine_rows(rows, rw, slots, k, T), combine_local(rows, rw, slots, k, T))


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_cuda_kernel_matches_reference_path(dtype, moe_dirs):
    """On CUDA the MoE blocks run the fused kernel; the PyTorch path (triton off) is its reference."""
    loaded = load_model(str(moe_dirs["qwen2_moe"][0]), "cuda", str(dtype).removeprefix("torch."))
    s = Scorer(loaded, progress=False)
    seqs = random_sequences(4, seed=2)
    fused = [r.logprobs for r in s.logprobs(seqs)]
    loaded.model.use_triton_elementwise(False)  # the MoE blocks' PyTorch path (and PyTorch elementwise ops)
    plain = [r.logprobs for r in s.logprobs(seqs)]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert max(float((a - b).abs().max()) for a, b in zip(fused, plain)) < tol


def test_fused_expert_tensors_load_like_per_expert(moe_dirs, tmp_path):
    """A checkpoint holding transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) loads to the same model as the per-expert tensors
    ``save_pretrained`` writes: the same bits."""
    import shutil

    from safetensors.torch import save_file

    src, ref = moe_dirs["qwen3_moe"]
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = {k: v.float().contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    seqs = random_sequences(2, seed=4)
    a = Scorer(str(src), device="cpu", dtype="float32", progress=False).logprobs(seqs)
    fused = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False)
    b = fused.logprobs(seqs)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    experts = fused.loaded.model.layers[0].mlp.experts  # split halves own their storage (no copy per call)
    halves = {n: t for n, t in [*experts.named_parameters(), *experts.named_buffers()] if n in ("gate_proj", "up_proj")}
    assert sorted(halves) == ["gate_proj", "up_proj"] and all(t.is_contiguous() for t in halves.values())


@pytest.mark.parametrize("width", [24, 40, 100])
def test_silu_mul_rows_do_not_depend_on_how_many_come_together(width):
    """An expert gets a different number of rows in every batch: on CPU, SiLU(gate) * up of a row
    must be the same bits whatever its neighbours (PyTorch's scalar tail rounds SiLU differently
    and lands on different elements as the row count changes when the width is not a multiple of
    the vector length; before the padding in ``silu_mul``, width 24 gave 184 of 300 rows changed)."""
    from logprobe.layers.activation import silu_mul

    g = torch.Generator().manual_seed(width)
    gate, up = torch.randn(300, width, generator=g), torch.randn(300, width, generator=g)
    full = silu_mul(gate, up)
    for n in (1, 7, 33, 299):
        assert torch.equal(silu_mul(gate[:n], up[:n]), full[:n]), n
    assert torch.allclose(full.double(), torch.nn.functional.silu(gate.double()) * up.double(), atol=1e-6)


def test_deterministic_mode_keeps_tp_invariance_on_moe_models(moe_dirs, tiny_dirs):
    """MoE models split over ranks (tests/test_moe_parallel.py), so deterministic mode runs their
    layers and experts in the TP-invariant column blocks; tp_invariant=False drops them (bits
    repeatable at this size only); within 1e-5 of each other. Dense models keep the slices too."""
    from logprobe.layers.linear import Linear
    from logprobe.layers.moe import Experts

    reqs = _mix(seed=5)[:4]
    loaded = load_model(str(moe_dirs["qwen3_moe"][0]), "cpu", "float32")
    outs = {}
    for tp_inv in (True, False):
        engine = Scorer(loaded, config=EngineConfig(deterministic=Deterministic(tp_invariant=tp_inv))).engine
        outs[tp_inv] = [r.logprobs for r in engine.run(reqs)]
        blocks = [m.numerics.column_blocks for m in loaded.model.modules() if isinstance(m, (Linear, Experts))]
        assert all(b == tp_inv for b in blocks)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(outs[True], outs[False]))
    dense = load_model(str(tiny_dirs["llama"][0]), "cpu", "float32")
    Scorer(dense, config=EngineConfig(deterministic=True)).engine.run([ScoreRequest([5, 6, 7, 8], 1)])
    assert all(m.numerics.column_blocks for m in dense.model.modules() if isinstance(m, Linear))


def test_align_by_expert_asks_the_device_nothing():
    """The alignment sizes everything from the host's n, E and block_m: no op that reads a value
    back or sizes its output by one (on CUDA each would stall the host before the next pass is
    planned); the real tiles are those of the exact padding, then pad-only tiles."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from logprobe.kernels.moe import align_by_expert, padded_length

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, 8, (50, 3), generator=torch.Generator().manual_seed(0))
    with Ops() as ops:
        s, t = align_by_expert(ids, 8, 16)
    syncing = ("_local_scalar_dense", "nonzero", "bincount", "repeat_interleave", "unique", "is_nonzero")
    assert not [n for n in ops.names if any(x in n for x in syncing)]
    assert len(s) == padded_length(150, 8, 16) == 16 * len(t)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    real = int(((counts + 15) // 16).sum())  # the exact padding's tiles
    assert t[:real].tolist() == [e for e in range(8) for _ in range((int(counts[e]) + 15) // 16)]
    assert (s.view(-1, 16)[:real, 0] < 150).all() and (s[real * 16:] == 150).all()
    assert sorted(s[s < 150].tolist()) == list(range(150))

"""Phi-3 / Phi-4 (model_type "phi3") on the native model: fused qkv_proj / gate_up_proj split at
load, a sliding window, partial rotation and LongRoPE (short factors, attention factor) against a
float64 transformers forward; deterministic mode bitwise across mixes; the refusals named."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, ref_logprobs
from test_determinism import BUDGETS, random_mix, same

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.errors import LogprobeError
from logprobe.loading.hf import native_config

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
              eos_token_id=0, pad_token_id=0)
ORIGINAL = 128  # the LongRoPE model's original_max_position_embeddings
KINDS = {
    "phi3": dict(tie_word_embeddings=False),  # Phi-3-mini / Phi-4: default rope, untied
    "phi3_window": dict(tie_word_embeddings=False, sliding_window=16),  # Phi-3-mini-4k: a window that acts
    "phi4mini": dict(  # Phi-4-mini: LongRoPE, partial rotation, tied embeddings
        tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 2.0, 3.0, 4.0]}),
}


@pytest.fixture(scope="module")
def phi_dirs(tmp_path_factory):
    """kind -> (directory, float64 transformers model, native Scorer)."""
    import transformers as tf

    out = {}
    for seed, (kind, extra) in enumerate(KINDS.items()):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(tf.Phi3Config(**COMMON, **extra),
                                                    attn_implementation="eager").float().eval()
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = (d, model.double(), Scorer(str(d), device="cpu", dtype="float32", progress=False))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_transformers(kind, phi_dirs):
    _, ref, scorer = phi_dirs[kind]
    assert scorer.info.backend == "native" and scorer.info.architecture == "phi3"
    g = torch.Generator().manual_seed(3)
    lengths = [ORIGINAL, 97, 53] if kind == "phi4mini" else [120, 97, 53]  # LongRoPE: up to the original length
    seqs = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out = scorer.engine.run([ScoreRequest(s, 1, entropy=True) for s in seqs])
    for s, res in zip(seqs, out):
        lp = ref_logprobs(ref, s)[:-1]  # [L-1, V], float64 transformers, each sequence alone
        want = lp.gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        assert res.logprobs.shape[0] == len(s) - 1 > 50
        assert (res.logprobs.double() - want).abs().max() < 1e-4
        assert (res.entropy.double() + (lp.exp() * lp).sum(-1)).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["phi3_window", "phi4mini"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_mixes(kind, deterministic, phi_dirs):
    """Deterministic: each request's bits are the same alone and in shuffled mixes under every
    budget (chunks, shared prefixes); default mode within 1e-5."""
    _, _, scorer = phi_dirs[kind]
    reqs = random_mix(seed=7)
    assert max(len(r.tokens) for r in reqs) <= ORIGINAL
    loaded = scorer.loaded
    alone_engine = Scorer(loaded, config=EngineConfig(deterministic=deterministic, share_prefixes=False))
    alone = [alone_engine.engine.run([r])[0] for r in reqs]
    rng = random.Random(1)
    for budget in BUDGETS:
        for share in (True, False):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic, share_prefixes=share)
            out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
            for i, res in zip(order, out):
                same(alone[i], res, deterministic)


def test_longrope_refuses_past_the_original_length(phi_dirs):
    """transformers would switch the whole sequence to long_factor: refused, the key named."""
    _, _, scorer = phi_dirs["phi4mini"]
    with pytest.raises(LogprobeError) as e:
        scorer.engine.run([ScoreRequest(list(range(2, 2 + ORIGINAL + 1)), 1)])
    assert e.value.field == "rope_scaling" and "original_max_position_embeddings" in e.value.problem


def test_config_refusals():
    base = {"model_type": "phi3", **COMMON}
    cfg, why = native_config({**base, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    assert cfg is None and "rope_type 'dynamic'" in why
    cfg, why = native_config({**base, "hidden_act": "gelu"})
    assert cfg is None and "hidden_act" in why
    cfg, why = native_config({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    assert cfg is None and "short_factor" in why
    cfg, why = native_config({**base, "partial_rotary_factor": 0.3})  # 16 * 0.3 = 4.8 -> 4 dims: fine
    assert cfg is not None
    cfg, why = native_config({**base, "partial_rotary_factor": 0.1})  # 1 dim: odd
    assert cfg is None and "partial_rotary_factor" in why
    # old configs spell LongRoPE "su"; equal factor lists never switch, so nothing is refused
    cfg, _ = native_config({**base, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                     "long_factor": [1.0] * 8}})
    assert cfg.rope_scaling["rope_type"] == "longrope"


@pytest.mark.slow  # worker processes over gloo
def test_tensor_parallel_bitwise(phi_dirs):
    """TP = 2 (the fused tensors cut per rank after the split): deterministic bits equal TP = 1."""
    d, _, one = phi_dirs["phi4mini"]
    reqs = random_mix(seed=7)
    det = EngineConfig(deterministic=True)
    want = Scorer(one.loaded, config=det).engine.run(reqs)
    with Scorer(str(d), device="cpu", tensor_parallel_size=2, config=det) as s:
        got = s.engine.run(reqs)
    for a, b in zip(want, got):
        same(a, b, True)


def test_weight_update_takes_fused_names(phi_dirs, tmp_path):
    """update_weights with transformers' names (qkv_proj, gate_up_proj: cut into the native
    matrices, partial rotation rows interleaved) equals a fresh load of the new weights, bitwise."""
    import transformers as tf

    d, _, _ = phi_dirs["phi4mini"]
    torch.manual_seed(42)
    new = tf.AutoModelForCausalLM.from_config(tf.Phi3Config(**COMMON, **KINDS["phi4mini"])).float().eval()
    new.save_pretrained(str(tmp_path))
    byte_tokenizer()[0].save_pretrained(str(tmp_path))
    reqs = random_mix(seed=5)[:6]
    det = EngineConfig(deterministic=True)
    want = Scorer(str(tmp_path), device="cpu", dtype="float32", config=det).engine.run(reqs)
    s = Scorer(str(d), device="cpu", dtype="float32", config=det)
    s.update_weights(dict(new.state_dict()))
    for a, b in zip(want, s.engine.run(reqs)):
        same(a, b, True)
    bad = dict(new.state_dict())
    bad["model.layers.0.self_attn.qkv_proj.weight"] = bad["model.layers.0.self_attn.qkv_proj.weight"][:-1]
    with pytest.raises(LogprobeError, match="qkv_proj"):
        s.update_weights(bad)

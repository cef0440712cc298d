"""Gemma 4 (``models.gemma4``, ``loading.gemma4``) against float64 transformers.

Two tiny random checkpoints saved by transformers' own classes:

* ``gemma4_text`` (``Gemma4ForCausalLM``) with every text feature on: sliding blocks (window 12,
  shorter than the sequences) beside full blocks with their own head_dim and kv heads, keys as
  values on full blocks (``attention_k_eq_v``), proportional partial rotary on full blocks,
  per-layer embeddings, the last two blocks sharing keys and values of earlier ones with
  double-wide MLPs, ``layer_scalar``, and a final logit soft-cap small enough to matter.
* ``gemma4`` (``Gemma4ForConditionalGeneration``): the text tower under ``model.language_model.``
  with its vision tower (read; images: ``test_gemma4_images``), untied head, no per-layer embeddings.

Every weight is random (norm gains around 1, layer scalars too). The reference is transformers'
forward in float64, its ``Gemma4RMSNorm`` (float32 inside) replaced by the same function in float64.
Ours runs in float32: per-token log-probs within 1e-4; the window, the soft-cap and the KV sharing
each change the numbers (checked); chunks and shared prefixes longer than the window give the same
bits as each request alone in deterministic mode.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import VOCAB, byte_tokenizer

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.loading import load_model
from logprobe.loading.gemma4 import gemma4_config, gemma4_param_name
from logprobe.loading.loader import parallel_context

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4 import modeling_gemma4 as hfg4  # noqa: E402

TOL = 1e-4
WINDOW = 12
S, F = "sliding_attention", "full_attention"
ROPE = {S: {"rope_type": "default", "rope_theta": 100.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10_000.0}}
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, global_head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
            rope_parameters=ROPE, bos_token_id=1, eos_token_id=0, pad_token_id=0)
FULL_TEXT = dict(TEXT, num_hidden_layers=6, layer_types=[S, F, S, S, S, F], attention_k_eq_v=True,
                 num_global_key_value_heads=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                 num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=4.0)
KINDS = ["gemma4_text", "gemma4"]


def _model(kind: str):
    tf = transformers
    if kind == "gemma4_text":
        return tf.Gemma4ForCausalLM._from_config(tf.Gemma4TextConfig(**FULL_TEXT), attn_implementation="eager")
    text = dict(TEXT, num_hidden_layers=3, layer_types=[S, S, F], hidden_size_per_layer_input=0)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    cfg = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, tie_word_embeddings=False)
    return tf.Gemma4ForConditionalGeneration._from_config(cfg, attn_implementation="eager")


def _norm64(self, x):
    """transformers' Gemma4RMSNorm in float64 (its ``.float()`` would round to float32)."""
    x = x.double()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return out * self.weight.double() if self.with_scale else out


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg4.Gemma4RMSNorm, "forward", _norm64)
    out = {}
    for i, kind in enumerate(KINDS):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(i)
        model = _model(kind).float().eval()
        gen = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=gen))
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):
                    b.copy_(1.0 + 0.2 * torch.randn(b.shape, generator=gen))
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = (d, model.double())
    yield out
    mp.undo()


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _sequences() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (40, 90, 61)]


def _worst(scorer, ref, seqs) -> float:
    worst = 0.0
    for t, res in zip(seqs, scorer.engine.run([ScoreRequest(t, 1) for t in seqs])):
        want = _reference(ref, t)[:-1].gather(1, torch.tensor(t[1:])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
    return worst


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_float64_transformers(kind, gemma4_dirs):
    path, ref = gemma4_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == "Gemma4Model"
    cfg = scorer.loaded.model.config
    assert cfg.layer_head_dims[-1] == 16 and cfg.sliding_window == WINDOW
    seqs = _sequences()
    worst = _worst(scorer, ref, seqs)
    print(f"{kind}: max |delta| {worst:.2e}")
    assert worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e}"
    text = ref.config.get_text_config()
    text.sliding_window = 1000  # the window matters
    try:
        assert _worst(scorer, ref, seqs) > 1e-2
    finally:
        text.sliding_window = WINDOW


def test_every_text_feature_matters(gemma4_dirs):
    """The soft-cap, the per-layer embeddings and the KV sharing each move the numbers: a model
    that dropped one would fail the 1e-4 comparison above."""
    path, ref = gemma4_dirs["gemma4_text"]
    cfg = gemma4_config(json.loads((path / "config.json").read_text()))
    assert cfg.attention_k_eq_v and cfg.ple_dim == 8 and cfg.num_kv_shared_layers == 2
    assert cfg.producers == {4: 3, 5: 1} and cfg.final_logit_softcapping == 4.0
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seqs = _sequences()[:1]
    base = scorer.engine.run([ScoreRequest(seqs[0], 1)])[0].logprobs
    model = scorer.loaded.model
    head = type(model).head_params
    try:
        type(model).head_params = lambda self: type(head(self))(head(self).weight)  # no cap
        assert (scorer.engine.run([ScoreRequest(seqs[0], 1)])[0].logprobs - base).abs().max() > 1e-2
    finally:
        type(model).head_params = head
    w = model.embed_tokens_per_layer.weight
    saved = w.clone()
    try:
        w.zero_()
        assert (scorer.engine.run([ScoreRequest(seqs[0], 1)])[0].logprobs - base).abs().max() > 1e-3
    finally:
        w.copy_(saved)
    try:
        model.layers[4].producer = 2  # another earlier sliding block's keys and values
        assert (scorer.engine.run([ScoreRequest(seqs[0], 1)])[0].logprobs - base).abs().max() > 1e-3
    finally:
        model.layers[4].producer = 3


def _mix(seed: int) -> list[ScoreRequest]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for n_ctx in (30, 45):
        ctx = tok(n_ctx)
        for _ in range(3):
            cont = tok(rng.randint(1, 30))
            reqs.append(ScoreRequest(ctx + cont, len(ctx), temperature=rng.choice([1.0, 0.7]),
                                     top_k=rng.choice([0, 3, 40]), entropy=rng.random() < 0.4))
    reqs += [ScoreRequest(tok(100), 4), ScoreRequest(tok(6), 1)]
    return reqs


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_and_shared_prefixes_bitwise(kind, gemma4_dirs):
    path, ref = gemma4_dirs[kind]
    loaded = load_model(str(path), "cpu", "float32")
    reqs = _mix(3)
    single = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [single.engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):
        lp = torch.log_softmax(_reference(ref, r.tokens) / r.temperature, -1)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < TOL
    for budget, share in ((40, True), (64, False), (1 << 20, True)):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=share)
        out = Scorer(loaded, config=cfg).engine.run(reqs)
        for a, b in zip(alone, out):
            for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (kind, budget, share, name)


def test_config_refusals_and_keys(gemma4_dirs):
    raw = json.loads((gemma4_dirs["gemma4"][0] / "config.json").read_text())
    cfg = gemma4_config(raw)
    assert cfg.family == "gemma4" and cfg.ple_dim == 0 and not cfg.tie_word_embeddings
    for key, value, field in [
        ("enable_moe_block", True, "config.text_config.enable_moe_block"),
        ("attention_bias", True, "config.text_config.attention_bias"),
        ("use_bidirectional_attention", "all", "config.text_config.use_bidirectional_attention"),
        ("hidden_activation", "silu", "config.text_config.hidden_activation"),
        ("rope_parameters", {S: ROPE[S], F: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}},
         "config.text_config.rope_parameters.full_attention.rope_type"),
        ("per_layer_config", {"2": {"sliding_window": 4}}, "config.text_config.per_layer_config.2.sliding_window"),
        ("num_kv_shared_layers", 3, "config.text_config.num_kv_shared_layers"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            gemma4_config(bad)
        assert e.value.field == field, (key, e.value.field)
    # the release's form: global_head_dim / num_global_key_value_heads instead of per_layer_config
    text = {k: v for k, v in raw["text_config"].items() if k != "per_layer_config"}
    text.update(model_type="gemma4_text", global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True)
    hub = gemma4_config(text)
    assert hub.layer_head_dims == (12, 12, 32) and hub.layer_kv_heads == (2, 2, 1)
    assert gemma4_param_name("model.language_model.layers.0.mlp.up_proj.weight", cfg, "f") == "layers.0.mlp.up_proj.weight"
    # the vision tower and its embedder are read (``test_gemma4_images``), the audio tower is not
    assert gemma4_param_name("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", cfg, "f") == \
        "vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"
    assert gemma4_param_name("model.audio_tower.layers.0.weight", cfg, "f") is None
    with pytest.raises(LogprobeError, match="unexpected tensor"):
        gemma4_param_name("mtp.layers.0.weight", cfg, "f")
    assert parallel_context(cfg, 1, 2).size == 2  # tensor parallelism: tests/test_tp_families.py
    with pytest.raises(LogprobeError) as e:
        parallel_context(cfg, 0, 3)
    assert e.value.field == "tensor_parallel_size"
    scorer = Scorer(str(gemma4_dirs["gemma4"][0]), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="weights missing"):  # all or nothing: tests/test_update_gemma4_glm4_gpt_oss.py
        scorer.update_weights({"model.norm.weight": torch.zeros(48)})


def test_hooks_capture_and_zero_steer(gemma4_dirs):
    """resid_post of block l is transformers' hidden_states[l + 1] (layer scalar and per-layer
    embeddings included); a zero steer changes nothing."""
    path, ref = gemma4_dirs["gemma4_text"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 30)), "completion_token_ids": list(range(30, 45))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["embed", "blocks.2.resid_post"], "positions": "all"}])[0]
    got = {c.at: c.value for c in res.captures}
    with torch.no_grad():
        hs = ref(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states
    assert (got["embed"].double() - hs[0][0]).abs().max() < 1e-5
    assert (got["blocks.2.resid_post"].double() - hs[3][0]).abs().max() < 1e-4 * hs[3].abs().max()
    steered = scorer.logprobs([seq], steer=[{"at": "blocks.1.attn_out", "vector": [0.0] * 48}])[0]
    assert torch.equal(steered.logprobs, scorer.logprobs([seq])[0].logprobs)


@pytest.mark.parametrize("kind", KINDS)
def test_rotary_frequencies_are_transformers_bits(kind, gemma4_dirs):
    """The inverse frequencies per layer type equal transformers' float32 buffers bit for bit (its
    float64 forward keeps them too); float64 powers rounded once differ by an ulp, which moved a
    3,700-token completion's log-probs by 3.7e-5 against transformers' 1e-5 float32 error."""
    path, _ = gemma4_dirs[kind]
    model = load_model(str(path), "cpu", "float32").model
    ref = _model(kind).float()
    rotary = (ref.model.language_model if kind == "gemma4" else ref.model).rotary_emb
    for t in set(model.config.layer_types):
        assert torch.equal(getattr(model, f"inv_freq_{t}"), getattr(rotary, f"{t}_inv_freq")), t

"""Gemma 3 (``models.gemma``, ``loading.gemma``) against float64 transformers.

Two tiny random checkpoints saved by transformers' own classes with ``save_pretrained``: a text
model (``Gemma3ForCausalLM``, ``gemma3_text``, tied embeddings) and a multimodal one
(``Gemma3ForConditionalGeneration``, ``gemma3``: text weights under ``model.language_model.``, a
vision tower and projector to skip, untied head). Each has sliding-attention blocks with a window
of 16 (shorter than the test sequences) and a full-attention block, each type with its own rotary
base (linear scaling on the full blocks), ``query_pre_attn_scalar`` != head_dim, and every weight
random: the (1 + w) norms (transformers initialises them to zero, which would hide a w vs 1 + w
mix-up), q/k norms and the four per-block norms included.

The reference is transformers' forward in float64, its ``Gemma3RMSNorm`` (which casts to float32
inside) replaced by the same function in float64. Ours runs in float32 through ``Scorer``;
per-token log-probs agree to 1e-4 over sequences of 40-120 tokens. In deterministic mode chunks
(small budgets) and shared prefixes longer than the window give the same bits as each request alone.
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
from logprobe.engine.scheduler import Chunk, plan_work
from logprobe.loading import load_model
from logprobe.loading.gemma import gemma_config, gemma_param_name
from logprobe.loading.loader import parallel_context

transformers = pytest.importorskip("transformers")
from transformers.models.gemma3 import modeling_gemma3 as hfg3  # noqa: E402

TOL = 1e-4
WINDOW = 16
KINDS = ["gemma3_text", "gemma3"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=0, pad_token_id=0, rope_parameters=ROPE)
SLIDING, FULL = "sliding_attention", "full_attention"


def _model(kind: str):
    tf = transformers
    if kind == "gemma3_text":
        cfg = tf.Gemma3TextConfig(**TEXT, num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING])
        return tf.Gemma3ForCausalLM._from_config(cfg, attn_implementation="eager")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    cfg = tf.Gemma3Config(text_config=dict(TEXT, num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, SLIDING]),
                          vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=False)
    return tf.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager")


def _norm64(self, x):
    """transformers' Gemma3RMSNorm in float64 (its ``.float()`` would round to float32)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.double())


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg3.Gemma3RMSNorm, "forward", _norm64)
    out = {}
    for i, kind in enumerate(KINDS):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(i)
        model = _model(kind).float().eval()
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.copy_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=gen))
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = (d, model.double())
    yield out
    mp.undo()


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _sequences() -> list[dict]:
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    return [{"prompt_token_ids": tok(p), "completion_token_ids": tok(c)} for p, c in ((10, 30), (25, 55), (1, 119),
                                                                                        (60, 40))]


def _worst(scorer, ref, seqs) -> tuple[float, int]:
    worst, n = 0.0, 0
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo = len(seq["prompt_token_ids"]) - 1
        tgt = _reference(ref, ids)[lo:len(ids) - 1].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        n += len(tgt)
    return worst, n


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_float64_transformers(kind, gemma_dirs):
    path, ref = gemma_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == "GemmaModel"
    cfg = scorer.loaded.model.config
    assert cfg.tie_word_embeddings == (kind == "gemma3_text") and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.rope_local_theta) == (1e5, 4.0, 1e3)
    seqs = _sequences()
    worst, n = _worst(scorer, ref, seqs)
    print(f"{kind}: max |delta| {worst:.2e} over {n} tokens")
    assert n > 200 and worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e}"
    # the window is exercised: the same model without it is far from these numbers
    text = ref.config.get_text_config()
    text.sliding_window = 1000
    try:
        wide, _ = _worst(scorer, ref, seqs)
    finally:
        text.sliding_window = WINDOW
    assert wide > 1e-2


def _mix(seed: int) -> list[ScoreRequest]:
    """Groups sharing a context longer than the window (16..70 tokens), long requests that chunk,
    duplicates, partial score windows and mixed head options."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for n_ctx in (50, 70, 20):
        ctx = tok(n_ctx)
        for _ in range(3):
            cont = tok(rng.randint(1, 40))
            sb = len(ctx) if rng.random() < 0.6 else rng.randint(1, len(ctx) + len(cont) - 1)
            reqs.append(ScoreRequest(ctx + cont, sb, temperature=rng.choice([1.0, 0.7]), top_k=rng.choice([0, 3]),
                                     entropy=rng.random() < 0.3))
    for n in (120, 90, 5):
        t = tok(n)
        reqs.append(ScoreRequest(t, rng.randint(1, n - 1)))
    reqs.append(ScoreRequest(list(reqs[0].tokens), reqs[0].score_begin))
    return reqs


def test_chunks_and_shared_prefixes_bitwise(gemma_dirs):
    """Deterministic mode: each request alone is the float64 reference (to 1e-4), and packed with
    shared prefixes longer than the window and cut into chunks by small budgets it keeps its bits."""
    path, ref = gemma_dirs["gemma3_text"]
    loaded = load_model(str(path), "cpu", "float32")
    reqs = _mix(3)
    alone_scorer = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [alone_scorer.engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):
        lp = torch.log_softmax(_reference(ref, r.tokens) / r.temperature, -1)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < TOL
    rng = random.Random(1)
    for budget in (64, 100, 1 << 20):
        for share in (True, False):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=share)
            out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
            for i, res in zip(order, out):
                for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                    x, y = getattr(alone[i], name), getattr(res, name)
                    assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (budget, share, name)
    inputs = [r.tokens[:-1] for r in reqs]
    shared = [t for b in plan_work(inputs, 1 << 20) for t in b if getattr(t, "shared", 0)]
    assert shared and max(t.shared for t in shared) > WINDOW  # a shared prefix longer than the window
    assert any(isinstance(b[0], Chunk) and b[0].begin > WINDOW for b in plan_work(inputs, 64))


def test_hooks_capture_and_zero_steer(gemma_dirs):
    """resid_post of a block is transformers' hidden_states[l + 1]; a zero steer changes nothing."""
    path, ref = gemma_dirs["gemma3_text"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 40)), "completion_token_ids": list(range(40, 60))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["embed", "blocks.3.resid_post"], "positions": "all"}])[0]
    got = {c.at: c.value for c in res.captures}
    with torch.no_grad():
        hs = ref(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states
    assert (got["embed"].double() - hs[0][0]).abs().max() < 1e-5
    assert (got["blocks.3.resid_post"].double() - hs[4][0]).abs().max() < 1e-3 * hs[4].abs().max()
    steered = scorer.logprobs([seq], steer=[{"at": "blocks.1.attn_out", "vector": [0.0] * 64}])[0]
    assert torch.equal(steered.logprobs, scorer.logprobs([seq])[0].logprobs)


def test_config_refusals_and_keys(gemma_dirs):
    raw = json.loads((gemma_dirs["gemma3"][0] / "config.json").read_text())
    cfg = gemma_config(raw)
    assert cfg.family == "gemma3" and cfg.layer_types[1] == FULL and not cfg.tie_word_embeddings
    for key, value, field in [
        ("final_logit_softcapping", -30.0, "config.text_config.final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "config.text_config.attn_logit_softcapping"),
        ("use_bidirectional_attention", True, "config.text_config.use_bidirectional_attention"),
        ("attention_bias", True, "config.text_config.attention_bias"),
        ("hidden_activation", "silu", "config.text_config.hidden_activation"),
        ("layer_types", [SLIDING, "chunked_attention", SLIDING, SLIDING], "config.text_config.layer_types"),
        ("rope_parameters", {FULL: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}, SLIDING: None},
         "config.text_config.rope_parameters.full_attention.rope_type"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            gemma_config(bad)
        assert e.value.field == field, (key, e.value.field)
    # the hub's format: rope_theta / rope_local_base_freq / rope_scaling, sliding_window_pattern
    text = {k: v for k, v in raw["text_config"].items() if k not in ("rope_parameters", "layer_types")}
    text.update(model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4, num_hidden_layers=12,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6)
    hub = gemma_config(text)
    assert hub.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2
    assert (hub.rope_theta, hub.rope_scaling, hub.rope_local_theta) == (1e6, {"rope_type": "linear", "factor": 8.0},
                                                                        1e4)
    assert gemma_param_name("language_model.model.layers.0.mlp.up_proj.weight", cfg, "f") == "layers.0.mlp.up_proj.weight"
    assert gemma_param_name("language_model.lm_head.weight", cfg, "f") == "lm_head.weight"
    # the tower and projector are read (``test_gemma3_images``), the hub's vision_model. level dropped;
    # SigLIP's pooling head is not
    assert gemma_param_name("vision_tower.vision_model.post_layernorm.weight", cfg, "f") == \
        "vision_tower.post_layernorm.weight"
    assert gemma_param_name("model.multi_modal_projector.mm_input_projection_weight", cfg, "f") == \
        "multi_modal_projector.mm_input_projection_weight"
    assert gemma_param_name("model.vision_tower.head.probe", cfg, "f") is None
    with pytest.raises(LogprobeError, match="unexpected tensor"):
        gemma_param_name("mtp.layers.0.weight", cfg, "f")
    raw["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(LogprobeError) as e:
        gemma_config(raw)
    assert e.value.field == "quantization_config"
    with pytest.raises(LogprobeError) as e:
        parallel_context(cfg, 0, 3)  # 3 does not divide the 4 heads
    assert e.value.field == "tensor_parallel_size"


def test_partial_weight_update_refused(gemma_dirs):
    path, _ = gemma_dirs["gemma3_text"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="missing"):  # a partial update (tests/test_update_families.py)
        scorer.update_weights({"model.norm.weight": torch.zeros(64)})


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes (~10 s)
def test_tp2_equals_tp1(gemma_dirs):
    """TP = 2 (2 query heads and 1 kv head a rank, half the MLP, half the vocabulary) against TP = 1:
    deterministic mode bitwise, with shared prefixes longer than the window and chunks; default
    mode within 1e-5."""
    path = str(gemma_dirs["gemma3"][0])
    shared = list(range(3, 73))
    seqs = _sequences() + [{"prompt_token_ids": shared, "completion_token_ids": [9, 10, 11]},
                           {"prompt_token_ids": shared, "completion_token_ids": list(range(80, 120))}]
    opts = dict(temperature=0.7, top_k=5, entropy=True)
    one = Scorer(path, device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det)
        want[det] = one.logprobs(seqs, **opts)
    with Scorer(path, device="cpu", dtype="float32", progress=False, tensor_parallel_size=2) as s:
        for det in (False, True):
            s.config = EngineConfig(deterministic=det, max_batch_tokens=64)
            for x, y in zip(s.logprobs(seqs, **opts), want[det]):
                if det:
                    assert all(torch.equal(getattr(x, f), getattr(y, f)) for f in ("logprobs", "entropy", "topk_ids",
                                                                                    "topk_logprobs"))
                else:
                    assert (x.logprobs - y.logprobs).abs().max() <= 1e-5


def test_multimodal_checkpoint_loads_its_towers(gemma_dirs, caplog):
    """A Gemma 3 image-text checkpoint loads its text model and its vision tower and projector
    (``models.gemma3_vision``, ``test_gemma3_images``); SigLIP's pooling head (this config keeps
    ``vision_use_head``), which Gemma 3 never reads, is skipped and counted in one warning."""
    import logging

    from safetensors import safe_open

    path = gemma_dirs["gemma3"][0]
    towers = heads = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names = [k.removeprefix("model.").replace("vision_model.", "") for k in st.keys()]
            towers += sum(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in names)
            heads += sum(k.startswith("vision_tower.head.") for k in names)
    with caplog.at_level(logging.WARNING):
        scorer = Scorer(str(path), device="cpu", dtype="float32")
    held = sum(1 for n, _ in scorer.loaded.model.named_parameters()
               if n.startswith(("vision_tower.", "multi_modal_projector.")))
    assert heads > 0 and held == towers - heads
    assert f"skipped {heads} tensors not used to score text (the vision tower's pooling head)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Scorer(str(gemma_dirs["gemma3_text"][0]), device="cpu", dtype="float32")
    assert "not used to score text" not in caplog.text

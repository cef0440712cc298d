"""Qwen3-VL and Qwen3-VL MoE natively (``models.qwen3_vl``, ``loading.qwen3_vl``): text given images
and text alone against transformers' float64 forward.

Tiny random ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``
checkpoints (text: 3 Qwen3 blocks, head_dim 32, mrope_section [6, 5, 5]; vision: depth 3 with
deepstack mergers at blocks 0 and 2, patch 8; images of 32-48 px), saved by transformers with the
Qwen3.5 image test's byte tokenizer and processor. The MoE checkpoint stores its experts as the
released checkpoints do (gate_up_proj [E, H, 2I], down_proj [E, I, H]). The reference is the
in-memory transformers model in float64 (its RMSNorm, which rounds to float32, run in float64).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import VOCAB, copy_checkpoint, png_bytes, random_image, tensor_parallel_matches_one

from logprobe import LogprobeError, Scorer
from logprobe.loading.qwen3_vl import qwen3_vl_config
from logprobe.models.qwen3_5_vision import VisionTower, vision_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
from test_qwen3_5_images import IDS, IMAGE_ID, PAD, _reference, _save_processor  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hfvl  # noqa: E402
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hfvlmoe  # noqa: E402

TOL = 1e-5
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2,
              deepstack_visual_indexes=[0, 2])
MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_parameters=MROPE)
MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)  # H = 64 != 2I = 48: layouts differ


def _norm64(self, x):
    """transformers' RMSNorm in float64 (its ``.to(torch.float32)`` would round)."""
    x = x.double()
    return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfvl.Qwen3VLTextRMSNorm, "forward", _norm64)
    mp.setattr(hfvlmoe.Qwen3VLMoeTextRMSNorm, "forward", _norm64)
    out = {}
    for kind in ("dense", "moe"):
        d = tmp_path_factory.mktemp(f"qwen3_vl_{kind}")
        out[kind] = (d, _save(d, kind).double())
    yield out
    mp.undo()


def _save(d, kind: str):
    tf = transformers
    torch.manual_seed(0)
    if kind == "dense":
        cfg, cls = tf.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, **IDS), tf.Qwen3VLForConditionalGeneration
    else:
        cfg = tf.Qwen3VLMoeConfig(text_config=dict(TEXT, **MOE), vision_config=VISION, **IDS)
        cls = tf.Qwen3VLMoeForConditionalGeneration
    model = cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.dim() == 1 and "norm" in name and "visual" not in name else 0.0
            p.copy_(base + (0.3 if "visual" in name else 0.1) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(d))
    if kind == "moe":  # the released layout: each expert matrix transposed
        from safetensors.torch import load_file, save_file
        for f in d.glob("*.safetensors"):
            tensors = load_file(str(f))
            save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in tensors.items()},
                      str(f), metadata={"format": "pt"})
    _save_processor(d)
    return model


def _sequences() -> list[dict]:
    return [
        {"prompt": f"Look: {PAD} what is it?", "completion": " A red square, mostly.",
         "images": [random_image(32, 48, 1)]},
        {"prompt": f"{PAD} and {PAD}: same?", "completion": " No, they differ.",
         "images": [png_bytes(random_image(48, 48, 2)), random_image(32, 32, 3)]},
    ]


def test_vision_tower_with_deepstack_matches_transformers():
    """The tower's merger output and deepstack features (blocks in the config's order, sorted or
    not) against ``Qwen3VLVisionModel`` in float64."""
    for indexes in ([0, 2], [2, 0]):
        cfg = transformers.Qwen3VLVisionConfig(**dict(VISION, deepstack_visual_indexes=indexes))
        torch.manual_seed(0)
        hf = hfvl.Qwen3VLVisionModel._from_config(cfg, attn_implementation="eager").double()
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(0.3 * torch.randn(p.shape))
        ours = VisionTower(vision_config(cfg.to_dict(), deepstack=True))
        ours.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
        grids = [(1, 4, 6), (1, 6, 6), (2, 2, 4)]
        px = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8)
        with torch.no_grad():
            out = hf(px.double(), grid_thw=torch.tensor(grids))
            ref = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)  # [n, 3 * 64]
            got, a = [], 0
            for t, h, w in grids:
                got.append(ours(px[a:a + t * h * w], (t, h, w)))
                a += t * h * w
        assert ref.shape == (19, 192) and (torch.cat(got).double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_images_match_float64_transformers(kind, vl_dirs):
    path, ref = vl_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert type(scorer.engine.model).__name__ == {"dense": "Qwen3VLModel", "moe": "Qwen3VLMoeModel"}[kind]
    worst, compared = 0.0, 0
    for seq, res in zip(_sequences(), scorer.logprobs(_sequences())):
        want, completion, images = _reference(ref, path, seq)
        assert images >= 6 and len(res.logprobs) == len(completion)
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
        compared += len(want)
    print(f"{kind}: max |delta| {worst:.2e} over {compared} tokens")
    assert compared > 30 and worst < TOL


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_matches_float64_transformers(kind, vl_dirs):
    path, ref = vl_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    ids = [list(range(2, 60)), [5, 9, 200, 17, 33, 33, 250, 4] * 5]
    out = scorer.logprobs([{"prompt_token_ids": s[:10], "completion_token_ids": s[10:]} for s in ids])
    worst = 0.0
    for s, res in zip(ids, out):
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([s]), use_cache=False).logits[0].double()
        want = torch.log_softmax(logits, -1)[9:-1].gather(1, torch.tensor(s[10:])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
    print(f"{kind}: text max |delta| {worst:.2e}")
    assert worst < TOL


def test_images_batched_with_text_and_alone(vl_dirs):
    """Deterministic mode: a request with images gives the same bits batched among text requests
    and others with images as alone; another image moves its numbers (the images, and their
    deepstack features, matter)."""
    path, _ = vl_dirs["moe"]
    text = {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))}
    seqs = [text, *_sequences()]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    together = scorer.logprobs(seqs)
    for seq, res in zip(seqs, together):
        assert torch.equal(scorer.logprobs([seq])[0].logprobs, res.logprobs)
    other = dict(seqs[1], images=[random_image(32, 48, 9)])
    assert (scorer.logprobs([other])[0].logprobs - together[1].logprobs).abs().max() > 1e-4


def test_deepstack_is_added(vl_dirs, tmp_path):
    """Zeroing a deepstack merger's output projection changes the scores of text after an image
    (the features reach the text model), and leaves a text-only prompt's bits alone."""
    path, _ = vl_dirs["dense"]
    zeroed = copy_checkpoint(path, tmp_path / "zeroed")
    from safetensors.torch import load_file, save_file
    for f in zeroed.glob("*.safetensors"):
        t = load_file(str(f))
        for k in [k for k in t if "deepstack_merger_list" in k and "linear_fc2" in k]:
            t[k] = torch.zeros_like(t[k])
        save_file(t, str(f), metadata={"format": "pt"})
    text = {"prompt_token_ids": list(range(2, 30)), "completion_token_ids": list(range(40, 60))}
    a, b = (Scorer(str(p), device="cpu", dtype="float32", progress=False, deterministic=True)
            .logprobs([text, _sequences()[0]]) for p in (path, zeroed))
    assert torch.equal(a[0].logprobs, b[0].logprobs)
    assert (a[1].logprobs - b[1].logprobs).abs().max() > 1e-4


def test_config_refusals(vl_dirs):
    raw = json.loads((vl_dirs["moe"][0] / "config.json").read_text())
    cfg = qwen3_vl_config(raw)
    assert cfg.vision.deepstack == (0, 2) and cfg.mrope_section == (6, 5, 5) and cfg.moe.norm_topk_prob
    assert cfg.image_token_id == IMAGE_ID and cfg.family == "qwen3_vl_moe"
    for where, key, value, field in [
        ("vision_config", "deepstack_visual_indexes", [0, 3], "config.vision_config.deepstack_visual_indexes"),
        ("vision_config", "deepstack_visual_indexes", [1, 1], "config.vision_config.deepstack_visual_indexes"),
        ("vision_config", "out_hidden_size", 32, "config.vision_config.out_hidden_size"),
        ("text_config", "model_type", "qwen3_vl_text", "config.text_config.model_type"),
        ("text_config", "rope_parameters", dict(MROPE, mrope_interleaved=False),
         "config.text_config.rope_parameters.mrope_interleaved"),
        ("text_config", "rope_parameters", dict(MROPE, rope_type="yarn", factor=2.0),
         "config.text_config.rope_parameters.rope_type"),
        ("text_config", "rope_parameters", dict(MROPE, mrope_section=[6, 5]),
         "config.text_config.rope_parameters.mrope_section"),
        (None, "quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ]:
        bad = json.loads(json.dumps(raw))
        (bad if where is None else bad[where])[key] = value
        with pytest.raises(LogprobeError) as e:
            qwen3_vl_config(bad)
        assert e.value.field == field, (key, str(e.value))


@pytest.mark.slow  # two gloo worker processes per model: ~3 s each alone on 2 cores
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_images_under_tensor_parallelism(kind, vl_dirs):
    """The tower whole on every rank: TP = 2 over gloo workers (the MoE with its experts split,
    EP = 2, attention data-parallel: each rank adds the deepstack features of its own rows) gives
    TP = 1's numbers for requests with images among text ones, bitwise in deterministic mode,
    within 1e-5 otherwise."""
    path, _ = vl_dirs[kind]
    seqs = [_sequences()[0], {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 70))},
            _sequences()[1]]
    tensor_parallel_matches_one(path, seqs)


def test_mrope_text_rows_rotate_as_plain_positions():
    """[3, T] positions of three equal rows (a text request in a pass with images) rotate q/k with
    the bits of [T] positions (a pass of text alone): the table is laid out alike (a transposed
    table took another CPU path through the complex multiply: 2e-7 off on this 16-pair head)."""
    from logprobe.layers.rotary import MRotaryEmbedding, apply_rotary

    rotary, p = MRotaryEmbedding(32, 1e6, (6, 5, 5)), torch.arange(300)
    x = torch.randn(300, 4, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(apply_rotary(x, rotary(p)), apply_rotary(x, rotary(p.expand(3, -1).contiguous())))


@pytest.mark.slow  # slow tier (pytest -m slow): ~3 s
def test_update_weights_takes_text_and_tower(vl_dirs, tmp_path):
    """``update_weights`` with a trainer's Qwen3-VL MoE ``named_parameters()`` (experts as
    transformers holds them, the tower and its deepstack mergers among them, all moved): bitwise
    a fresh Scorer on the checkpoint the trainer saves (deterministic mode)."""
    from logprobe.config import EngineConfig

    path, ref = vl_dirs["moe"]
    trainer = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(path)).float()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    trainer.save_pretrained(str(tmp_path))
    _save_processor(tmp_path)
    cfg = EngineConfig(deterministic=True, progress=False)
    scorer = Scorer(str(path), device="cpu", dtype="float32", config=cfg)
    before = scorer.logprobs(_sequences())
    scorer.update_weights(trainer.named_parameters())
    want = Scorer(str(tmp_path), device="cpu", dtype="float32", config=cfg).logprobs(_sequences())
    for got, new, old in zip(scorer.logprobs(_sequences()), want, before):
        assert torch.equal(got.logprobs, new.logprobs) and not torch.equal(got.logprobs, old.logprobs)

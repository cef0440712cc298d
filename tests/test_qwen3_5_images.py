"""Text scored given images, Qwen3.5 (``models.qwen3_5_vision``, ``engine.images``, ``scoring.images``).

Tiny random ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``
checkpoints (vision depth 2, hidden 32, patch 8; images of 32-48 px), saved by transformers with a
byte tokenizer that holds the vision tokens and a ``Qwen2VLImageProcessorPil``. The reference is
transformers' forward in float64 (its hybrid modules as ``test_qwen3_next`` makes them float64) on
the same ids, ``pixel_values`` and grids; ours runs in float32 through ``Scorer.logprobs``.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from helpers import (
    byte_tokenizer,
    copy_checkpoint,
    make_hf_dir,
    png_bytes,
    random_image,
    tensor_parallel_matches_one,
)

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.layers.rotary import MRotaryEmbedding
from logprobe.loading.collective import covers
from logprobe.loading.hybrid import hybrid_config
from logprobe.models.qwen3_5_vision import VisionTower, mrope_positions, vision_config

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
from test_qwen3_next import TEXT, _float64, _offset_norm64, _randomise, hf35, hf35moe  # noqa: E402

TOL = 1e-5  # measured: 3.1e-6 dense, 2.8e-6 MoE
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids 258 .. 261
IMAGE_ID = 260
MROPE = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
         "mrope_interleaved": True}
IDS = dict(image_token_id=IMAGE_ID, video_token_id=261, vision_start_token_id=258, vision_end_token_id=259)
SEEDS = {"qwen3_5": 101, "qwen3_5_moe": 109}
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + PAD + "{% else %}{{ p['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen's rendering of image parts


def _make(kind: str):
    tf = transformers
    if kind == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config=dict(**TEXT, intermediate_size=96, rope_parameters=MROPE),
                               vision_config=VISION, **IDS)
        cls = tf.Qwen3_5ForConditionalGeneration
    else:
        cfg = tf.Qwen3_5MoeConfig(text_config=dict(**TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                   num_experts=8, num_experts_per_tok=2, rope_parameters=MROPE),
                                  vision_config=VISION, **IDS)
        cls = tf.Qwen3_5MoeForConditionalGeneration
    return cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager")


def _save_processor(path) -> None:
    tok = byte_tokenizer()[0]
    tok.add_special_tokens({"additional_special_tokens": TOKENS})
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_ID
    tok.chat_template = CHAT
    tok.save_pretrained(str(path))
    transformers.Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                          size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
                                          ).save_pretrained(str(path))


def save_vl_checkpoint(d, kind: str = "qwen3_5"):
    """The tiny VL checkpoint of ``kind`` with its processor files, saved in ``d``; returns the
    float32 transformers model (the other image test files' checkpoint too)."""
    torch.manual_seed(0)
    model = _make(kind).float().eval()
    _randomise(model, seed=SEEDS[kind])
    model.save_pretrained(str(d))
    _save_processor(d)
    return model


@pytest.fixture(scope="module")
def float64_reference():
    mp = pytest.MonkeyPatch()
    for mod, prefix in ((hf35, "Qwen3_5"), (hf35moe, "Qwen3_5Moe")):
        mp.setattr(mod, "torch_chunk_gated_delta_rule", _float64(mod.torch_chunk_gated_delta_rule))
        gated = getattr(mod, f"{prefix}RMSNormGated")
        mp.setattr(gated, "forward", _float64(gated.forward))
        mp.setattr(getattr(mod, f"{prefix}RMSNorm"), "forward", _offset_norm64)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory, float64_reference):
    out = {}
    for kind in ("qwen3_5", "qwen3_5_moe"):
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, save_vl_checkpoint(d, kind).double())
    return out


_image, _png = random_image, png_bytes  # helpers': seeded random RGB images, as PNG bytes


def _sequences() -> list[dict]:
    return [
        {"prompt": f"Look: {PAD} what is it?", "completion": " A red square, mostly.", "images": [_image(32, 48, 1)]},
        {"prompt": f"{PAD} and {PAD}: same?", "completion": " No, they differ.",
         "images": [_png(_image(48, 48, 2)), _image(32, 32, 3)]},
    ]


def _reference(model, processor_dir, seq: dict) -> tuple[torch.Tensor, list[int], int]:
    """float64 log-probs of the completion tokens, transformers' own processing of the images."""
    tok = transformers.AutoTokenizer.from_pretrained(str(processor_dir))
    ip = transformers.AutoImageProcessor.from_pretrained(str(processor_dir))
    images = [PIL.open(io.BytesIO(x)).convert("RGB") if isinstance(x, bytes) else x for x in seq["images"]]
    px = ip(images=images, return_tensors="pt")
    text = seq["prompt"]
    for t, h, w in px["image_grid_thw"].tolist():  # Qwen3VLProcessor.replace_image_token
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
    prompt = tok.encode(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)
    completion = tok.encode(seq["completion"], add_special_tokens=False)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=px["pixel_values"].double(), image_grid_thw=px["image_grid_thw"],
                       mm_token_type_ids=(ids == IMAGE_ID).int(), use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return lp[n - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0], completion, int((ids == IMAGE_ID).sum())


def test_mrope_positions_gold_table():
    """Two text tokens, an image of grid (1, 4, 6) merged by 2 (2 x 3 tokens), two text tokens."""
    ids = [7, 8] + [IMAGE_ID] * 6 + [5, 6]
    assert mrope_positions(ids, IMAGE_ID, [(1, 4, 6)], 2).tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],  # t
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],  # h
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],  # w
    ]


def test_mrope_rotary_matches_transformers():
    """Our rotations of [3, T] positions against transformers' cos / sin, and against float64."""
    cfg = transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=96, rope_parameters=MROPE)
    hf = hf35.Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.randint(0, 500, (3, 40))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos[:, None, :])  # [1, T, r]
    ours = MRotaryEmbedding(8, 1e6, (2, 1, 1))(pos)  # [T, 4]
    # inv_freq rounded from float64 here, computed in float32 there: angles one ulp apart at most
    assert (ours.real - cos[0, :, :4]).abs().max() < 1e-5 and (ours.imag - sin[0, :, :4]).abs().max() < 1e-5
    inv = 1.0 / (1e6 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    rows = torch.tensor([0, 1, 2, 0])  # pair j's row: t, h, w, t
    exact = pos.double()[rows].T * inv
    assert (ours.real.double() - exact.cos()).abs().max() < 1e-4  # float32 angles up to ~500
    assert torch.equal(MRotaryEmbedding(8, 1e6, (2, 1, 1))(pos[0]), MRotaryEmbedding(8, 1e6, (2, 1, 1))(
        pos[0].expand(3, -1)))  # text: the plain path is the three equal rows


def test_vision_tower_matches_transformers():
    cfg = transformers.Qwen3_5VisionConfig(**VISION)
    torch.manual_seed(0)
    hf = hf35.Qwen3_5VisionModel._from_config(cfg, attn_implementation="eager").double()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    ours = VisionTower(vision_config(cfg.to_dict()))
    ours.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    grids = [(1, 4, 6), (1, 6, 6), (2, 2, 4)]
    px = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8)
    with torch.no_grad():
        ref = hf(px.double(), grid_thw=torch.tensor(grids)).pooler_output
        got, a = [], 0
        for g in grids:
            got.append(ours(px[a:a + g[0] * g[1] * g[2]], g))
            a += g[0] * g[1] * g[2]
    assert (torch.cat(got).double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_images_match_float64_transformers(kind, vl_dirs):
    path, ref = vl_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seqs = _sequences()
    out = scorer.logprobs(seqs)
    worst, compared = 0.0, 0
    for seq, res in zip(seqs, out):
        want, completion, images = _reference(ref, path, seq)
        assert images >= 6 and len(res.logprobs) == len(completion)
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
        compared += len(want)
    print(f"{kind}: max |delta| {worst:.2e} over {compared} tokens")
    assert compared > 30 and worst < TOL


def test_a_group_sharing_its_images_reads_them_once(vl_dirs, monkeypatch):
    """An RL group's requests share their images (the same objects): one call reads and
    processes them once, and each request's numbers are its own alone; a later call reads them
    again (a PIL image may change between calls)."""
    from logprobe.scoring.images import ImageReader

    path, _ = vl_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    images = [_image(32, 48, 1), _image(32, 32, 3)]
    group = [{"prompt": f"{PAD} and {PAD}:", "completion": c, "images": images} for c in (" same", " not", " both")]
    calls, real = [], ImageReader.processor

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(ImageReader, "processor", counted)
    together = scorer.logprobs(group)
    assert len(calls) == 1
    alone = [scorer.logprobs([seq])[0] for seq in group]
    assert len(calls) == 4
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, together))


def test_an_image_runs_through_the_tower_once_per_call(vl_dirs, monkeypatch):
    """A group's requests in separate batches (a budget of one request a pass): each distinct
    image is hashed once and runs through the tower once in the call (it ran once per request
    and batch), with the numbers of one batch, bitwise in deterministic mode."""
    import hashlib

    from logprobe.scoring import images as scoring_images

    path, _ = vl_dirs["qwen3_5"]
    images = [_image(32, 48, 1), _image(32, 32, 3)]
    group = [{"prompt": f"{PAD} and {PAD}:", "completion": c, "images": images} for c in (" same", " not", " both")]
    whole = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True).logprobs(group)
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True,
                    max_batch_tokens=48)
    model = scorer.loaded.model
    towers, hashes, real, sha256 = [], [], model.encode_image, hashlib.sha256
    monkeypatch.setattr(model, "encode_image", lambda *a: towers.append(1) or real(*a))
    monkeypatch.setattr(scoring_images.hashlib, "sha256", lambda *a: hashes.append(1) or sha256(*a))
    passes = scorer.engine.passes
    split = scorer.logprobs(group)
    assert scorer.engine.passes - passes >= 2 and len(towers) == 2 and len(hashes) == 2
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(whole, split))
    # a request's tower outputs go with its result: held only while it has rows to run
    requests = scorer.logprobs_job(group).requests
    held = []
    scorer.engine.run(requests, on_result=lambda i, r: held.append(requests[i].images.embeds))
    assert len(held) == 3 and all(e is None for e in held)


def test_images_batched_with_text_and_alone(vl_dirs):
    path, _ = vl_dirs["qwen3_5"]
    text = [{"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))},
            {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(90, 99))}]
    seqs = _sequences()
    for deterministic in (False, True):
        scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=deterministic)
        together = scorer.logprobs([text[0], seqs[0], text[1], seqs[1]])
        alone = [scorer.logprobs([s])[0] for s in (text[0], seqs[0], text[1], seqs[1])]
        for a, b in zip(alone, together):
            if deterministic:
                assert torch.equal(a.logprobs, b.logprobs)
            else:
                assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    # the images matter: another image gives other numbers for the same text
    other = dict(seqs[0], images=[_image(32, 48, 9)])
    assert (scorer.logprobs([other])[0].logprobs - alone[1].logprobs).abs().max() > 1e-4


def test_chunked_request_with_images(vl_dirs):
    """A request longer than the budget runs in chunks (64-row grid): same numbers as whole."""
    path, _ = vl_dirs["qwen3_5"]
    seq = {"prompt": f"{'word ' * 12}{PAD} then {PAD}.", "completion": " and the rest " * 4,
           "images": [_image(48, 48, 4), _image(32, 48, 5)]}
    whole = Scorer(str(path), device="cpu", dtype="float32", progress=False).logprobs([seq])[0]
    small = Scorer(str(path), device="cpu", dtype="float32", progress=False, max_batch_tokens=64)
    assert (small.logprobs([seq])[0].logprobs - whole.logprobs).abs().max() < 1e-5
    assert small.engine.passes >= 2  # it ran in chunks


@pytest.mark.slow  # slow tier (pytest -m slow): ~4.5 s
def test_bad_image_inputs(vl_dirs, tmp_path):
    path, _ = vl_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    good = _sequences()[0]
    png = _png(_image(32, 32, 0))
    cases = [
        (dict(good, images=[b"not an image at all"]), "sequences[1].images[0]"),
        (dict(good, images=[png[:len(png) // 2]]), "sequences[1].images[0]"),  # truncated
        (dict(good, images=[str(tmp_path / "missing.png")]), "sequences[1].images[0]"),
        (dict(good, images=["data:text/plain;base64,aGk="]), "sequences[1].images[0]"),
        (dict(good, images=[png, png]), "sequences[1].images"),  # 2 images, 1 placeholder
        (dict(good, images=[]), "sequences[1].images"),
        (dict(good, completion=" then <|image_pad|>"), "sequences[1].completion"),
        ({"prompt_token_ids": [2, 3], "completion_token_ids": [4], "images": [png]}, "sequences[1].images"),
        ({"completion": "x", "images": [png]}, "sequences[1].prompt"),
    ]
    for seq, field in cases:
        with pytest.raises(LogprobeError) as e:
            scorer.logprobs([_sequences()[1], seq])
        assert e.value.field == field, (field, str(e.value))
    data_url = "data:image/png;base64," + __import__("base64").b64encode(png).decode()
    assert len(scorer.logprobs([dict(good, images=[data_url])])[0].logprobs) > 5


def test_images_for_a_text_only_model(tmp_path):
    make_hf_dir(tmp_path, "llama")
    scorer = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError) as e:
        scorer.logprobs([{"prompt_token_ids": [2], "completion_token_ids": [3]},
                         {"prompt": "a <|image_pad|>", "completion": "b", "images": [_png(_image(32, 32, 0))]}])
    assert e.value.field == "sequences[1].images" and "no vision tower" in str(e.value)


def test_vision_config_refusals(vl_dirs):
    raw = json.loads((vl_dirs["qwen3_5"][0] / "config.json").read_text())
    cfg = hybrid_config(raw)
    assert cfg.vision.depth == 2 and cfg.image_token_id == IMAGE_ID and cfg.mrope_section == (2, 1, 1)
    for key, value, field in [
        ("hidden_act", "relu", "config.vision_config.hidden_act"),
        ("window_size", 112, "config.vision_config.window_size"),
        ("deepstack_visual_indexes", [1], "config.vision_config.deepstack_visual_indexes"),
        ("num_position_embeddings", 15, "config.vision_config.num_position_embeddings"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "config.vision_config.rope_parameters"),
        ("out_hidden_size", 32, "config.vision_config.out_hidden_size"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["vision_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            hybrid_config(bad)
        assert e.value.field == field
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 2]
    with pytest.raises(LogprobeError) as e:
        hybrid_config(bad)
    assert e.value.field == "config.text_config.rope_parameters.mrope_section"


def test_chat_with_image_parts(vl_dirs):
    """Image parts of a chat: the same numbers as the rendered prompt with its images through
    ``logprobs``; an image in the scored message, or fetched from the web, is refused by name."""
    path, _ = vl_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    png = _png(_image(48, 32, 6))
    url = "data:image/png;base64," + __import__("base64").b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " and "}, {"type": "image", "image": png}]},
                {"role": "assistant", "content": "Two noisy squares."}]
    got = scorer.score_chat(messages)
    parts = [{"type": "image"} if p["type"] != "text" else p for p in messages[0]["content"]]
    text = scorer.tokenizer.hf.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                   add_generation_prompt=True)
    assert text.count(PAD) == 2
    want = scorer.logprobs([{"prompt": text, "completion_token_ids": got.token_ids, "images": [png, png]}])[0]
    assert (torch.tensor(got.token_logprobs) - want.logprobs.double()).abs().max() < 1e-6
    bad = [dict(messages[0]), {"role": "assistant", "content": [{"type": "image", "image": png}]}]
    with pytest.raises(LogprobeError) as e:
        scorer.score_chat(bad)
    assert e.value.field == "messages[1].content[0]"
    web = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
           messages[1]]
    with pytest.raises(LogprobeError) as e:
        scorer.score_chat(web)
    assert e.value.field == "messages[0].content[0].image_url"
    broken = [{"role": "user", "content": [{"type": "image", "image": png[:40]}]}, messages[1]]
    with pytest.raises(LogprobeError) as e:
        scorer.score_chat(broken)
    assert e.value.field == "messages[0].content[0]"


@pytest.mark.slow  # two gloo worker processes per model: ~3 s each alone on 2 cores, ~10 s beside other tests
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_images_under_tensor_parallelism(kind, vl_dirs):
    """The tower whole on every rank (each rank reads it whole and embeds the images of its pass):
    TP = 2 over gloo workers (the MoE with its experts split, EP = 2) gives TP = 1's numbers for
    requests with images batched among text ones: bitwise in deterministic mode (the tower's
    products in fixed row tiles: a rank runs one BLAS thread, TP = 1 two), within 1e-5 otherwise."""
    path, _ = vl_dirs[kind]
    seqs = [_sequences()[0], {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 70))},
            _sequences()[1]]
    tensor_parallel_matches_one(path, seqs)


def _moved_tower(vl_dirs, kind: str, tmp_path):
    """A trainer's model: the checkpoint's transformers model (float32) with every tower weight
    moved, and the checkpoint it saves (with the processor)."""
    model = copy.deepcopy(vl_dirs[kind][1]).float()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    out = tmp_path / f"{kind}_moved"
    model.save_pretrained(str(out))
    _save_processor(out)
    return model, out


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.slow  # slow tier (pytest -m slow): ~5 s for both
def test_update_weights_takes_the_tower(kind, vl_dirs, tmp_path):
    """``update_weights`` with a VL model's ``named_parameters()`` (``model.visual.*`` among them,
    the tower's moved): bitwise a fresh Scorer on the saved checkpoint (deterministic mode). The
    text model alone (a trainer that freezes the tower) is taken, the loaded tower kept; some of
    the tower's tensors with it: only those change."""
    path, ref = vl_dirs[kind]
    cfg = EngineConfig(deterministic=True, progress=False)
    seqs = _sequences()
    scorer = Scorer(str(path), device="cpu", dtype="float32", config=cfg)
    before = scorer.logprobs(seqs)
    trainer, moved = _moved_tower(vl_dirs, kind, tmp_path)
    scorer.update_weights(trainer.named_parameters())
    want = Scorer(str(moved), device="cpu", dtype="float32", config=cfg).logprobs(seqs)
    for got, new, old in zip(scorer.logprobs(seqs), want, before):
        assert torch.equal(got.logprobs, new.logprobs)
        assert (got.logprobs - old.logprobs).abs().max() > 1e-4  # the tower's weights move the numbers
    text = [(n, p) for n, p in trainer.named_parameters() if not n.startswith("model.visual.")]
    frozen = Scorer(str(path), device="cpu", dtype="float32", config=cfg)
    assert covers(frozen.loaded.model, text) and not covers(frozen.loaded.model, text[1:])  # a collective's buckets
    frozen.update_weights(text)  # the text model's weights are the checkpoint's: nothing changes
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(frozen.logprobs(seqs), before))
    some = [(n, p) for n, p in trainer.named_parameters() if n.startswith("model.visual.blocks.0.")]
    frozen.update_weights(text + some)
    tower, sent = dict(frozen.loaded.model.visual.named_parameters()), dict(trainer.named_parameters())
    loaded = {n: p.float() for n, p in ref.named_parameters()}  # the checkpoint's (float32 -> 64 -> 32: exact)
    for name, p in tower.items():
        source = sent if name.startswith("blocks.0.") else loaded
        assert torch.equal(p, source["model.visual." + name]), name


@pytest.mark.slow  # two gloo worker processes: ~3 s alone on 2 cores, ~10 s beside other tests
def test_update_weights_takes_the_tower_under_tensor_parallelism(vl_dirs, tmp_path):
    """At TP = 2 (each rank holds the tower whole): the moved tower sent with the text model gives a
    fresh one-rank Scorer's numbers on the saved checkpoint, bitwise (deterministic mode); the text
    model alone afterwards keeps the tower."""
    path, _ = vl_dirs["qwen3_5"]
    cfg = EngineConfig(deterministic=True, progress=False)
    seqs = _sequences()
    trainer, moved = _moved_tower(vl_dirs, "qwen3_5", tmp_path)
    want = Scorer(str(moved), device="cpu", dtype="float32", config=cfg).logprobs(seqs)
    with Scorer(str(path), device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2) as scorer:
        before = scorer.logprobs(seqs)
        scorer.update_weights(trainer.named_parameters())
        got = scorer.logprobs(seqs)
        scorer.update_weights([(n, p) for n, p in trainer.named_parameters() if not n.startswith("model.visual.")])
        again = scorer.logprobs(seqs)
    for g, a, w, b in zip(got, again, want, before):
        assert torch.equal(g.logprobs, w.logprobs) and torch.equal(a.logprobs, w.logprobs)
        assert (g.logprobs - b.logprobs).abs().max() > 1e-4


def test_shared_prefixes_keyed_by_image_content(vl_dirs, monkeypatch):
    """Requests with the same prompt and image share its rows (an RL group); the same text with
    another image shares nothing. Each gets its numbers alone, bitwise in deterministic mode."""
    from logprobe.engine import runner

    path, _ = vl_dirs["qwen3_5"]
    prompt = f"{PAD} {'describe it in words ' * 4}"  # the image first: a 64-row shared prefix holds it
    same = [{"prompt": prompt, "completion": c, "images": [_image(32, 48, 1)]} for c in (" Red.", " Blue!", " No.")]
    other = {"prompt": prompt, "completion": " Red.", "images": [_image(32, 48, 2)]}
    plans = []
    plan_work = runner.plan_work
    monkeypatch.setattr(runner, "plan_work", lambda *a, **k: plans.append(plan_work(*a, **k)) or plans[-1])
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    together = scorer.logprobs([same[0], other, same[1], same[2]])
    trees = {t.members: t.shared for batch in plans[0] for t in batch}
    assert trees.get((0, 2, 3), 0) >= 64 and (1,) in trees, trees
    for seq, res in zip([same[0], other, same[1], same[2]], together):
        assert torch.equal(scorer.logprobs([seq])[0].logprobs, res.logprobs)
    assert not torch.equal(together[0].logprobs, together[1].logprobs)  # same ids, another image


def test_prompt_token_ids_with_images(vl_dirs):
    """Prompt ids with the image token once per image, or expanded as a processor gives them: the
    numbers of the text prompt."""
    path, _ = vl_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = _sequences()[1]
    want = scorer.logprobs([seq])[0].logprobs
    once = scorer.tokenizer.encode(seq["prompt"])
    assert once.count(IMAGE_ID) == 2
    completion = scorer.tokenizer.encode(seq["completion"])
    got = scorer.logprobs([{"prompt_token_ids": once, "completion_token_ids": completion, "images": seq["images"]}])
    assert torch.equal(got[0].logprobs, want)
    j = once.index(IMAGE_ID)  # the 48 x 48 image: 9 tokens; the 32 x 32 one: 4
    expanded = once[:j] + [IMAGE_ID] * 9 + once[j + 1:]
    k = expanded.index(IMAGE_ID, j + 9)
    expanded = expanded[:k] + [IMAGE_ID] * 4 + expanded[k + 1:]
    got = scorer.logprobs([{"prompt_token_ids": expanded, "completion_token_ids": completion, "images": seq["images"]}])
    assert torch.equal(got[0].logprobs, want)


def test_prefix_cache_keyed_by_image_content(vl_dirs):
    """Across calls (``prefix_cache``): a later request with the same prompt and image resumes
    from the kept rows, one with another image (same ids) does not; numbers bitwise those of a
    scorer without the cache (deterministic mode)."""
    path, _ = vl_dirs["qwen3_5"]
    prompt = f"{PAD} {'describe it in words ' * 5}"  # the image first; a 64-row grid point before the completion
    seqs = [{"prompt": prompt, "completion": c, "images": [_image(32, 48, k)]}
            for c, k in ((" Red.", 1), (" Blue, or not.", 1), (" Blue, or not.", 2))]
    cached = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True, prefix_cache=True)
    plain = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    got = []
    for seq in seqs:
        res = cached.engine.run(cached.logprobs_job([seq]).requests)[0]
        assert torch.equal(res.logprobs, plain.logprobs([seq])[0].logprobs)
        got.append(res.cached_tokens)
    assert got[0] == 0 and got[1] >= 64 and got[2] == 0, got


def test_result_cache_keyed_by_image_content(vl_dirs, tmp_path):
    """``cache=DIR``: the same ids and image again are answered from the store (no forward pass),
    bitwise; the same ids with another image are not (their numbers differ)."""
    path, _ = vl_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False, cache=str(tmp_path))
    first = _sequences()[0]
    miss = scorer.logprobs([first])[0]
    passes = scorer.engine.inner.passes
    hit = scorer.logprobs([first])[0]
    assert scorer.engine.inner.passes == passes and torch.equal(hit.logprobs, miss.logprobs)
    other = scorer.logprobs([dict(first, images=[_image(32, 48, 9)])])[0]
    assert scorer.engine.inner.passes > passes and not torch.equal(other.logprobs, miss.logprobs)
    assert scorer.engine.cache.stats()["entries"] == 2


def test_image_token_outside_the_vocabulary(vl_dirs, tmp_path):
    """A config whose image_token_id is outside the vocabulary scores text, refuses images by name."""
    path = copy_checkpoint(vl_dirs["qwen3_5"][0], tmp_path / "ckpt",
                           edit_config=lambda cfg: cfg.update(image_token_id=248056))
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert len(scorer.logprobs([{"prompt_token_ids": [2, 3], "completion_token_ids": [4]}])[0].logprobs) == 1
    with pytest.raises(LogprobeError) as e:
        scorer.logprobs([_sequences()[0]])
    assert e.value.field == "config.image_token_id"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_images_on_cuda(kind, vl_dirs):
    """On CUDA (fla-core's kernels for the linear-attention blocks where installed): float32 within
    1e-4 of transformers' float64 forward; bf16 deterministic mode bitwise alone and batched with
    text-only requests."""
    path, ref = vl_dirs[kind]
    seqs = _sequences()
    out = Scorer(str(path), device="cuda", dtype="float32", progress=False).logprobs(seqs)
    worst = max((res.logprobs.double().cpu() - _reference(ref, path, seq)[0]).abs().max().item()
                for seq, res in zip(seqs, out))
    print(f"{kind} on CUDA, float32: max |delta| against float64 {worst:.2e}")
    assert worst < 1e-4
    text = {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))}
    scorer = Scorer(str(path), device="cuda", dtype="bfloat16", progress=False, deterministic=True)
    together = scorer.logprobs([text, seqs[0], seqs[1]])
    alone = [scorer.logprobs([s])[0] for s in (text, seqs[0], seqs[1])]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, together))

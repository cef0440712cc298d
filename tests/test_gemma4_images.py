"""Text scored given images, Gemma 4 (``models.gemma4_vision``; the bidirectional image spans of
``layers.attention`` on sliding blocks only; ``scoring.images``).

A tiny random ``Gemma4ForConditionalGeneration``: its vision tower with 2 layers, grouped kv heads,
clipped linears and standardization, 4 px patches pooled 2 x 2; its text model with per-layer
embeddings, a sliding window of 12 (shorter than an image's tokens) and
``use_bidirectional_attention: "vision"``. Saved by transformers with a byte tokenizer holding
``<|image>``, ``<image|>``, ``<|image|>`` and a ``Gemma4ImageProcessorPil`` (aspect-preserving
resizes: images of 30-64 px give 28-70 tokens). The reference is transformers' forward in float64
(``test_gemma4``'s float64 RMSNorm) on the same ids, ``pixel_values``, ``image_position_ids`` and
``mm_token_type_ids``, the prompt expanded as ``Gemma4Processor.replace_image_token``.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from helpers import (
    VOCAB,
    byte_tokenizer,
    copy_checkpoint,
    png_bytes,
    random_image,
    tensor_parallel_matches_one,
    towers_agree_in_row_tiles,
)

from logprobe import LogprobeError, Scorer
from logprobe.loading.gemma4 import build_gemma4, gemma4_config, gemma4_parallel_context, gemma4_shard_tensors

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
from test_gemma4 import TEXT, F, S, _norm64  # noqa: E402
from transformers.models.gemma4 import modeling_gemma4 as hfg4  # noqa: E402

TOL = 1e-5
BOI, EOI, IMAGE_ID = 258, 259, 260
TOKENS = ["<|image>", "<image|>", "<|image|>"]
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2, standardize=True,
              use_clipped_linears=True)
TEXT_VL = dict(TEXT, num_hidden_layers=3, layer_types=[S, F, F], hidden_size_per_layer_input=8,
               vocab_size_per_layer_input=VOCAB, use_bidirectional_attention="vision")


@pytest.fixture(scope="module")
def gemma4_vl(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg4.Gemma4RMSNorm, "forward", _norm64)
    d = tmp_path_factory.mktemp("gemma4_vl")
    cfg = transformers.Gemma4Config(text_config=TEXT_VL, vision_config=VISION, audio_config=None,
                                    tie_word_embeddings=False, boi_token_id=BOI, eoi_token_id=EOI,
                                    image_token_id=IMAGE_ID)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # clip bounds that clip, a standardization that moves
            if name.endswith(("input_min", "input_max")):
                b.fill_(0.5 if name.endswith("max") else -0.5)
            elif name.endswith(("output_min", "output_max")):
                b.fill_(2.0 if name.endswith("max") else -2.0)
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(1 + 0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(str(d))
    tok = byte_tokenizer()[0]
    tok.add_special_tokens({"additional_special_tokens": TOKENS})
    assert tok.convert_tokens_to_ids(TOKENS) == [BOI, EOI, IMAGE_ID]
    tok.save_pretrained(str(d))
    transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2).save_pretrained(str(d))
    yield d, model.double()
    mp.undo()


_image, _png = random_image, png_bytes  # helpers': seeded random RGB images, as PNG bytes


def _sequences() -> list[dict]:
    return [
        {"prompt": "Look: <|image|> what is it?", "completion": " A red square, mostly.",
         "images": [_image(40, 56, 1)]},
        {"prompt": "<|image|> and <|image|>: same?", "completion": " No, they differ a lot.",
         "images": [_png(_image(64, 30, 2)), _image(32, 32, 3)]},
    ]


def _reference(model, path, seq: dict, bidirectional: bool = True) -> tuple[torch.Tensor, list[int]]:
    """float64 log-probs of the completion tokens, transformers' own processing of the images."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ip = transformers.AutoImageProcessor.from_pretrained(str(path))
    images = [PIL.open(io.BytesIO(x)).convert("RGB") if isinstance(x, bytes) else x for x in seq["images"]]
    px = ip(images=images, return_tensors="pt")
    text = seq["prompt"]
    for n in px["num_soft_tokens_per_image"]:  # Gemma4Processor.replace_image_token
        text = text.replace("<|image|>", "<|image>" + "<|placeholder|>" * int(n) + "<image|>", 1)
    prompt = tok.encode(text.replace("<|placeholder|>", "<|image|>"), add_special_tokens=False)
    completion = tok.encode(seq["completion"], add_special_tokens=False)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=px["pixel_values"].double(),
                       image_position_ids=px["image_position_ids"],
                       mm_token_type_ids=(ids == IMAGE_ID).long() if bidirectional else None,
                       use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return lp[n - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0], completion


def _scorer(path, **kw) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, **kw)


def _worst(scorer, ref, path, seqs, bidirectional: bool = True) -> tuple[float, int]:
    worst, compared = 0.0, 0
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        want, completion = _reference(ref, path, seq, bidirectional)
        assert len(res.logprobs) == len(completion)
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
        compared += len(want)
    return worst, compared


def test_images_match_float64_transformers(gemma4_vl):
    path, ref = gemma4_vl
    scorer = _scorer(path)
    fmt = scorer.loaded.model.image_format
    assert scorer.loaded.model.tower_here and fmt.bidirectional and fmt.begin_id == BOI
    worst, compared = _worst(scorer, ref, path, _sequences())
    print(f"gemma4 images: max |delta| {worst:.2e} over {compared} tokens")
    assert compared > 30 and worst < TOL
    # the spans matter here, on the sliding block only: transformers' causal numbers are far away
    causal, _ = _worst(scorer, ref, path, _sequences()[:1], bidirectional=False)
    assert causal > 1e-3


def test_causal_checkpoint_runs_no_spans(gemma4_vl, tmp_path):
    """use_bidirectional_attention null (the smaller releases): image tokens attend causally, as
    transformers runs them."""
    path, ref = gemma4_vl
    causal = copy_checkpoint(path, tmp_path / "causal",
                             edit_config=lambda c: c["text_config"].update(use_bidirectional_attention=None))
    scorer = _scorer(causal)
    assert not scorer.loaded.model.image_format.bidirectional
    worst, _ = _worst(scorer, ref, causal, _sequences()[:1], bidirectional=False)
    assert worst < TOL


@pytest.mark.slow  # slow tier (pytest -m slow): ~5 s
def test_images_batched_with_text_chunked_and_alone(gemma4_vl):
    """Batched with text requests: each request's numbers alone (bitwise in deterministic mode);
    budgets whose chunks would end inside an image: the whole run's bits."""
    path, _ = gemma4_vl
    text = {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))}
    seqs = _sequences()
    order = [text, seqs[0], seqs[1]]
    for deterministic in (False, True):
        scorer = _scorer(path, deterministic=deterministic)
        together = scorer.logprobs(order)
        alone = [scorer.logprobs([s])[0] for s in order]
        for a, b in zip(alone, together):
            assert torch.equal(a.logprobs, b.logprobs) if deterministic else \
                (a.logprobs - b.logprobs).abs().max() < 1e-5
    for budget in (40, 24):
        small = _scorer(path, deterministic=True, max_batch_tokens=budget)
        assert torch.equal(small.logprobs([seqs[1]])[0].logprobs, alone[2].logprobs), budget
        assert small.engine.passes >= 3


def test_shared_prefixes_and_prefix_cache(gemma4_vl):
    """An RL group (one prompt and image) shares its rows and resumes them from the prefix cache;
    another image with the same ids does not; numbers bitwise those of each request alone."""
    path, _ = gemma4_vl
    x, y = _image(40, 40, 11), _image(40, 40, 12)
    prompt = "<|image|> " + "describe it in words " * 2
    group = [{"prompt": prompt, "completion": c, "images": [x]} for c in (" Red.", " Blue!")]
    other = {"prompt": prompt, "completion": " Red.", "images": [y]}
    scorer = _scorer(path, deterministic=True)
    together = scorer.logprobs([group[0], other, group[1]])
    for seq, res in zip([group[0], other, group[1]], together):
        assert torch.equal(scorer.logprobs([seq])[0].logprobs, res.logprobs)
    cached = _scorer(path, deterministic=True, prefix_cache=True)
    got = []
    for seq, want in ((group[0], together[0]), (group[1], together[2]), (other, together[1])):
        res = cached.engine.run(cached.logprobs_job([seq]).requests)[0]
        assert torch.equal(res.logprobs, want.logprobs)
        got.append(res.cached_tokens)
    assert got[0] == 0 and got[1] > 40 and got[2] < 2, got


def test_prompt_token_ids_and_bad_inputs(gemma4_vl):
    path, _ = gemma4_vl
    scorer = _scorer(path)
    seq = _sequences()[1]
    want = scorer.logprobs([seq])[0].logprobs
    once = scorer.tokenizer.encode(seq["prompt"])
    completion = scorer.tokenizer.encode(seq["completion"])
    got = scorer.logprobs([{"prompt_token_ids": once, "completion_token_ids": completion, "images": seq["images"]}])
    assert torch.equal(got[0].logprobs, want)
    good = _sequences()[0]
    png = _png(_image(32, 32, 0))
    cases = [
        (dict(good, images=[b"not an image"]), "sequences[1].images[0]"),
        (dict(good, images=[png, png]), "sequences[1].images"),
        (dict(good, completion=" then <|image|>"), "sequences[1].completion"),
        ({"prompt_token_ids": [2, 3, IMAGE_ID, IMAGE_ID], "completion_token_ids": [4], "images": [png]},
         "sequences[1].images"),
    ]
    for bad, field in cases:
        with pytest.raises(LogprobeError) as e:
            scorer.logprobs([_sequences()[1], bad])
        assert e.value.field == field, (field, str(e.value))


def test_text_only_weight_update_keeps_the_tower(gemma4_vl):
    """The text weights alone (a frozen tower): taken, the tower and embedder keep their values."""
    from safetensors.torch import load_file

    path, _ = gemma4_vl
    scorer = _scorer(path)
    before = scorer.logprobs(_sequences()[:1])[0].logprobs
    state = {k: v for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    text = {k: v for k, v in state.items() if "vision_tower" not in k and "embed_vision" not in k}
    assert len(text) < len(state)
    scorer.update_weights(text)
    assert torch.equal(scorer.logprobs(_sequences()[:1])[0].logprobs, before)


def test_vision_config_refusals(gemma4_vl):
    path, _ = gemma4_vl
    raw = json.loads((path / "config.json").read_text())
    cfg = gemma4_config(raw)
    assert (cfg.vision.num_layers, cfg.vision.pooling_kernel_size, cfg.vision_bidirectional) == (2, 2, True)
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (IMAGE_ID, BOI, EOI)
    for key, value in [("hidden_activation", "relu"), ("rope_parameters", {"rope_type": "default"}),
                       ("attention_bias", True), ("head_dim", 18), ("num_key_value_heads", 3),
                       ("vision_soft_tokens", 280)]:
        bad = json.loads(json.dumps(raw))
        bad["vision_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            gemma4_config(bad)
        assert e.value.field == f"config.vision_config.{key}", (key, e.value.field)


def test_vision_tower_whole_on_a_tensor_parallel_rank(gemma4_vl, monkeypatch):
    """Rank 1 of 2 built from its own reading of the checkpoint (``gemma4_shard_tensors``: its heads,
    MLP rows and per-layer columns) holds the whole tower and embedder: its image embeddings are
    bitwise those of the one-rank model in deterministic mode (the tower runs no collective), every
    product of it in fixed row tiles."""
    path, _ = gemma4_vl
    cfg = gemma4_config(json.loads((path / "config.json").read_text()))
    ctx = gemma4_parallel_context(cfg, 1, 2)
    rank = build_gemma4(cfg, gemma4_shard_tensors(path, cfg, ctx), torch.device("cpu"), torch.float32, ctx)
    one = _scorer(path).loaded.model
    assert rank.layers[0].self_attn.num_heads == 2 and rank.tower_here
    px = torch.rand(6 * 8, 4 * 4 * 3, generator=torch.Generator().manual_seed(1))
    tiles = towers_agree_in_row_tiles(rank, one, px, (1, 6, 8), monkeypatch)  # every product in fixed row tiles
    # both models: the patch embedding, 2 layers x (q, k, v, o, gate, up, down), the embedder
    assert tiles == [128] * 2 * (1 + 2 * 7 + 1)


@pytest.mark.slow  # two gloo worker processes: ~3 s on 2 cores
def test_images_under_tensor_parallelism(gemma4_vl):
    """The tower and embedder whole on every rank, the bidirectional runs (sliding blocks) on each
    rank's own heads (2 query heads, 1 kv head a rank): TP = 2 over gloo workers gives TP = 1's
    numbers for requests with images batched among text ones, in chunks of 64 tokens (none ending
    inside a run): bitwise in deterministic mode (the tower's products in fixed row tiles: a rank
    runs one BLAS thread, TP = 1 two), within 1e-5 otherwise; and transformers' float64 numbers
    within 1e-4."""
    path, ref = gemma4_vl
    seqs = [_sequences()[0], {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 70))},
            _sequences()[1]]
    tensor_parallel_matches_one(path, seqs, {i: _reference(ref, path, seqs[i])[0] for i in (0, 2)}, max_batch_tokens=64)

"""Text scored given images, Gemma 3 (``models.gemma3_vision``, the bidirectional image spans of
``layers.attention`` and ``engine.images``, ``scoring.images``).

A tiny random ``Gemma3ForConditionalGeneration`` (SigLIP: 2 layers, hidden 32, 64 px images in
8 px patches, 16 image tokens each; text: sliding window 16, one full block), saved by transformers
with a byte tokenizer holding ``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>`` and
a ``Gemma3ImageProcessorPil``. The reference is transformers' forward in float64 (its RMSNorm in
float64 as ``test_gemma3`` makes it) on the same ids, ``pixel_values`` and ``token_type_ids``,
the prompt expanded as ``Gemma3Processor.full_image_sequence``; ours runs in float32 through
``Scorer.logprobs``.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from helpers import (
    VOCAB,
    byte_tokenizer,
    png_bytes,
    random_image,
    tensor_parallel_matches_one,
    towers_agree_in_row_tiles,
)

from logprobe import LogprobeError, Scorer
from logprobe.engine.images import bidirectional_spans, chunk_end, planned_ids, segment_spans
from logprobe.engine.request import ImageInputs
from logprobe.layers.attention import AttentionMeta, Segment, packed_attention
from logprobe.loading.gemma import build_gemma, gemma_config, gemma_parallel_context, gemma_shard_tensors

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
from test_gemma3 import FULL, ROPE, SLIDING, _norm64  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3 as hfg3  # noqa: E402

TOL = 1e-5
WINDOW = 16
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=0, pad_token_id=0, rope_parameters=ROPE, num_hidden_layers=3,
            layer_types=[SLIDING, FULL, SLIDING])
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
              patch_size=8, vision_use_head=False)
BOI, EOI, IMAGE_ID = 260, 261, 262  # after the byte tokens (2 .. 257) and the two newline merges
TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
N = 16  # mm_tokens_per_image
CHAT = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # Gemma 3's rendering of image parts


@pytest.fixture(scope="module")
def gemma_vl(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfg3.Gemma3RMSNorm, "forward", _norm64)
    d = tmp_path_factory.mktemp("gemma3_vl")
    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=N,
                                    boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE_ID,
                                    tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(d))
    tok = _newline_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": TOKENS})
    assert tok.convert_tokens_to_ids(TOKENS) == [BOI, EOI, IMAGE_ID]
    tok.chat_template = CHAT
    tok.save_pretrained(str(d))
    transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(str(d))
    yield d, model.double()
    mp.undo()


def _newline_tokenizer():
    """``helpers.byte_tokenizer`` with "\n\n" and "\n\n\n" as tokens of their own (ids 258, 259), as
    Gemma's tokenizer has them: an image's "\n\n" joins a newline before it."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = byte_tokenizer()[1]
    nl = "\u010a"  # "\n" as a byte-level symbol
    vocab.update({nl * 2: len(vocab), nl * 3: len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(nl, nl), (nl * 2, nl)]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>")


_image, _png = random_image, png_bytes  # helpers': seeded random RGB images, as PNG bytes


def _sequences() -> list[dict]:
    return [
        {"prompt": "Look: <start_of_image> what is it?", "completion": " A red square, mostly.",
         "images": [_image(40, 56, 1)]},
        {"prompt": "<start_of_image> and <start_of_image>: same?", "completion": " No, they differ a lot.",
         "images": [_png(_image(64, 64, 2)), _image(30, 30, 3)]},
    ]


def _expanded(text: str) -> str:
    """``Gemma3Processor``: each <start_of_image> becomes its full_image_sequence."""
    return text.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * N + "<end_of_image>\n\n")


def _reference(model, path, seq: dict) -> tuple[torch.Tensor, list[int]]:
    """float64 log-probs of the completion tokens, transformers' own processing of the images."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ip = transformers.AutoImageProcessor.from_pretrained(str(path))
    images = [PIL.open(io.BytesIO(x)).convert("RGB") if isinstance(x, bytes) else x for x in seq["images"]]
    px = ip(images=images, return_tensors="pt")["pixel_values"]
    prompt = tok.encode(_expanded(seq["prompt"]), add_special_tokens=False)
    completion = tok.encode(seq["completion"], add_special_tokens=False)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=px.double(), token_type_ids=(ids == IMAGE_ID).long(),
                       use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return lp[n - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0], completion


def _scorer(path, **kw) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, **kw)


def test_bidirectional_spans_gold_table():
    """Runs of image tokens (two images with no token between them are one run, as transformers
    groups them), a segment's share of them, and where a chunk may end."""
    assert bidirectional_spans(np.array([3, 4, 5, 9, 10, 11, 12, 13, 20])) == ((3, 6), (9, 14), (20, 21))
    assert bidirectional_spans(np.array([], dtype=np.int64)) == ()
    img = ImageInputs(torch.zeros(0, 1), (), np.array([]), None, (), spans=((3, 6), (9, 14)))
    table = [  # (first, n) -> the segment's spans (key indices)
        ((0, 3), ()), ((0, 6), ((3, 6),)), ((4, 3), ((4, 6),)), ((6, 3), ()), ((0, 14), ((3, 6), (9, 14))),
        ((5, 20), ((5, 6), (9, 14))),
    ]
    for (first, n), want in table:
        assert segment_spans(img, first, n) == want, (first, n)
    with pytest.raises(LogprobeError):
        segment_spans(img, 0, 11)  # ends inside 9..13
    assert [chunk_end(img, b, e) for b, e in ((0, 4), (0, 11), (9, 11), (10, 12), (0, 6), (0, 20))] == \
        [3, 9, 14, 14, 6, 20]


def _dense_reference(q, k, v, scale, window, blocks):
    """float64 attention of one sequence with transformers' Gemma 3 mask: (causal or same image
    block) and, with a window, key > query - window."""
    T = q.shape[0]
    qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
    group = torch.full((T,), -1)
    for g, (a, e) in enumerate(blocks):
        group[a:e] = g
    mask = (kj <= qi) | ((group[:, None] == group[None, :]) & (group[:, None] >= 0))
    if window is not None:
        mask &= kj > qi - window
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    s = s.masked_fill(~mask, -torch.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize("window", [None, 6])
def test_packed_attention_spans_match_the_dense_mask(block, window):
    """A sequence with two image blocks, whole and as a chunk over the cached rows before it and as
    a branch of a shared prefix: every row as the dense Gemma 3 mask gives it (float64 reference);
    a text-only segment beside it keeps its bits."""
    torch.manual_seed(0)
    T, blocks = 40, [(5, 17), (22, 26)]
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    want = _dense_reference(q, k, v, 0.3, window, blocks)
    whole = packed_attention(q, k, v, AttentionMeta([Segment(0, T, (), tuple(blocks))], kv_block=block), 0, 0.3,
                             window)
    assert (whole.double() - want).abs().max() < 1e-5
    # a text sequence packed before it keeps its bits; ours keeps its own
    text = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    alone = packed_attention(*text, AttentionMeta([Segment(0, 7)], kv_block=block), 0, 0.3, window)
    meta = AttentionMeta([Segment(0, 7), Segment(7, 7 + T, (), tuple(blocks))], kv_block=block)
    both = packed_attention(*(torch.cat([a, b]) for a, b in zip(text, (q, k, v))), meta, 0, 0.3, window)
    assert torch.equal(both[:7], alone)
    if block is not None:
        assert torch.equal(both[7:], whole)
    # a branch over a shared prefix of 20 rows (the first block inside it): rows 20.. with 22..25 a span
    meta = AttentionMeta([Segment(0, 20, (), ((5, 17),)), Segment(20, 40, ((0, 20),), ((22, 26),))], kv_block=block)
    tree = packed_attention(q, k, v, meta, 0, 0.3, window)
    assert (tree.double() - want).abs().max() < 1e-5
    if block is not None:  # a span row's bits: its query and keys alone, wherever its segment starts
        assert torch.equal(tree[5:17], whole[5:17]) and torch.equal(tree[22:26], whole[22:26])
    # without the spans (the old mask) the image rows differ: the spans are what changed them
    causal = packed_attention(q, k, v, AttentionMeta([Segment(0, T)], kv_block=block), 0, 0.3, window)
    assert (causal[5:16] - whole[5:16]).abs().max() > 1e-3 and torch.equal(causal[17:22], whole[17:22])


def test_images_match_float64_transformers(gemma_vl):
    path, ref = gemma_vl
    scorer = _scorer(path)
    model = scorer.loaded.model
    assert model.tower_here and model.image_format.bidirectional
    seqs = _sequences()
    worst, compared = 0.0, 0
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        want, completion = _reference(ref, path, seq)
        assert len(res.logprobs) == len(completion)
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
        compared += len(want)
    print(f"gemma3 images: max |delta| {worst:.2e} over {compared} tokens")
    assert compared > 30 and worst < TOL


def test_causal_image_rows_would_be_wrong(gemma_vl, monkeypatch):
    """The same requests with the image spans dropped (every row causal): far from the reference,
    so the match above is the spans' doing."""
    from logprobe.engine import runner

    path, ref = gemma_vl
    monkeypatch.setattr(runner, "segment_spans", lambda img, first, n: ())
    seq = _sequences()[0]
    got = _scorer(path).logprobs([seq])[0].logprobs.double()
    assert (got - _reference(ref, path, seq)[0]).abs().max() > 1e-3


def test_images_batched_with_text_and_alone(gemma_vl):
    path, _ = gemma_vl
    text = [{"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 80))},
            {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(90, 99))}]
    seqs = _sequences()
    order = [text[0], seqs[0], text[1], seqs[1]]
    for deterministic in (False, True):
        scorer = _scorer(path, deterministic=deterministic)
        together = scorer.logprobs(order)
        alone = [scorer.logprobs([s])[0] for s in order]
        for a, b in zip(alone, together):
            if deterministic:
                assert torch.equal(a.logprobs, b.logprobs)
            else:
                assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    other = dict(seqs[0], images=[_image(40, 56, 9)])  # another image: other numbers for the same text
    assert (scorer.logprobs([other])[0].logprobs - alone[1].logprobs).abs().max() > 1e-4


def test_chunks_never_end_inside_an_image(gemma_vl):
    """Budgets whose chunk boundaries fall inside an image's 16 tokens (and one smaller than an
    image): the same numbers as whole, bitwise in deterministic mode."""
    path, _ = gemma_vl
    seq = {"prompt": "some words first <start_of_image> then <start_of_image>.", "completion": " and the rest " * 3,
           "images": [_image(64, 64, 4), _image(48, 64, 5)]}
    whole = _scorer(path, deterministic=True).logprobs([seq])[0].logprobs
    for budget in (24, 13):
        small = _scorer(path, deterministic=True, max_batch_tokens=budget)
        assert torch.equal(small.logprobs([seq])[0].logprobs, whole), budget
        assert small.engine.passes >= 4


def _adjacent(ids_after: list[int], images) -> dict:
    """Prompt ids with two images' tokens back to back (one run: one bidirectional block)."""
    head = [5, 6, 7, BOI] + [IMAGE_ID] * (2 * N) + [EOI]
    return {"prompt_token_ids": head + ids_after, "completion_token_ids": [40, 41, 42, 43], "images": images}


def test_shared_prefixes_keyed_by_whole_image_runs(gemma_vl, monkeypatch):
    """Requests with the same prompt and image share its rows; two requests whose first image is the
    same but whose run of image tokens differs after it (two images back to back) share nothing of
    the run (a prefix ending inside it would hold rows computed without its later tokens). Each gets
    its numbers alone, bitwise in deterministic mode; and the planner's ids say so."""
    from logprobe.engine import runner

    path, _ = gemma_vl
    x, y, z = _image(64, 64, 11), _image(64, 64, 12), _image(64, 64, 13)
    same = [{"prompt": "<start_of_image> " + "describe it in words " * 3, "completion": c, "images": [x]}
            for c in (" Red.", " Blue!")]
    adjacent = [_adjacent([30] * 12, [x, y]), _adjacent([30] * 12, [x, z])]
    plans = []
    plan_work = runner.plan_work
    monkeypatch.setattr(runner, "plan_work", lambda *a, **k: plans.append(plan_work(*a, **k)) or plans[-1])
    scorer = _scorer(path, deterministic=True)
    batch = [same[0], adjacent[0], same[1], adjacent[1]]
    together = scorer.logprobs(batch)
    trees = {t.members: t.shared for b in plans[0] for t in b}
    assert trees.get((0, 2), 0) >= 16 + N, trees  # the image shared with the words after it
    assert (1,) in trees and (3,) in trees, trees  # the back-to-back runs differ: nothing shared
    for seq, res in zip(batch, together):
        assert torch.equal(scorer.logprobs([seq])[0].logprobs, res.logprobs)
    reqs = scorer.logprobs_job(adjacent).requests
    a, b = planned_ids(reqs[0]), planned_ids(reqs[1])
    assert a[:4] == b[:4] and a[4] != b[4]  # they part at the run's first token, not at the second image


def test_prefix_cache_keyed_by_image_runs(gemma_vl):
    """Across calls (``prefix_cache``): the same prompt and image resumes from the kept rows; the
    same first image in a different run of image tokens resumes none of the run; numbers bitwise
    those of a scorer without the cache."""
    path, _ = gemma_vl
    x, y, z = _image(64, 64, 11), _image(64, 64, 12), _image(64, 64, 13)
    prompt = "<start_of_image> " + "describe it in words " * 3
    seqs = [{"prompt": prompt, "completion": " Red.", "images": [x]},
            {"prompt": prompt, "completion": " Blue, or not.", "images": [x]},
            _adjacent([30] * 5, [x, y]), _adjacent([31] * 5, [x, z])]
    cached = _scorer(path, deterministic=True, prefix_cache=True)
    plain = _scorer(path, deterministic=True)
    got = []
    for seq in seqs:
        res = cached.engine.run(cached.logprobs_job([seq]).requests)[0]
        assert torch.equal(res.logprobs, plain.logprobs([seq])[0].logprobs)
        got.append(res.cached_tokens)
    assert got[0] == 0 and got[1] > N + 4 and got[3] <= 4, got


@pytest.mark.slow  # slow tier (pytest -m slow): ~3 s
def test_prompt_token_ids_and_chat(gemma_vl):
    """Prompt ids with <start_of_image> once per image, or expanded as the processor gives them, and
    a chat with image parts: the numbers of the text prompt."""
    path, _ = gemma_vl
    scorer = _scorer(path)
    seq = _sequences()[1]
    want = scorer.logprobs([seq])[0].logprobs
    once = scorer.tokenizer.encode(seq["prompt"])
    completion = scorer.tokenizer.encode(seq["completion"])
    assert once.count(BOI) == 2 and IMAGE_ID not in once
    got = scorer.logprobs([{"prompt_token_ids": once, "completion_token_ids": completion, "images": seq["images"]}])
    assert torch.equal(got[0].logprobs, want)
    expanded = scorer.tokenizer.encode(_expanded(seq["prompt"]))
    got = scorer.logprobs([{"prompt_token_ids": expanded, "completion_token_ids": completion,
                            "images": seq["images"]}])
    assert torch.equal(got[0].logprobs, want)
    # a chat whose image follows "user\n": the processor's text joins that newline with the image's
    # "\n\n" (one token, 259), as the prompt text does; ids expanded one by one would not
    png = _png(_image(48, 32, 6))
    messages = [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A noisy square."}]
    chat = scorer.score_chat(messages)
    text = scorer.tokenizer.hf.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}], tokenize=False, add_generation_prompt=True)
    assert "user\n<start_of_image>" in text and 259 in scorer.tokenizer.encode(_expanded(text))
    want = scorer.logprobs([{"prompt": text, "completion_token_ids": chat.token_ids, "images": [png]}])[0]
    assert (torch.tensor(chat.token_logprobs) - want.logprobs.double()).abs().max() < 1e-6


def test_bad_image_inputs(gemma_vl, tmp_path):
    path, _ = gemma_vl
    scorer = _scorer(path)
    good = _sequences()[0]
    png = _png(_image(32, 32, 0))
    cases = [
        (dict(good, images=[b"not an image at all"]), "sequences[1].images[0]"),
        (dict(good, images=[png[:len(png) // 2]]), "sequences[1].images[0]"),
        (dict(good, images=[png, png]), "sequences[1].images"),  # 2 images, 1 placeholder
        (dict(good, completion=" then <start_of_image>"), "sequences[1].completion"),
        (dict(good, completion=" then <image_soft_token>"), "sequences[1].completion"),
        ({"prompt_token_ids": [2, 3, IMAGE_ID], "completion_token_ids": [4], "images": [png]}, "sequences[1].images"),
        ({"prompt": "no placeholder", "completion": "x", "images": [png]}, "sequences[1].images"),
    ]
    for seq, field in cases:
        with pytest.raises(LogprobeError) as e:
            scorer.logprobs([_sequences()[1], seq])
        assert e.value.field == field, (field, str(e.value))


def test_processor_and_token_refusals(gemma_vl, tmp_path):
    """Pan-and-scan crops (more images than the prompt placed) and an <end_of_image> id outside the
    vocabulary refuse images by name; text is still scored."""
    from helpers import copy_checkpoint

    path, _ = gemma_vl
    pan = copy_checkpoint(path, tmp_path / "pan")
    pre = json.loads((pan / "preprocessor_config.json").read_text())
    pre.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=4,
               pan_and_scan_min_ratio_to_activate=1.2)
    (pan / "preprocessor_config.json").write_text(json.dumps(pre))
    wide = dict(_sequences()[0], images=[_image(32, 96, 1)])
    with pytest.raises(LogprobeError) as e:
        _scorer(pan).logprobs([wide])
    assert e.value.field == "sequences[0].images" and "pan-and-scan" in str(e.value)
    bad = copy_checkpoint(path, tmp_path / "eoi", edit_config=lambda cfg: cfg.update(eoi_token_index=VOCAB + 5))
    scorer = _scorer(bad)
    assert len(scorer.logprobs([{"prompt_token_ids": [2, 3], "completion_token_ids": [4]}])[0].logprobs) == 1
    with pytest.raises(LogprobeError) as e:
        scorer.logprobs([_sequences()[0]])
    assert e.value.field == "config.eoi_token_index"


def test_text_only_weight_update_keeps_the_tower(gemma_vl):
    """A trainer that freezes the tower sends the text weights alone: taken, the tower and projector
    keep their values (``Family.towers``), so image scores after equal those before (the same weights)."""
    from safetensors.torch import load_file

    path, _ = gemma_vl
    scorer = _scorer(path)
    before = scorer.logprobs(_sequences()[:1])[0].logprobs
    state = {k: v for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    text = {k: v for k, v in state.items() if "vision_tower" not in k and "multi_modal_projector" not in k}
    assert len(text) < len(state)
    scorer.update_weights(text)
    assert torch.equal(scorer.logprobs(_sequences()[:1])[0].logprobs, before)


def test_vision_config_refusals_and_keys(gemma_vl):
    path, _ = gemma_vl
    raw = json.loads((path / "config.json").read_text())
    cfg = gemma_config(raw)
    assert (cfg.vision.num_layers, cfg.vision.side, cfg.vision.pool) == (2, 8, 2)
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (IMAGE_ID, BOI, EOI)
    for key, value, field in [
        ("hidden_act", "relu", "config.vision_config.hidden_act"),
        ("num_image_tokens", 64, "config.vision_config.num_image_tokens"),
        ("model_type", "clip_vision_model", "config.vision_config.model_type"),
        ("patch_size", 0, "config.vision_config.patch_size"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["vision_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            gemma_config(bad)
        assert e.value.field == field, (key, e.value.field)
    for tokens in (15, 9):  # not a square; a square whose side does not divide the 8 x 8 patches
        bad = dict(raw, mm_tokens_per_image=tokens)
        with pytest.raises(LogprobeError) as e:
            gemma_config(bad)
        assert e.value.field == "config.mm_tokens_per_image"
    assert gemma_config({k: v for k, v in raw.items() if k != "vision_config"}).vision is None


def test_spans_refused_with_attention_sinks():
    """Bidirectional spans beside attention sinks (no family has both) are refused by name."""
    q = torch.zeros(3, 1, 2)
    meta = AttentionMeta([Segment(0, 3, (), ((0, 3),))])
    with pytest.raises(LogprobeError) as e:
        packed_attention(q, q, q, meta, 0, 1.0, sinks=torch.zeros(1))
    assert e.value.field == "sinks"


def test_vision_tower_whole_on_a_tensor_parallel_rank(gemma_vl, monkeypatch):
    """Rank 1 of 2 built from its own reading of the checkpoint (``gemma_shard_tensors``: its heads
    and MLP rows) holds the whole tower and projector: its image embeddings are bitwise those of the
    one-rank model in deterministic mode (the tower runs no collective), every product of it in fixed
    row tiles."""
    path, _ = gemma_vl
    cfg = gemma_config(json.loads((path / "config.json").read_text()))
    ctx = gemma_parallel_context(cfg, 1, 2)
    rank = build_gemma(cfg, gemma_shard_tensors(path, cfg, ctx), torch.device("cpu"), torch.float32, ctx)
    one = _scorer(path).loaded.model
    assert rank.layers[0].self_attn.num_heads == 2 and rank.tower_here
    px = torch.rand(64, 3 * 8 * 8, generator=torch.Generator().manual_seed(1))
    tiles = towers_agree_in_row_tiles(rank, one, px, (1, 8, 8), monkeypatch)  # every product in fixed row tiles
    # both models: the patch embedding, 2 layers x (q, k, v, out, fc1, fc2), the projection
    assert tiles == [128] * 2 * (1 + 2 * 6 + 1)


@pytest.mark.slow  # two gloo worker processes: ~3 s on 2 cores
def test_images_under_tensor_parallelism(gemma_vl):
    """The tower and projector whole on every rank, the bidirectional runs on each rank's own heads
    (2 query heads, 1 kv head a rank): TP = 2 over gloo workers gives TP = 1's numbers for requests
    with images batched among text ones, in chunks of 64 tokens (none ending inside a run): bitwise
    in deterministic mode (the tower's products in fixed row tiles: a rank runs one BLAS thread,
    TP = 1 two), within 1e-5 otherwise; and transformers' float64 numbers within 1e-4."""
    path, ref = gemma_vl
    seqs = [_sequences()[0], {"prompt_token_ids": list(range(2, 40)), "completion_token_ids": list(range(50, 70))},
            _sequences()[1]]
    tensor_parallel_matches_one(path, seqs, {i: _reference(ref, path, seqs[i])[0] for i in (0, 2)}, max_batch_tokens=64)

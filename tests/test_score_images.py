"""``Scorer.score(prompt, continuations, images=...)`` (a multiple-choice question about an image)
on ``test_qwen3_5_images``'s tiny Qwen3.5 with its vision tower: each continuation's numbers are
``logprobs``' of the same prompt, continuation and images, bitwise (deterministic mode); the
continuations share the image's rows as a prefix (the planner keys image tokens by content); bad
images are refused by item."""

from __future__ import annotations

import pytest

from logprobe import LogprobeError, Scorer
from logprobe.scoring.continuations import split

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
from test_qwen3_5_images import PAD, _image, _png, save_vl_checkpoint  # noqa: E402

A, B = _png(_image(32, 48, 1)), _png(_image(32, 48, 2))
PROMPT = f"{PAD} {'Which shape is it? ' * 4}Answer:"  # the image first: a 64-row shared prefix holds it
ANSWERS = [" a square", " a circle", " a noisy square"]


@pytest.fixture(scope="module")
def vl_scorer(tmp_path_factory):
    d = tmp_path_factory.mktemp("score-qwen3_5")
    save_vl_checkpoint(d)
    return Scorer(str(d), device="cpu", dtype="float32", progress=False, deterministic=True)


@pytest.mark.slow  # three continuations, each with the image, twice: ~2 s on 2 cores
def test_score_with_images_is_logprobs_of_the_same_text(vl_scorer, monkeypatch):
    from logprobe.engine import runner

    plans = []
    plan_work = runner.plan_work
    monkeypatch.setattr(runner, "plan_work", lambda *a, **k: plans.append(plan_work(*a, **k)) or plans[-1])
    got = vl_scorer.score(PROMPT, ANSWERS, images=[A])
    trees = {t.members: t.shared for batch in plans[0] for t in batch}
    assert trees.get((0, 1, 2), 0) >= 64, trees  # one image's rows for the three answers
    ids = [split(vl_scorer.tokenizer, PROMPT, a)[1] for a in ANSWERS]
    want = vl_scorer.logprobs([{"prompt": PROMPT, "completion_token_ids": i, "images": [A]} for i in ids])
    assert [g.token_logprobs for g in got] == [w.logprobs.tolist() for w in want]  # bitwise
    assert [g.token_ids for g in got] == ids
    other = vl_scorer.score(PROMPT, ANSWERS, images=[B])
    assert all(abs(o.log_prob - g.log_prob) > 1e-4 for o, g in zip(other, got))  # the image was seen


@pytest.mark.parametrize("prompt, conts, images, field", [
    (PROMPT, ANSWERS, [b"not an image"], "images[0]"),
    (PROMPT, ANSWERS, [A, A[:100]], "images"),  # two images, one placeholder (counted before reading)
    (f"{PAD}{PAD} Same?", [" yes"], [A, A[:100]], "images[1]"),  # truncated
    (PROMPT, ANSWERS, [], "images"),
    ("No image here:", [" yes"], [A], "images"),
    (PROMPT, [" yes", f" {PAD}"], [A], "continuations[1]"),  # only text is scored
])
def test_bad_images_named_by_item(vl_scorer, prompt, conts, images, field):
    with pytest.raises(LogprobeError) as e:
        vl_scorer.score(prompt, conts, images=images)
    assert e.value.field == field, str(e.value)


def test_score_images_on_a_text_only_model(tmp_path):
    from helpers import make_hf_dir

    make_hf_dir(tmp_path, "llama")
    scorer = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError) as e:
        scorer.score("a", ["b"], images=[A])
    assert e.value.field == "images" and "no vision tower" in str(e.value)

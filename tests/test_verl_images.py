"""verl's reference policy with images (``integrations.verl``: ``multi_modal_inputs`` /
``multi_modal_data`` in ``non_tensor_batch``) on ``test_qwen3_5_images``'s tiny Qwen3.5 with its
vision tower: the padded DataProto and verl 0.9's no-padding trainer step give ``Scorer.logprobs``'s
numbers with the same images, bitwise (deterministic mode); a row's video is refused by name."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from logprobe import LogprobeError

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
pytest.importorskip("verl")
from test_qwen3_5_images import PAD, _image, save_vl_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from logprobe.integrations.verl import LogprobeRefPolicy

    d = tmp_path_factory.mktemp("verl-qwen3_5")
    save_vl_checkpoint(d)
    worker = LogprobeRefPolicy(str(d), device="cpu", dtype="float32", progress=False, deterministic=True)
    worker.init_model()
    return worker


def _batch(policy, media_key: str):
    """Three rows as verl lays them out (prompts left-padded, responses right-padded, the image
    tokens expanded as its processor leaves them): one image, none, two images."""
    from verl import DataProto

    scorer = policy.scorer
    images = [[_image(32, 48, 1)], [], [_image(48, 48, 2), _image(32, 32, 3)]]
    texts = [f"Look: {PAD} what?", "Just text here.", f"{PAD} and {PAD}: same?"]
    responses = [scorer.tokenizer.encode(t) for t in (" A red square.", " Yes.", " No, they differ.")]
    processor = transformers.AutoImageProcessor.from_pretrained(scorer.info.path)
    prompts, media = [], []
    for text, imgs in zip(texts, images):
        ids = scorer.tokenizer.encode(text)
        if imgs:
            ids = scorer.context.images.prompt_ids(ids, imgs, "x")[0]  # expanded
            out = processor(images=imgs, return_tensors="pt")
            media.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
                         if media_key == "multi_modal_inputs" else {"image": imgs})
        else:
            media.append({})
        prompts.append(ids)
    P, R = max(map(len, prompts)), max(map(len, responses))
    p_t, r_t = torch.zeros(3, P, dtype=torch.long), torch.zeros(3, R, dtype=torch.long)
    attention = torch.zeros(3, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        p_t[b, P - len(p):], r_t[b, :len(r)] = torch.tensor(p), torch.tensor(r)
        attention[b, P - len(p):P + len(r)] = 1
    data = DataProto.from_dict(
        tensors={"prompts": p_t, "responses": r_t, "input_ids": torch.cat([p_t, r_t], 1), "attention_mask": attention,
                 "response_mask": attention[:, P:].clone(), "position_ids": (attention.cumsum(1) - 1).clamp(min=0)},
        non_tensors={media_key: np.array(media, dtype=object)}, meta_info={"temperature": 0.9})
    want = scorer.logprobs([{"prompt_token_ids": p, "completion_token_ids": r, **({"images": i} if i else {})}
                            for p, r, i in zip(prompts, responses, images)], temperature=0.9)
    return data, [w.logprobs for w in want]


@pytest.mark.slow  # verl's imports and a vision checkpoint: ~10 s on 2 cores
@pytest.mark.parametrize("media_key", ["multi_modal_inputs", "multi_modal_data"])
def test_verl_ref_log_prob_with_images(policy, media_key):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    data, want = _batch(policy, media_key)
    padded = policy.compute_ref_log_prob(data).batch["ref_log_prob"]
    trainer = types.SimpleNamespace(ref_in_actor=False, ref_policy_wg=policy)
    nopad = RayPPOTrainer._compute_ref_log_prob(trainer, data).batch["ref_log_prob"]
    for b, w in enumerate(want):
        assert torch.equal(padded[b, :len(w)], w) and (padded[b, len(w):] == 0).all()  # bitwise
    assert torch.equal(padded, nopad)
    # a row's video is refused by name, never scored without it
    data.non_tensor_batch[media_key][0] = {**data.non_tensor_batch[media_key][0], "video": [_image(32, 32, 4)]}
    with pytest.raises(LogprobeError) as e:
        policy.compute_ref_log_prob(data)
    assert e.value.field == "data.non_tensor_batch[0]['video']"

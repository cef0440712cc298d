"""Weight updates (``loading.update``) for Gemma 4 (text and multimodal names, KV-shared blocks,
keys as values), GLM-4 dense (fused ``gate_up_proj``) and gpt-oss (float experts in transformers'
layout; MXFP4-packed experts refused, a model loaded with ``weights="dense"`` takes them).

Each kind saves a tiny random checkpoint A and, from the same transformers model re-randomised, a
checkpoint B (the models of ``test_gemma4``, ``test_glm4`` and ``test_gpt_oss``). In deterministic
mode a scorer loaded from A and given B's tensors (checkpoint names, transformers' in-memory
``state_dict`` streamed, ``load_weights`` of B's directory, and B sent in buckets as a trainer
does through the collective protocol) gives bitwise the log-probs of a fresh scorer loaded from B.
An incomplete update, unknown names, wrong shapes (an expert tensor in the native layout instead of
transformers' included), integer tensors and NaN are refused naming the tensor, A's weights left
in force. TP = 2 (gloo worker processes, the slow tier): updated with B, bitwise a fresh TP = 1 load.
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, random_sequences
from safetensors.torch import load_file

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading import load_model
from logprobe.loading.collective import Declared, WeightGroup, check_declared, covers
from logprobe.loading.update import weight_slots

transformers = pytest.importorskip("transformers")
import test_gemma4  # noqa: E402
import test_gpt_oss  # noqa: E402
from test_update_families import _randomise  # noqa: E402

DET = EngineConfig(deterministic=True, progress=False)


def _glm4():
    cfg = transformers.Glm4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=0, pad_token_id=0)
    return transformers.Glm4ForCausalLM._from_config(cfg, attn_implementation="eager")


KINDS = {
    "glm4": _glm4,
    "gemma4_text": lambda: test_gemma4._model("gemma4_text"),
    "gemma4": lambda: test_gemma4._model("gemma4"),
    "gpt_oss": test_gpt_oss._model,
}
# a weight of each kind that its loader reshapes or cuts: wrong shapes of it must be refused by name
RESHAPED = {"glm4": "model.layers.0.mlp.gate_up_proj.weight", "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",
            "gemma4_text": "model.layers.1.self_attn.o_proj.weight",  # keys as values: columns permuted
            "gemma4": "model.language_model.layers.0.self_attn.q_proj.weight"}


def _save(model, d) -> None:
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))


def _pair(kind: str, root):
    """(checkpoint A, checkpoint B, B's in-memory state_dict) of ``kind``."""
    torch.manual_seed(0)
    model = KINDS[kind]().float().eval()
    dirs = []
    for seed in (1, 2):
        _randomise(model, seed)
        _save(model, root / f"w{seed}")
        dirs.append(root / f"w{seed}")
    return dirs[0], dirs[1], {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request, tmp_path_factory):
    return request.param, *_pair(request.param, tmp_path_factory.mktemp(request.param))


def _sequences() -> list[dict]:
    return random_sequences(4, seed=11, max_prompt=25, max_completion=30)


def _checkpoint(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _o_proj(ckpt: dict) -> str:
    return next(k for k in ckpt if k.endswith("layers.0.self_attn.o_proj.weight") and "vision" not in k)


def _same(a: Scorer, b: Scorer, seqs) -> bool:
    return all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a.logprobs(seqs), b.logprobs(seqs)))


def _scorer(spec) -> Scorer:
    return Scorer(spec, device="cpu", dtype="float32", config=DET)


def _declared(named) -> list:
    """(name, tensor) pairs -> the metadata a trainer sends before broadcasting them."""
    return [(n, t.dtype, tuple(t.shape)) for n, t in named]


def test_update_equals_fresh_load(pair):
    kind, a, b, memory = pair
    seqs = _sequences()
    fresh = _scorer(str(b))
    scorer = _scorer(str(a))
    assert not _same(scorer, fresh, seqs)  # the new weights change the numbers
    new = _checkpoint(b)
    assert covers(scorer.loaded.model, list(new.items()))
    for named in (new, memory):  # what a trainer declares before broadcasting: taken, every weight named
        declared = check_declared(scorer.loaded.model, _declared(named.items()), Declared())
        assert declared.units == set(weight_slots(scorer.loaded.model)), kind
    assert scorer.update_weights(new) == 1
    assert _same(scorer, fresh, seqs), f"{kind}: update_weights (checkpoint names) != fresh load"

    again = _scorer(str(a))
    again.update_weights(iter(list(memory.items())))  # transformers' in-memory names, streamed
    assert _same(again, fresh, seqs), f"{kind}: update_weights (in-memory names) != fresh load"

    third = _scorer(str(a))
    third.load_weights(str(b))
    assert _same(third, fresh, seqs), f"{kind}: load_weights != fresh load"


def test_buckets_apply_once_complete(pair):
    """A trainer's buckets (``WeightGroup.collect``, as ``/update_weights_from_distributed`` holds
    them): nothing applies until B's tensors cover the model; then all at once, as a fresh load."""
    kind, a, b, _ = pair
    seqs = _sequences()[:2]
    scorer = _scorer(str(a))
    before = [r.logprobs for r in scorer.logprobs(seqs)]
    ckpt = _checkpoint(b)
    key = _o_proj(ckpt)
    new = [(k, v) for k, v in ckpt.items() if k != key] + [(key, ckpt[key])]  # every bucket but the last lacks it
    buckets = [new[i:i + 3] for i in range(0, len(new), 3)]
    group = WeightGroup("g", process=None, rank=1, world_size=2, backend="gloo", device=torch.device("cpu"))
    model = scorer.loaded.model
    for bucket in buckets[:-1]:  # each checked as its metadata is, against the buckets held
        assert group.collect(bucket, check_declared(model, _declared(bucket), group.declared), None,
                             model) == (None, None), kind
    assert all(torch.equal(x, y.logprobs) for x, y in zip(before, scorer.logprobs(seqs)))  # nothing applied
    held, version = group.collect(buckets[-1], check_declared(model, _declared(buckets[-1]), group.declared), "B",
                                  model)
    assert version == "B" and len(held) == len(new)
    scorer.update_weights(held, weight_version=version)
    assert scorer.weight_version == "B" and _same(scorer, _scorer(str(b)), seqs), kind


def test_refusals_name_the_tensor_and_leave_old_weights(pair):
    kind, a, b, _ = pair
    seqs = _sequences()[:2]
    scorer = _scorer(str(a))
    before = [r.logprobs for r in scorer.logprobs(seqs)]
    new = _checkpoint(b)
    key, odd = _o_proj(new), RESHAPED[kind]
    swapped = new[odd].transpose(-1, -2).contiguous()  # gpt-oss: the native [E, 2I, H] instead of [E, H, 2I]
    bad = [
        ({**new, "model.layers.0.self_attn.surprise.weight": torch.zeros(4, 4)}, "surprise.*not a weight"),
        ({k: v for k, v in new.items() if k != key}, f"missing: {key};"),  # named as sent
        ({k: v for k, v in new.items() if k != odd}, "missing"),
        ({**new, key: torch.zeros(new[key].shape[0] + 1, new[key].shape[1])}, f"{key}.*has shape"),
        ({**new, odd: swapped if swapped.shape != new[odd].shape else new[odd][1:]}, f"{odd}.*has shape"),
        ({**new, odd: torch.zeros(new[odd].shape, dtype=torch.int32)}, f"{odd}.*int32"),
        ({**new, key: torch.full(new[key].shape, float("nan"))}, f"{key}.*non-finite"),
    ]
    assert not covers(scorer.loaded.model, [(k, v) for k, v in new.items() if k != odd])  # a bucket waits
    for tensors, words in bad:
        with pytest.raises(LogprobeError, match=words):
            scorer.update_weights(tensors)
    after = [r.logprobs for r in scorer.logprobs(seqs)]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), kind
    assert scorer.weights_version == 0


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 checkpoint A, float checkpoint B) of one gpt-oss model."""
    root = tmp_path_factory.mktemp("gpt_oss_mx")
    a_float, b, _ = _pair("gpt_oss", root)
    test_gpt_oss._mxfp4_dir(a_float, root / "a_mx", torch.Generator().manual_seed(5))
    return root / "a_mx", b


def test_mxfp4_packed_refused_dense_takes_float_weights(mxfp4):
    """A trainer sends bf16 (float) experts. Into MXFP4-packed experts they would have to be
    requantized (other weights than the trainer's): refused, naming the tensor and the fix. The
    same checkpoint loaded with ``weights="dense"`` takes them: then bitwise a fresh float load."""
    a_mx, b = mxfp4
    seqs = _sequences()
    new = _checkpoint(b)
    packed = _scorer(str(a_mx))
    before = [r.logprobs for r in packed.logprobs(seqs)]
    with pytest.raises(LogprobeError, match=r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj is held MXFP4") as e:
        packed.update_weights(new)
    assert "weights='dense'" in e.value.fix
    assert covers(packed.loaded.model, list(new.items()))  # a bucket is applied at once, to be refused
    assert all(torch.equal(x, y.logprobs) for x, y in zip(before, packed.logprobs(seqs)))

    dense = Scorer(load_model(str(a_mx), "cpu", "float32", weights="dense"), config=DET)
    assert all(torch.equal(x, y.logprobs) for x, y in zip(before, dense.logprobs(seqs)))  # MXFP4 exact in float
    blocks = {k: v for k, v in _checkpoint(a_mx).items() if k.endswith(("_blocks", "_scales"))}
    with pytest.raises(LogprobeError, match=r"_(blocks|scales)' is an MXFP4 part"):
        dense.update_weights({**{k: v for k, v in new.items() if ".experts." not in k}, **blocks})
    dense.update_weights(new)
    assert _same(dense, _scorer(str(b)), seqs)


def test_mxfp4_dense_bfloat16_takes_bfloat16_weights(mxfp4):
    """The RL case: a bf16 scorer of the MXFP4 checkpoint (loaded dense) given the trainer's bf16
    tensors scores as a fresh bf16 load of them, bitwise."""
    a_mx, b = mxfp4
    seqs = _sequences()[:2]
    dense = Scorer(load_model(str(a_mx), "cpu", "bfloat16", weights="dense"), config=DET)
    assert dense.loaded.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    fresh = Scorer(str(b), device="cpu", dtype="bfloat16", config=DET)
    assert not _same(dense, fresh, seqs)
    dense.update_weights(iter([(k, v.to(torch.bfloat16)) for k, v in _checkpoint(b).items()]))
    assert _same(dense, fresh, seqs)


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per case
@pytest.mark.parametrize("kind,ep", [("glm4", None), ("gemma4_text", None), ("gpt_oss", None), ("gpt_oss", 1)])
def test_tensor_parallel_update_equals_fresh_load(kind, ep, tmp_path):
    """TP = 2 updated with whole tensors: GLM-4's gate_up cut then split by rows, Gemma 4's heads
    per block (one kv head replicated on full blocks, keys as values), gpt-oss's heads with their
    sinks and its experts two a rank (the default) or all on both (``expert_parallel_size`` 1):
    bitwise a fresh TP = 1 load of the new weights (deterministic mode)."""
    a, b, _ = _pair(kind, tmp_path)
    seqs = _sequences()
    want = _scorer(str(b)).logprobs(seqs)
    with Scorer(str(a), device="cpu", dtype="float32", config=DET, tensor_parallel_size=2,
                expert_parallel_size=ep) as s:
        assert not all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(s.logprobs(seqs), want))
        s.update_weights(_checkpoint(b))
        got = s.logprobs(seqs)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(got, want)), kind


@pytest.mark.slow
def test_tensor_parallel_mxfp4_refused_before_sending(mxfp4):
    """At TP = 2 the workers hold the MXFP4 experts packed; the driver's weightless model says so,
    so the update is refused before one tensor is sent, naming it."""
    a_mx, b = mxfp4
    with Scorer(str(a_mx), device="cpu", dtype="float32", config=DET, tensor_parallel_size=2) as s:
        with pytest.raises(LogprobeError, match=r"experts\.(gate_up|down)_proj is held MXFP4"):
            s.update_weights(_checkpoint(b))

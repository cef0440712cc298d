"""Scorer.update_weights / load_weights (loading.update): new weights in place, all or nothing.

The reference is a fresh Scorer loaded from a checkpoint of the new weights: after an update every
number must equal it bitwise; after a refused update every number must equal the old ones.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_hf_dir, random_sequences, write_tiny_gguf
from safetensors.torch import load_file, save_file

from logprobe import Scorer
from logprobe.errors import LogprobeError

SEQS = random_sequences(3, seed=21, max_prompt=12, max_completion=12)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """kind -> (weights A dir, weights B dir): the same architecture, different random weights."""
    out = {}
    for kind in ("llama", "qwen3", "qwen2"):  # qwen3: q/k norms; qwen2: q/k/v bias, tied embeddings
        a, b = tmp_path_factory.mktemp(f"{kind}-a"), tmp_path_factory.mktemp(f"{kind}-b")
        make_hf_dir(a, kind, seed=1)
        make_hf_dir(b, kind, seed=2)
        out[kind] = (a, b)
    return out


def scorer(path, deterministic=False) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=deterministic)


def scores(s: Scorer) -> list[torch.Tensor]:
    out = s.logprobs(SEQS, entropy=True)
    return [r.logprobs for r in out] + [r.entropy for r in out]


def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


def hf_weights(d) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("kind, deterministic", [("llama", True), ("qwen3", False), ("qwen2", False)])
def test_update_equals_fresh_scorer(kind, deterministic, dirs):
    a, b = dirs[kind]
    s = scorer(a, deterministic)
    old = scores(s)
    fresh_b = scores(scorer(b, deterministic))
    assert not same(old, fresh_b)
    new = hf_weights(b)
    if kind == "qwen2":  # tied: state_dict() lists lm_head.weight beside the embedding; it is ignored
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    assert s.update_weights(iter(list(new.items()))) == 1  # a stream
    assert same(scores(s), fresh_b) and s.weights_version == 1
    assert s.update_weights(hf_weights(a)) == 2  # a dict: back to A, in place
    assert same(scores(s), old)
    assert s.load_weights(str(b)) == 3  # a checkpoint directory
    assert same(scores(s), fresh_b)
    assert s.load_weights(str(a / "model.safetensors")) == 4  # one file
    assert same(scores(s), old)


def test_bfloat16_update_equals_fresh_bfloat16_checkpoint(dirs, tmp_path):
    a, b = dirs["llama"]
    bf = {k: v.to(torch.bfloat16) for k, v in hf_weights(b).items()}
    d = tmp_path / "b-bf16"
    shutil.copytree(b, d)
    save_file(bf, str(d / "model.safetensors"))
    s = scorer(a, True)
    s.update_weights(list(bf.items()))  # a list
    assert same(scores(s), scores(scorer(d, True)))


def _bad_updates(good: dict[str, torch.Tensor]):
    name = "model.layers.1.mlp.down_proj.weight"
    extra = dict(good) | {"model.layers.9.mlp.down_proj.weight": good[name]}
    shape = dict(good) | {name: good[name][:, :-1]}
    ints = dict(good) | {name: good[name].to(torch.int8)}
    missing = {k: v for k, v in good.items() if k != name}
    nan, inf = good[name].clone(), good[name].clone()
    nan[0, 0], inf[1, 2], inf[2, 1] = float("nan"), float("inf"), -float("inf")
    return [(extra, "model.layers.9.mlp.down_proj.weight"), (shape, "shape"), (ints, "int8"),
            (missing, name), (list(good.items()) + [(name, good[name])], "twice"),
            (dict(good) | {name: nan}, f"'{name}' holds 1 non-finite value"),
            (dict(good) | {name: inf}, f"'{name}' holds 2 non-finite values")]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_update_changes_nothing(stream, dirs):
    a, b = dirs["qwen3"]
    s = scorer(a)
    old = scores(s)
    for bad, words in _bad_updates(hf_weights(b)):
        items = list(bad.items()) if isinstance(bad, dict) else bad
        # the bad tensor last: every good one before it has been checked (and staged, for a stream)
        items.sort(key=lambda kv: kv[0] == "model.layers.1.mlp.down_proj.weight" or kv[0].startswith("model.layers.9"))
        with pytest.raises(LogprobeError) as e:
            s.update_weights(iter(items) if stream else items)
        assert e.value.field == "named_tensors" and words in str(e.value), str(e.value)
        assert same(scores(s), old) and s.weights_version == 0


def test_bad_checkpoint_changes_nothing(dirs, tmp_path):
    a, b = dirs["llama"]
    s = scorer(a)
    old = scores(s)
    w = hf_weights(b)
    w["model.norm.weight"] = w["model.norm.weight"][:-1]
    save_file(w, str(tmp_path / "bad.safetensors"))
    with pytest.raises(LogprobeError, match="model.norm.weight"):
        s.load_weights(str(tmp_path / "bad.safetensors"))
    w = hf_weights(b)  # a NaN in the last tensor read: the ones before it are not copied either
    last = sorted(w)[-1]
    w[last] = w[last].clone()
    w[last].view(-1)[3] = float("nan")
    save_file(w, str(tmp_path / "nan.safetensors"))
    with pytest.raises(LogprobeError, match=f"'{last}' holds 1 non-finite value"):
        s.load_weights(str(tmp_path / "nan.safetensors"))
    quant = tmp_path / "quantized"  # a compressed-tensors checkpoint: packed int4 blocks, not floats
    shutil.copytree(b, quant)
    cfg = json.loads((quant / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "compressed-tensors"}}))
    with pytest.raises(LogprobeError, match="quantized checkpoint"):
        s.load_weights(str(quant))
    for path in (tmp_path / "nothing-here", dirs["llama"][0] / "config.json"):
        with pytest.raises(LogprobeError) as e:
            s.load_weights(str(path))
        assert e.value.field == "path"
    data = (b / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) // 2])  # a truncated file: safetensors' own error
    with pytest.raises(LogprobeError, match="not a readable safetensors file") as e:
        s.load_weights(str(tmp_path / "cut.safetensors"))
    assert e.value.field == "path"
    assert same(scores(s), old) and s.weights_version == 0


@pytest.mark.parametrize("bad, field", [
    ("model.safetensors", "named_tensors"), (42, "named_tensors"), ([("x",)], "named_tensors[0]"),
    ([(3, torch.zeros(1))], "named_tensors[0]"), ([("model.norm.weight", [1.0])], "named_tensors"),
])
def test_malformed_pairs(bad, field, dirs):
    with pytest.raises(LogprobeError) as e:
        scorer(dirs["llama"][0]).update_weights(bad)
    assert e.value.field == field


def test_refusals(dirs, tmp_path):
    # packed-quantized: a Q8_0 GGUF kept packed
    src = make_hf_dir(tmp_path / "src", "llama", seed=4)
    write_tiny_gguf(tmp_path / "m.gguf", src.float(), "Q8_0")
    with pytest.raises(LogprobeError, match="packed-quantized"):
        scorer(tmp_path / "m.gguf").update_weights(hf_weights(dirs["llama"][1]))
    # the transformers backend
    make_hf_dir(tmp_path / "gpt2", "gpt2")
    with pytest.raises(LogprobeError, match="transformers backend"):
        scorer(tmp_path / "gpt2").load_weights(str(tmp_path / "gpt2"))


def test_dense_gguf_takes_float_weights(dirs, tmp_path):
    """A quantized GGUF expanded at load (weights="dense") is a float model: updated with B's
    weights it scores as B does."""
    from logprobe.loading import load_model

    src = make_hf_dir(tmp_path / "src", "llama", seed=4)
    write_tiny_gguf(tmp_path / "m.gguf", src.float(), "Q8_0")
    s = Scorer(load_model(str(tmp_path / "m.gguf"), "cpu", "float32", weights="dense"), progress=False)
    s.update_weights(hf_weights(dirs["llama"][1]))
    assert same(scores(s), scores(scorer(dirs["llama"][1])))


# -- mixture of experts -------------------------------------------------------------------------------

def make_moe(path, seed: int):
    """A tiny Qwen2-MoE (shared expert, qkv bias, block 1 dense) saved per expert; returns the
    float32 transformers model, whose parameters are stacked (experts.gate_up_proj [E, 2I, H])."""
    import transformers as tf
    from helpers import VOCAB, byte_tokenizer

    cfg = tf.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                            bos_token_id=1, eos_token_id=0, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                            mlp_only_layers=[1])
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                experts_implementation="eager").float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return model


def test_moe_update_stacked_and_per_expert(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_moe(a, 1)
    model_b = make_moe(b, 2)
    names = [n for n, _ in model_b.named_parameters()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # stacked in memory, per expert on disk
    s = scorer(a, True)
    old, fresh_b = scores(s), scores(scorer(b, True))
    assert not same(old, fresh_b)
    s.update_weights(model_b.named_parameters())  # a stream of stacked tensors
    assert same(scores(s), fresh_b)
    s.load_weights(str(a))  # per-expert checkpoint names
    assert same(scores(s), old)
    per_expert = hf_weights(b)
    del per_expert["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(LogprobeError, match=r"missing: model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight;"):
        s.update_weights(per_expert)
    stacked = dict(model_b.named_parameters())
    stacked["model.layers.0.mlp.experts.down_proj"] = stacked["model.layers.0.mlp.experts.down_proj"][:3]
    with pytest.raises(LogprobeError, match="3 experts, the model has 4"):
        s.update_weights(iter(list(stacked.items())))
    assert same(scores(s), old) and s.weights_version == 2


# -- tensor parallelism -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_shard_takes_its_slices_as_loading_reads_them(kind, dirs):
    """A rank's shard (as under torchrun) updated with whole tensors holds exactly the parameters
    ``load_shard`` reads from the new checkpoint, bit for bit."""
    from logprobe.loading.loader import load_shard
    from logprobe.parallel.context import ParallelContext

    a, b = dirs[kind]
    for rank in (0, 1):
        ctx = ParallelContext(rank, 2)  # load_shard takes the model's column blocks from its config
        shard = load_shard(str(a), ctx, "cpu", "float32").model
        want = load_shard(str(b), ctx, "cpu", "float32").model.state_dict()
        assert not torch.equal(shard.state_dict()["layers.0.self_attn.q_proj.weight"],
                               want["layers.0.self_attn.q_proj.weight"])
        from logprobe.loading.update import update_weights

        update_weights(shard, iter(list(hf_weights(b).items())))
        got = shard.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_tensor_parallel_scorer_update(dirs):
    """TP = 2 worker processes: the driver cuts each tensor into the ranks' slices; the scores then
    equal a fresh (TP = 1) scorer's on the new weights, bitwise (deterministic mode is TP-invariant);
    a bad update changes nothing on any rank."""
    a, b = dirs["llama"]
    with Scorer(str(a), device="cpu", dtype="float32", progress=False, deterministic=True,
                tensor_parallel_size=2) as s:
        old = scores(s)
        assert same(old, scores(scorer(a, True)))
        bad = list(hf_weights(b).items())
        bad[-1] = (bad[-1][0], bad[-1][1][:-1])
        with pytest.raises(LogprobeError, match="shape"):
            s.update_weights(iter(bad))
        nan = list(hf_weights(b).items())
        nan[-1] = (nan[-1][0], torch.full_like(nan[-1][1], float("nan")))
        with pytest.raises(LogprobeError, match=f"'{nan[-1][0]}' holds .* non-finite values"):
            s.update_weights(iter(nan))
        assert same(scores(s), old) and s.weights_version == 0
        assert s.update_weights(iter(list(hf_weights(b).items()))) == 1
        assert same(scores(s), scores(scorer(b, True)))
        assert s.load_weights(str(a)) == 2
        assert same(scores(s), old)


def test_server_refuses_non_finite_checkpoint(dirs, tmp_path):
    """/update_weights_from_disk goes through load_weights: a checkpoint with an infinity is
    refused (400, the tensor named), weights_version and the scores stay."""
    import requests
    from server_util import serve

    from logprobe.server import create_app

    a, b = dirs["llama"]
    bad = tmp_path / "inf"
    shutil.copytree(b, bad)
    w = hf_weights(b)
    w["model.norm.weight"] = w["model.norm.weight"].clone()
    w["model.norm.weight"][0] = float("inf")
    save_file(w, str(bad / "model.safetensors"))
    s = scorer(a, True)
    old = scores(s)
    with serve(create_app(s)) as url:
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(bad)}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model_path" and "'model.norm.weight' holds 1 non-finite value" in err["message"]
        assert requests.get(url + "/health", timeout=30).json()["weights_version"] == 0
    assert same(scores(s), old) and s.weights_version == 0


def test_values_beyond_a_float16_model_are_refused(dirs):
    """float32 weights that overflow the model's float16 would be inf after conversion."""
    a, b = dirs["llama"]
    s = Scorer(str(a), device="cpu", dtype="float16", progress=False)
    w = hf_weights(b)
    w["model.norm.weight"] = w["model.norm.weight"].clone()
    w["model.norm.weight"][0] = 1e6
    with pytest.raises(LogprobeError, match="'model.norm.weight' holds values beyond the range of the model's float16"):
        s.update_weights(w)
    assert s.weights_version == 0

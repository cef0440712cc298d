"""Bad input gets a LogprobeError naming the field, never a wrong number."""

from __future__ import annotations

import json

import pytest

from logprobe import LogprobeError, Scorer, load_model
from logprobe.config import EngineConfig


def test_unknown_model():
    with pytest.raises(LogprobeError, match="neither a known model name nor an existing path"):
        load_model("no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(LogprobeError, match="config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(LogprobeError, match="not a .gguf"):
        load_model(str(tmp_path / "x.txt"))
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(LogprobeError, match="GGUF"):
        load_model(str(tmp_path / "x.gguf"))


def test_missing_weights(tmp_path, tiny_dirs):
    src = tiny_dirs["llama"][0]
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(LogprobeError, match="safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_unknown_architecture(tmp_path, tiny_dirs):
    src = tiny_dirs["llama"][0]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "not-a-model"
    cfg["architectures"] = ["NotAModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LogprobeError, match="transformers cannot load"):
        load_model(str(tmp_path), device="cpu")


@pytest.mark.parametrize("call, field", [
    (lambda s: s.score("a", []), "continuations"),
    (lambda s: s.score("a", [""]), "continuation"),
    (lambda s: s.score("a", [" b"], temperature=0), "temperature"),
    (lambda s: s.score("a", [" b"], temperature=float("inf")), "temperature"),
    (lambda s: s.score("a", [" b"], top_k=-1), "top_k"),
    (lambda s: s.perplexity(""), "texts[0]"),
    (lambda s: s.perplexity("   \n"), "texts[0]"),
    (lambda s: s.perplexity([]), "texts"),
    (lambda s: s.perplexity("hello", context_length=1), "context_length"),
    (lambda s: s.perplexity("hello there", stride=5000, context_length=16), "stride"),
    (lambda s: s.perplexity("hi", policy="nope"), "policy"),
    (lambda s: s.perplexity([1, 2, 10**9]), "texts[2]"),
    (lambda s: s.logprobs([{"prompt_token_ids": [1, 2], "completion_token_ids": []}]), "completion_token_ids"),
    (lambda s: s.logprobs([{"prompt_token_ids": [], "completion_token_ids": [3]}]), "prompt_token_ids"),
    (lambda s: s.logprobs([{"prompt_token_ids": [1], "completion_token_ids": [49152]}]), "completion_token_ids[0]"),
    (lambda s: s.logprobs([{"prompt_token_ids": [-1], "completion_token_ids": [5]}]), "prompt_token_ids[0]"),
    (lambda s: s.logprobs([{"prompt_token_ids": [1], "completion_token_ids": ["x"]}]), "completion_token_ids[0]"),
    (lambda s: s.logprobs([{"prompt_token_ids": [1], "completion_token_ids": [2]}], temperature=-1), "temperature"),
    (lambda s: s.logprobs(["not a dict"]), "sequences[0]"),
    (lambda s: s.logprobs([{"prompt_token_ids": [1], "completion_token_ids": [2] * 9000}]), "sequences[0]"),
    (lambda s: s.loglikelihood([("only one",)]), "pairs[0]"),
])
def test_bad_input(default_scorer: Scorer, call, field):
    with pytest.raises(LogprobeError) as e:
        call(default_scorer)
    # the message starts with the field's full path, e.g. "sequences[0].completion_token_ids: ..."
    head = str(e.value).split(": ", 1)[0]
    assert head == field or head.endswith("." + field), str(e.value)


@pytest.mark.parametrize("keyword", [dict(max_batch_tokens=64), dict(progress=False), dict(deterministic=True)])
def test_config_and_a_keyword_that_it_holds_is_an_error(keyword):
    """Scorer(config=..., max_batch_tokens=...) used to ignore the keyword; it names both now,
    before any model is loaded."""
    (name,) = keyword
    with pytest.raises(LogprobeError, match=rf"^{name}: is given with config=EngineConfig") as e:
        Scorer("no-such-model", config=EngineConfig(), **keyword)
    assert f"EngineConfig({name}=...)" in e.value.fix

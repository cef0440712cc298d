"""Models by hub id (``loading.hub``): a prepared hub cache (``HF_HUB_CACHE``, laid out as
``models--ORG--NAME/snapshots/<sha>/...`` with ``refs/main``) and ``HF_HUB_OFFLINE=1``."""

from __future__ import annotations

import shutil

import pytest

from logprobe import Scorer
from logprobe.cli.main import main
from logprobe.loading.hub import hub_path, parse_hub_id

SHA = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(cache, repo: str, files_from) -> object:
    """Lay out ``repo`` in a hub cache the way huggingface_hub writes it; return the snapshot dir."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / SHA
    shutil.copytree(files_from, snap)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from helpers import make_hf_dir, write_tiny_gguf

    src, gguf_src = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("tiny-gguf")
    model = make_hf_dir(src, "llama", seed=5)
    write_tiny_gguf(gguf_src / "tiny-F32.gguf", model.float(), "F32")
    cache = tmp_path_factory.mktemp("hub")
    cached_repo(cache, "org/tiny", src)
    cached_repo(cache, "org/tiny-GGUF", gguf_src)
    return cache, src, gguf_src


@pytest.fixture
def offline_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None, None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0", None)
    assert parse_hub_id("org/name@main:sub/m-Q4_K_M.gguf") == ("org/name", "main", "sub/m-Q4_K_M.gguf")
    for local in ("smollm2-135m", "model.gguf", "./org/name", "/abs/org/name", "~/org/name", "a/b/c"):
        assert parse_hub_id(local) is None, local


def test_hub_id_resolves_from_the_cache(offline_cache):
    cache, src, gguf_src = offline_cache
    snap = cache / "models--org--tiny" / "snapshots" / SHA
    assert hub_path("org/tiny") == snap and hub_path(f"org/tiny@{SHA}") == snap
    assert hub_path("org/tiny-GGUF:tiny-F32.gguf") == cache / "models--org--tiny-GGUF" / "snapshots" / SHA / "tiny-F32.gguf"
    assert hub_path(str(src)) is None  # an existing path is never a hub id
    want = Scorer(str(src), device="cpu", progress=False).score("ab", ["cd", "ef"])
    for spec in ("org/tiny", "org/tiny@main"):
        got = Scorer(spec, device="cpu", progress=False).score("ab", ["cd", "ef"])
        assert [g.token_logprobs for g in got] == [w.token_logprobs for w in want]
    gguf = Scorer("org/tiny-GGUF:tiny-F32.gguf", device="cpu", progress=False)
    assert gguf.info.path.endswith("tiny-F32.gguf")
    direct = Scorer(str(gguf_src / "tiny-F32.gguf"), device="cpu", progress=False)
    assert gguf.score("ab", "cd")[0].log_prob == direct.score("ab", "cd")[0].log_prob


def test_offline_and_not_cached_is_one_clear_line(offline_cache, capsys):
    cache = offline_cache[0]
    for spec, named in (("org/missing", "org/missing"), ("org/tiny@v9", "org/tiny@v9"),
                        ("org/tiny-GGUF:other.gguf", "other.gguf")):
        assert main(["score", "a", "b", "--model", spec, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("logprobe: error: model: ") and named in err and str(cache) in err
        assert "HF_HUB_OFFLINE" in err


def test_offline_hint_names_the_revision(offline_cache, capsys):
    """Offline, ``ORG/NAME@REV`` suggests downloading that revision, not main."""
    assert main(["score", "a", "b", "--model", "org/missing@v2.0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`hf download org/missing --revision v2.0`" in err, err


@pytest.mark.parametrize("spec", ["org/noweights", "org/noweights@main"])
def test_cached_snapshot_without_weights_is_an_incomplete_download(hub, tmp_path, monkeypatch, capsys, spec):
    """Config and tokenizer cached, weights not (a cut-off download): one line naming the snapshot
    and the fix (download the weight files), not advice on how to save a model."""
    src = hub[1]
    cache = tmp_path / "hub"
    cache.mkdir()
    snap = cached_repo(cache, "org/noweights", src)
    for f in snap.glob("*.safetensors"):
        f.unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["score", "a", "b", "--model", spec, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(snap) in err and "incomplete" in err and "weight files" in err and "safe_serialization" not in err
    revision = " --revision main" if "@" in spec else ""
    assert f"`hf download org/noweights{revision}`" in err

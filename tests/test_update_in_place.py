"""In-place weight updates (``update_weights(..., in_place=True)``, groups joined ``in_place``):
each tensor (or bucket) written as it comes, never a second copy of the weights; scoring refused
(``WeightsUnavailable``, the server's 503) from the first write until the update completes, and
after one that failed part way until a complete one.

The reference is a fresh Scorer on the new weights (tiny Llama "b"): after a complete in-place
update every number equals it bitwise (deterministic mode).
"""

from __future__ import annotations

import pytest
import requests
import torch
from helpers import make_hf_dir
from safetensors.torch import load_file, save_file
from server_util import free_port, serve
from test_weight_sync import IDS, finished, trainer

from logprobe import Scorer
from logprobe.errors import LogprobeError, WeightsUnavailable
from logprobe.loading import update
from logprobe.loading.collective import WeightGroup, check_declared
from logprobe.server import ServerConfig, create_app

PROMPT = [{"prompt_token_ids": IDS[:1], "completion_token_ids": IDS[1:]}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        d = tmp_path_factory.mktemp(f"inplace-{name}")
        make_hf_dir(d, "llama", seed=seed)
        out[name] = d
    return out


def scorer(path, tp: int = 1) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True,
                  tensor_parallel_size=tp)


def scores(s: Scorer) -> list[float]:
    return s.logprobs(PROMPT)[0].logprobs.tolist()


def weights(d) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(d / "model.safetensors")).items())


def refusal(s: Scorer) -> str:
    with pytest.raises(WeightsUnavailable) as e:
        scores(s)
    assert e.value.field == "weight_version"
    return e.value.problem


def watched(s: Scorer, pairs, seen: list):
    """``pairs`` as a stream; before each tensor after the first, whether scoring was refused."""
    for i, pair in enumerate(pairs):
        if i:
            try:
                scores(s)
                seen.append(False)
            except WeightsUnavailable:
                seen.append(True)
        yield pair


def test_stream_in_place_one_process(dirs):
    """A stream written as it comes: refused while it runs, then bitwise a fresh load. A stream
    that fails part way (a NaN last) leaves scoring refused until a complete update; one that
    fails before any write (a NaN first) or that misses a tensor at its end says so."""
    s, want = scorer(dirs["a"]), scores(scorer(dirs["b"]))
    old, new = scores(s), weights(dirs["b"])
    seen: list[bool] = []
    assert s.update_weights(watched(s, new, seen), weight_version="v1", in_place=True) == 1
    assert seen and all(seen), seen  # refused from the first write to the stream's end
    assert scores(s) == want and s.weight_version == "v1"

    back = weights(dirs["a"])
    nan = [(n, t.clone()) for n, t in back]
    nan[-1][1].view(-1)[0] = float("nan")
    with pytest.raises(LogprobeError, match="non-finite"):
        s.update_weights(iter(nan), in_place=True)
    assert "failed part way" in refusal(s) and s.weights_version == 1
    assert s.update_weights(back) == 2 and scores(s) == old  # a complete update (all or nothing): scored again

    first = [(n, t.clone()) for n, t in new]
    first[0][1].view(-1)[0] = float("nan")
    with pytest.raises(LogprobeError, match="non-finite"):
        s.update_weights(iter(first), in_place=True)
    assert scores(s) == old  # nothing was written: not refused

    with pytest.raises(LogprobeError, match=new[-1][0]):
        s.update_weights(iter(new[:-1]), in_place=True)  # every tensor but one written, then missing
    assert "failed part way" in refusal(s)
    assert s.update_weights(iter(new), in_place=True) == 3 and scores(s) == want


@pytest.mark.slow  # two gloo workers
def test_stream_in_place_tensor_parallel(dirs, monkeypatch):
    """TP = 2 workers (gloo): the ranks copy in their parts every ``STREAM_COMMIT_BYTES`` (here
    every tensor) instead of staging the model; refused meanwhile; bitwise a fresh TP = 1 load."""
    monkeypatch.setattr(update, "STREAM_COMMIT_BYTES", 1)
    want = scores(scorer(dirs["b"]))
    with scorer(dirs["a"], tp=2) as s:
        old = scores(s)
        nan = [(n, t.clone()) for n, t in weights(dirs["b"])]
        nan[-1][1].view(-1)[0] = float("nan")
        with pytest.raises(LogprobeError, match="non-finite"):
            s.update_weights(iter(nan), in_place=True)
        assert "failed part way" in refusal(s)
        seen: list[bool] = []
        assert s.update_weights(watched(s, weights(dirs["b"]), seen), in_place=True) == 1
        assert seen[1:] and all(seen[1:]), seen  # refused once the first tensor was copied in
        assert scores(s) == want
        assert s.update_weights(iter(weights(dirs["a"])), in_place=True) == 2 and scores(s) == old


def reused_buffer(pairs):
    """``pairs`` as a stream that hands every tensor in the same memory (one flat buffer written
    again for each), as a trainer copying each weight into one staging buffer would."""
    assert len({t.dtype for _, t in pairs}) == 1
    buf = torch.empty(max(t.numel() for _, t in pairs), dtype=pairs[0][1].dtype)
    for name, t in pairs:
        view = buf[:t.numel()].view(t.shape)
        view.copy_(t)
        yield name, view


@pytest.mark.slow  # two gloo workers
@pytest.mark.parametrize("in_place", [False, True])
def test_stream_in_one_reused_buffer(dirs, in_place):
    """A stream whose tensors all lie in one buffer, rewritten for each: every tensor (a replicated
    one too, sent to the workers uncut) is taken as it stood when it came, at TP = 1 and TP = 2,
    staged and in place: bitwise a fresh load."""
    want = scores(scorer(dirs["b"]))
    for tp in (1, 2):
        with scorer(dirs["a"], tp=tp) as s:
            assert s.update_weights(reused_buffer(weights(dirs["b"])), in_place=in_place) == 1
            assert scores(s) == want, tp


def _bucket(s: Scorer, group: WeightGroup, bucket, version=None) -> int:
    """What ``update_weights_from_distributed`` does with an in-place group's bucket once received."""
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
    model = s.loaded.model
    got = group.collect_in_place(bucket, check_declared(model, meta, group.declared), version, model)
    try:
        return s.apply_received_weights(got.tensors, got.version, in_place=True, complete=got.complete, kept=got.kept)
    except LogprobeError:
        group.drop()  # the scorer's drop_round for a joined group
        raise


def test_buckets_in_place(dirs):
    """An in-place group's buckets (``WeightGroup.collect_in_place``, then
    ``apply_received_weights(in_place=True)``): each written as it comes, scoring refused until the
    buckets cover the model, then bitwise a fresh load, version bumped. A bucket holding a NaN is
    written not at all and ends the round: the buckets after it do not complete it."""
    s, want = scorer(dirs["a"]), scores(scorer(dirs["b"]))
    old, new = scores(s), weights(dirs["b"])
    half = len(new) // 2
    group = WeightGroup("g", process=None, rank=1, world_size=2, backend="gloo", device=torch.device("cpu"),
                        in_place=True)
    assert _bucket(s, group, new[:half]) == 0
    assert "being replaced" in refusal(s)
    assert _bucket(s, group, new[half:], "step-1") == 1 and s.weight_version == "step-1"
    assert scores(s) == want and group.held == []

    back = weights(dirs["a"])
    bad = [(n, t.clone()) for n, t in back[half:]]
    bad[0][1].view(-1)[0] = float("nan")
    assert _bucket(s, group, back[:half]) == 1
    with pytest.raises(LogprobeError, match="non-finite"):
        _bucket(s, group, bad)
    assert "failed part way" in refusal(s) and group.held == []
    assert _bucket(s, group, back[half:]) == 1  # a new round: the first half is missing from it
    assert "being replaced" in refusal(s)
    assert _bucket(s, group, back[:half], "step-2") == 2 and scores(s) == old  # covered: scored again


@pytest.mark.slow  # a trainer process over gloo (5 s): the fast tier stays within 4 minutes
def test_in_place_group_over_gloo(dirs):
    """The library's collective path with a group joined ``in_place``: the trainer's NaN round (one
    bucket) is refused before any write (scoring goes on, on the old weights); its good round comes
    in two buckets: after the first scoring is refused, after the second it is bitwise a fresh load."""
    s = scorer(dirs["a"])
    old, want = scores(s), scores(scorer(dirs["b"]))
    port = free_port()
    p = trainer("library", port, dirs["b"])
    try:
        s.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout=60, in_place=True)
        pairs = weights(dirs["b"])
        names = [n for n, _ in pairs]
        dtypes = ["float32"] * len(names)
        shapes = [list(t.shape) for _, t in pairs]
        with pytest.raises(LogprobeError, match="non-finite"):
            s.update_weights_from_distributed(names, dtypes, shapes)
        assert s.weights_version == 0 and scores(s) == old
        half = len(names) // 2
        assert s.update_weights_from_distributed(names[:half], dtypes[:half], shapes[:half]) == 0
        assert "being replaced" in refusal(s)
        assert s.update_weights_from_distributed(names[half:], dtypes[half:], shapes[half:],
                                                 weight_version="step-1") == 1
        s.destroy_weights_update_group()
        finished(p)
    finally:
        p.kill()
    assert scores(s) == want and s.weight_version == "step-1"
    s.close()


@pytest.mark.slow  # the real server and a trainer process
def test_server_in_place_group(dirs):
    """The real server, a group joined with ``in_place``: after the first bucket /generate answers
    503 naming ``weight_version`` (Retry-After); after the second, bitwise a fresh Scorer on "b"."""
    app = create_app(scorer(dirs["a"]), ServerConfig(max_top_logprobs=20))
    body = {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0}
    with serve(app) as url:
        port = free_port()
        p = trainer("server", port, dirs["b"], url, in_place=True)
        try:
            out = finished(p)
        finally:
            p.kill()
        after = requests.post(url + "/generate", json=body, timeout=60).json()
    assert out["init"][0] == 200, out["init"]
    assert out["update0"][0] == 200 and "written in place" in out["update0"][1]["message"], out["update0"]
    assert out["update0"][1]["weights_version"] == 0
    assert out["between"][0] == 503, out["between"]
    assert out["between"][1]["error"]["param"] == "weight_version", out["between"]
    assert out["update1"][0] == 200 and out["update1"][1]["weights_version"] == 1, out["update1"]
    want = scores(scorer(dirs["b"]))
    assert [e[0] for e in after["meta_info"]["input_token_logprobs"][1:]] == want


@pytest.mark.slow  # two gloo workers
def test_load_weights_in_place_tensor_parallel(dirs, tmp_path, monkeypatch):
    """``load_weights(path, in_place=True)`` at TP = 2: the workers copy in their slices as they
    come (every tensor here), bitwise a fresh load; a checkpoint whose last tensor holds a NaN (found
    once the tensors before it are written) leaves scoring refused until a complete load."""
    monkeypatch.setattr(update, "STREAM_COMMIT_BYTES", 1)
    bad = dict(weights(dirs["a"]))
    last = sorted(bad)[-1]
    bad[last] = bad[last].clone()
    bad[last].view(-1)[0] = float("nan")
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    want = scores(scorer(dirs["b"]))
    with scorer(dirs["a"], tp=2) as s:
        old = scores(s)
        assert s.load_weights(str(dirs["b"]), in_place=True) == 1 and scores(s) == want
        with pytest.raises(LogprobeError, match="non-finite"):
            s.load_weights(str(tmp_path / "bad" / "model.safetensors"), in_place=True)
        assert "failed part way" in refusal(s)
        assert s.load_weights(str(dirs["a"]), in_place=True) == 2 and scores(s) == old


def test_server_load_in_place(dirs):
    """``/update_weights_from_disk`` with ``in_place`` (one process: every value checked first, as
    without it): 200, the new version, /generate bitwise a fresh Scorer on "b"."""
    app = create_app(scorer(dirs["a"]), ServerConfig(max_top_logprobs=20))
    body = {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0}
    with serve(app) as url:
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(dirs["b"]), "in_place": True},
                          timeout=60)
        after = requests.post(url + "/generate", json=body, timeout=60).json()
    assert r.status_code == 200 and r.json()["weights_version"] == 1, r.json()
    assert [e[0] for e in after["meta_info"]["input_token_logprobs"][1:]] == scores(scorer(dirs["b"]))

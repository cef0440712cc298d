"""Weights pushed over a collective (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``): a gloo "trainer" in another process (rank 0, its own
``init_custom_process_group`` as SGLang's and OpenRLHF's trainers build it) broadcasts the weights
of tiny Llama "b" to a scorer serving tiny Llama "a", through the library and through the real
HTTP server. Afterwards the scores equal a fresh Scorer's on "b", bitwise (deterministic mode),
and the version changed; refusals leave the old weights in force."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import requests
import torch
from helpers import TRAINER_GROUP, make_hf_dir
from server_util import free_port, serve

from logprobe import Scorer
from logprobe.errors import LogprobeError
from logprobe.server import ServerConfig, create_app

IDS = [5, 71, 72, 3, 140, 8, 200, 17, 9, 66, 250, 12]

# rank 0: the trainer. argv: mode ("library" | "server"), port, checkpoint file, [server URL]
TRAINER = TRAINER_GROUP + textwrap.dedent('''
    import json, os, sys, threading, time
    from datetime import timedelta
    import requests, torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    mode, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    url = sys.argv[4] if len(sys.argv) > 4 else None
    weights = load_file(path)
    names = sorted(weights)
    out = {}

    def call(key, route, body):
        out[key] = (lambda r: (r.status_code, r.json()))(requests.post(url + route, json=body, timeout=60))

    def beside(key, route, body):
        t = threading.Thread(target=call, args=(key, route, body))
        t.start()
        return t

    t = beside("init", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "weight_update_group", "backend": "gloo",
        **({"in_place": True} if os.environ.get("TRAINER_IN_PLACE") else {})}) if url else None
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "weight_update_group",
                                   timedelta(seconds=60))
    if t:
        t.join()
    if mode == "library":  # first a round the scorer refuses (a NaN): the group stays usable
        for i, name in enumerate(names):
            bad = weights[name].clone()
            if i == 1:
                bad.view(-1)[0] = float("nan")
            dist.broadcast(bad.view(torch.uint8) if bad.dtype == torch.float8_e4m3fn else bad, src=0, group=pg)
    half = len(names) // 2
    for j, bucket in enumerate((names[:half], names[half:])):  # two buckets, as trainers send them
        if url:
            t = beside(f"update{j}", "/update_weights_from_distributed", {
                "names": bucket, "dtypes": [str(weights[n].dtype).removeprefix("torch.") for n in bucket],
                "shapes": [list(weights[n].shape) for n in bucket], "weight_version": "step-1"})
        for i, name in enumerate(bucket):
            w = weights[name].contiguous()  # FP8 codes as bytes: gloo has no float8 type
            dist.broadcast(w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w, src=0, group=pg)
            if url and j == 0 and i == len(bucket) // 2:  # half sent: the server still scores, on the old weights
                call("during", "/generate", {"input_ids": [5, 71, 72, 3], "return_logprob": True,
                                             "logprob_start_len": 0})
        if url:
            t.join()
        if url and j == 0:  # the first bucket is held: still the old weights
            call("between", "/generate", {"input_ids": [5, 71, 72, 3], "return_logprob": True,
                                          "logprob_start_len": 0})
    if t:
        t.join()
        call("destroy", "/destroy_weights_update_group", {"group_name": "weight_update_group"})
    else:  # the scorer leaves first (this process hosts the store: it must outlive the scorer's group)
        sys.stdin.readline()
    dist.destroy_process_group(pg)
    print(json.dumps(out))
''')


def scorer(path) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        d = tmp_path_factory.mktemp(f"sync-{name}")
        make_hf_dir(d, "llama", seed=seed)
        out[name] = d
    return out


def trainer(mode: str, port: int, model_dir, url: str | None = None, in_place: bool = False) -> subprocess.Popen:
    """``in_place``: the server's group is joined with ``in_place`` (each bucket written as it comes)."""
    args = [sys.executable, "-c", TRAINER, mode, str(port), str(model_dir / "model.safetensors")]
    env = dict(os.environ, TRAINER_IN_PLACE="1") if in_place else None
    return subprocess.Popen(args + ([url] if url else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finished(p: subprocess.Popen) -> dict:
    out, err = p.communicate("left\n", timeout=120)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def logprobs(s: Scorer) -> list[float]:
    return s.logprobs([{"prompt_token_ids": IDS[:1], "completion_token_ids": IDS[1:]}])[0].logprobs.tolist()


def test_library_update_weights_from_distributed(models):
    """The library API: join, receive every tensor, apply; bitwise a fresh load of the new weights.
    A round holding a NaN is received whole and refused: the old weights stay, the group works on.
    The good round comes in two buckets: the first is held (old weights), the second completes it."""
    s = scorer(models["a"])
    before_nsocks = "NCCL_NSOCKS_PERTHREAD" in os.environ
    old, want = logprobs(s), logprobs(scorer(models["b"]))
    assert old != want
    port = free_port()
    p = trainer("library", port, models["b"])
    try:
        s.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout=60)
        assert "NCCL_NSOCKS_PERTHREAD" not in os.environ or before_nsocks  # gloo adds no NCCL setting
        from safetensors import safe_open
        with safe_open(str(models["b"] / "model.safetensors"), "pt") as f:
            names = sorted(f.keys())
            meta = [(f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in names]
        dtypes = [{"F32": "torch.float32", "BF16": "bfloat16", "F16": "float16"}[d] for d, _ in meta]
        with pytest.raises(LogprobeError) as e:  # the NaN round: received whole, refused, nothing changed
            s.update_weights_from_distributed(names, dtypes, [shape for _, shape in meta])
        assert e.value.field == "names" and names[1] in str(e.value), e.value
        assert s.weights_version == 0 and s.weight_version == "0" and logprobs(s) == old
        half, shapes = len(names) // 2, [shape for _, shape in meta]
        assert s.update_weights_from_distributed(names[:half], dtypes[:half], shapes[:half]) == 0  # held
        assert s.weight_version == "0" and logprobs(s) == old
        assert s.update_weights_from_distributed(names[half:], dtypes[half:], shapes[half:],
                                                 weight_version="step-1") == 1  # every weight: applied
        s.destroy_weights_update_group()
        finished(p)
    finally:
        p.kill()
    assert s.weight_version == "step-1" and s.weights_version == 1
    assert logprobs(s) == want  # bitwise: the same numbers as a fresh Scorer on "b"
    with pytest.raises(LogprobeError) as e:  # gone: a second destroy names the group
        s.destroy_weights_update_group()
    assert e.value.field == "group_name"
    s.close()


@pytest.mark.parametrize("environ,backend,added", [
    ({}, "nccl", {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}),
    ({"NCCL_P2P_DISABLE": "1"}, "nccl", {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}),
    ({"NCCL_SOCKET_NTHREADS": "2"}, "nccl", {}),  # the user's choice stands, the other one too
    ({"NCCL_NSOCKS_PERTHREAD": "1"}, "nccl", {}),
    ({}, "gloo", {}),
])
def test_socket_settings_gold(environ, backend, added):
    """What the receiving side adds before joining: NCCL takes the socket count from the receiver,
    16 sockets instead of 1 took torchrl's llama-8b update from 3.06 to 1.17 s (docs/perf.md)."""
    from logprobe.loading.collective import socket_settings
    assert socket_settings(environ, backend) == added


def test_library_refusals(models):
    """Refused before anything is received or joined, each naming its field."""
    s = scorer(models["a"])
    cases = [(dict(backend="nccl"), "backend"), (dict(backend="mpi"), "backend"), (dict(world_size=1), "world_size"),
             (dict(rank_offset=0), "rank_offset"), (dict(rank_offset=2), "rank_offset"),
             (dict(master_address="no-such-host.invalid"), "master_address"), (dict(world_size=10**30), "world_size"),
             (dict(world_size=2**31), "world_size"), (dict(receive_timeout=0), "receive_timeout"),
             (dict(receive_timeout=float("nan")), "receive_timeout")]
    for change, field in cases:
        kw = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
              "backend": "gloo", **change}
        with pytest.raises(LogprobeError) as e:
            s.init_weights_update_group(**kw, connect_timeout=0.2)
        assert e.value.field == field, (change, e.value)
    with pytest.raises(LogprobeError) as e:  # nothing listens there
        s.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="gloo", connect_timeout=0.3)
    assert e.value.field == "master_port"
    with pytest.raises(LogprobeError) as e:
        s.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[2, 2]])
    assert e.value.field == "group_name"  # no group joined
    with pytest.raises(LogprobeError) as e:
        s.update_weights_from_distributed(["lm_head.weight"], ["int8"], [[2, 2]])
    assert e.value.field == "dtypes[0]"
    with pytest.raises(LogprobeError) as e:
        s.update_weights_from_distributed(["a", "b"], ["float32"], [[2, 2]])
    assert e.value.field == "shapes"
    from logprobe.loading.collective import covers  # when held buckets are applied
    hf = list(_load(models["b"]).items())
    assert covers(s.loaded.model, hf) and not covers(s.loaded.model, hf[:-1])
    assert covers(s.loaded.model, hf[:1] + [("model.no_such.weight", hf[0][1])])  # applied now: refused
    assert s.weights_version == 0  # (a tensor-parallel scorer joins too: test_tensor_parallel_scorer_takes_...)


def test_metadata_checked_against_the_model(models):
    """``check_declared``: what a bucket declares, refused before one byte is received, naming the
    entry; through the update's own mapping (a name the model ignores passes, within a bound)."""
    from logprobe.loading.collective import Declared, check_declared
    model = scorer(models["a"]).loaded.model
    hf = _load(models["b"])
    good = [(n, t.dtype, tuple(t.shape)) for n, t in sorted(hf.items())]
    f32, head = torch.float32, tuple(hf["lm_head.weight"].shape)
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"  # ignored, as the loader ignores it
    cases = [([("model.no_such.weight", f32, (4, 4))], Declared(), "names[0]", "not a weight"),
             ([("lm_head.weight", f32, (3, 3))], Declared(), "shapes[0]", f"the model's is {head}"),
             ([("lm_head.weight", f32, head)] * 2, Declared(), "names[1]", "given twice"),
             ([("lm_head.weight", f32, head)], Declared(names={"lm_head.weight"}, units={"lm_head.weight"}),
              "names[0]", "already received"),
             ([("lm_head.weight", f32, (0, head[1]))], Declared(), "shapes[0]", "no elements"),
             ([(inv_freq, f32, (10**6, 10**6))], Declared(), "shapes[0]", "more than the model's own")]
    for metadata, held, field, words in cases:
        with pytest.raises(LogprobeError) as e:
            check_declared(model, metadata, held)
        assert e.value.field == field and words in str(e.value), (metadata, e.value)
    first = check_declared(model, good[:3] + [(inv_freq, f32, (16,))], Declared())
    assert first.names == {n for n, _, _ in good[:3]} | {inv_freq} and first.ignored == 16
    rest = check_declared(model, good[3:], first)  # the next bucket: the rest of the weights
    first.add(rest)
    assert len(first.units) == len(good) and first.names >= set(hf)


def test_receiver_imports_torch_only():
    """The receiver process runs ``loading/receiver.py`` by path: it must import nothing of the
    package (no model, a small start), only the standard library and torch."""
    import ast

    from logprobe.loading import receiver
    tree = ast.parse(open(receiver.__file__).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {"." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    tops = {n.split(".")[0] for n in names}
    assert tops - set(sys.stdlib_module_names) == {"torch"}, tops


def _load(d):
    from safetensors.torch import load_file
    return load_file(str(d / "model.safetensors"))


def test_server_update_weights_from_distributed(models):
    """The real server: the trainer calls the HTTP routes and broadcasts two buckets; a request
    scored while the tensors arrive, or with the first bucket held, answers the old weights;
    afterwards /generate equals a fresh Scorer on "b"."""
    lib_a, lib_b = scorer(models["a"]), scorer(models["b"])
    app = create_app(scorer(models["a"]), ServerConfig(max_top_logprobs=20))
    body = {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0}
    with serve(app) as url:
        before = requests.post(url + "/generate", json=body, timeout=60).json()
        port = free_port()
        p = trainer("server", port, models["b"], url)
        try:
            out = finished(p)
        finally:
            p.kill()
        after = requests.post(url + "/generate", json=body, timeout=60).json()
        version = requests.get(url + "/get_weight_version", timeout=60).json()
        # a bad body: 400 naming the field, SGLang's success false
        bad = requests.post(url + "/update_weights_from_distributed",
                            json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "abort_all_requests": True},
                            timeout=60)
        gone = requests.post(url + "/update_weights_from_distributed",
                             json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, timeout=60)
        nccl = requests.post(url + "/init_weights_update_group",
                             json={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                   "world_size": 2}, timeout=60)
    assert out["init"][0] == 200 and out["init"][1]["success"] is True, out["init"]
    assert out["update0"][0] == 200 and out["update0"][1]["success"] is True, out["update0"]
    assert out["update0"][1]["weights_version"] == 0 and "held" in out["update0"][1]["message"]
    assert out["update1"][0] == 200 and out["update1"][1]["success"] is True, out["update1"]
    assert out["update1"][1]["weights_version"] == 1 and out["update1"][1]["weight_version"] == "step-1"
    assert out["destroy"][0] == 200 and out["destroy"][1]["success"] is True, out["destroy"]
    want_during = lib_a.logprobs([{"prompt_token_ids": [5], "completion_token_ids": [71, 72, 3]}])[0].logprobs
    for key in ("during", "between"):  # while the tensors arrive, and with the first bucket held
        reply = out[key][1]
        assert reply["weights_version"] == 0 and reply["meta_info"]["weight_version"] == "0", key
        assert [e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]] == want_during.tolist(), key

    def scores(reply):
        return [e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]]

    assert before["weights_version"] == 0 and scores(before) == logprobs(lib_a)
    assert after["weights_version"] == 1 and after["meta_info"]["weight_version"] == "step-1"
    assert scores(after) == logprobs(lib_b)  # bitwise: a fresh Scorer on the new weights
    assert version == {"weight_version": "step-1"}
    assert bad.status_code == 400, bad.json()
    assert "abort_all_requests" in json.dumps(bad.json()["error"])
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "group_name", gone.json()
    assert nccl.status_code == 400 and nccl.json()["error"]["param"] == "backend", nccl.json()
    assert torch.equal(torch.tensor(scores(after)), torch.tensor(logprobs(lib_b)))


@pytest.mark.slow  # two gloo workers and a trainer process
def test_tensor_parallel_scorer_takes_weights_over_a_collective(models):
    """A TP = 2 scorer (its workers hold the weights): the driver joins the group, receives the
    buckets and hands each rank its parts; a NaN round is refused with nothing changed; afterwards
    the scores equal a fresh one-process scorer's on the new weights, bitwise (deterministic mode)."""
    from safetensors import safe_open

    want = logprobs(scorer(models["b"]))
    with Scorer(str(models["a"]), device="cpu", dtype="float32", progress=False, deterministic=True,
                tensor_parallel_size=2) as s:
        old = logprobs(s)
        assert old != want
        port = free_port()
        p = trainer("library", port, models["b"])
        try:
            s.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout=60)
            with safe_open(str(models["b"] / "model.safetensors"), "pt") as f:
                names = sorted(f.keys())
                shapes = [f.get_slice(n).get_shape() for n in names]
            dtypes, half = ["float32"] * len(names), len(names) // 2
            with pytest.raises(LogprobeError, match=names[1]):
                s.update_weights_from_distributed(names, dtypes, shapes)
            assert logprobs(s) == old
            assert s.update_weights_from_distributed(names[:half], dtypes[:half], shapes[:half]) == 0
            assert s.update_weights_from_distributed(names[half:], dtypes[half:], shapes[half:]) == 1
            s.destroy_weights_update_group()
            finished(p)
        finally:
            p.kill()
        assert logprobs(s) == want

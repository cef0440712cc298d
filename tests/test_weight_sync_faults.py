"""A trainer's faults in the weight sync cost the trainer an error, never the server: the real
HTTP server (``serve``) and a real gloo trainer subprocess (rank 0, its own
``init_custom_process_group`` as SGLang's trainers build it), driven one command at a time.

* a broadcast of another size than declared (gloo aborts the process that receives a longer one,
  and takes a shorter one silently): 4xx naming the field, the server alive, the old weights scored bitwise as before; a new join and a
  valid round then give bitwise the new weights;
* metadata the model cannot take (an unknown name, a wrong shape, a name twice, a shape without
  elements): 400 at once, naming ``names[i]`` / ``shapes[i]``, nothing left pending;
* metadata with no broadcast after it: 4xx once ``weight_sync_timeout`` passed;
* a ``world_size`` no group can have: 400 before anything connects.

Every refusal after a join leaves the group (the trainer's broadcasts can no longer be received
in step): later calls on it are refused until it is joined again."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import requests
from helpers import TRAINER_GROUP, make_hf_dir
from server_util import free_port, serve

from logprobe import Scorer
from logprobe.server import ServerConfig, create_app

IDS = [5, 71, 72, 3, 140, 8, 200, 17, 9, 66, 250, 12]
TIMEOUT = 2.5  # the server's weight_sync_timeout in these tests (seconds)

# rank 0: the trainer. argv: server URL, checkpoint file. Reads one JSON command a line, answers
# one JSON line: {"op": "join", "port": P} joins a fresh group (the last one dropped);
# {"op": "destroy"} leaves it (the server first, as SGLang's trainers do);
# {"op": "update", "body": {...}, "send": [name | shape, ...]} posts the body and, beside it,
# broadcasts each named weight (or zeros of a shape) until one broadcast fails.
TRAINER = TRAINER_GROUP + textwrap.dedent('''
    import json, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta
    import requests, torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    url, weights = sys.argv[1], load_file(sys.argv[2])
    pool, pg = ThreadPoolExecutor(1), None

    def post(route, body):
        r = requests.post(url + route, json=body, timeout=120)
        return [r.status_code, r.json()]

    for line in sys.stdin:
        cmd, out = json.loads(line), {}
        if cmd["op"] == "join":
            if pg is not None:
                dist.destroy_process_group(pg)
            reply = pool.submit(post, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": cmd["port"], "rank_offset": 1, "world_size": 2,
                "group_name": "weight_update_group", "backend": "gloo"})
            pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{cmd['port']}", 2, 0, "weight_update_group",
                                           timedelta(seconds=20))
            out["reply"] = reply.result()
        elif cmd["op"] == "destroy":
            out["reply"] = post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
            dist.destroy_process_group(pg)
            pg = None
        else:
            start = time.monotonic()
            reply = pool.submit(post, "/update_weights_from_distributed", cmd["body"])
            out["sent"] = 0
            for spec in cmd["send"]:
                tensor = weights[spec].contiguous() if isinstance(spec, str) else torch.zeros(spec)
                try:
                    dist.broadcast(tensor, src=0, group=pg)
                except Exception as e:  # the server's receiver is gone: this trainer's error
                    out["error"] = type(e).__name__
                    break
                out["sent"] += 1
            out["reply"], out["seconds"] = reply.result(), time.monotonic() - start
        print(json.dumps(out), flush=True)
''')


class Trainer:
    """The trainer subprocess, one command at a time."""

    def __init__(self, url: str, checkpoint) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", TRAINER, url, str(checkpoint)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __call__(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the trainer ended:\n" + self.p.communicate(timeout=30)[1][-3000:])
        return json.loads(line)

    def join(self) -> None:
        out = self(op="join", port=free_port())
        assert out["reply"][0] == 200, out

    def update(self, names, shapes=None, send=None, dtypes=None, **body) -> dict:
        shapes = shapes or [list(self.shapes[n]) for n in names]
        body = {"names": names, "dtypes": dtypes or ["float32"] * len(names), "shapes": shapes, **body}
        return self(op="update", body=body, send=names if send is None else send)

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(url, trainer, old scores, new scores, weight shapes): a server on tiny Llama "a" whose
    trainer holds "b"."""
    from safetensors import safe_open
    dirs = {}
    for name, seed in (("a", 3), ("b", 4)):
        dirs[name] = tmp_path_factory.mktemp(f"faults-{name}")
        make_hf_dir(dirs[name], "llama", seed=seed)
    want = {}
    for name in ("a", "b"):
        s = Scorer(str(dirs[name]), device="cpu", dtype="float32", progress=False, deterministic=True)
        want[name] = s.logprobs([{"prompt_token_ids": IDS[:1], "completion_token_ids": IDS[1:]}])[0].logprobs.tolist()
        s.close()
    assert want["a"] != want["b"]
    with safe_open(str(dirs["b"] / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    scorer = Scorer(str(dirs["a"]), device="cpu", dtype="float32", progress=False, deterministic=True)
    app = create_app(scorer, ServerConfig(weight_sync_timeout=TIMEOUT))
    with serve(app) as url:
        trainer = Trainer(url, dirs["b"] / "model.safetensors")
        trainer.shapes = shapes
        try:
            yield url, trainer, want
        finally:
            trainer.close()


def scores(url: str) -> tuple[list[float], str]:
    r = requests.post(url + "/generate", json={"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0},
                      timeout=60).json()
    return [e[0] for e in r["meta_info"]["input_token_logprobs"][1:]], r["meta_info"]["weight_version"]


def left(reply: list, field: str) -> None:
    """A refusal that left the group: 400 naming ``field``, SGLang's success false."""
    status, body = reply
    assert status == 400 and body["success"] is False, body
    assert body["error"]["param"] == field, body
    assert "the group was left: call init_weights_update_group again" in body["error"]["message"], body


def still_serving(url: str, before: tuple[list[float], str]) -> None:
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert scores(url) == before  # bitwise the old weights, the version unchanged


def valid_round(url: str, trainer: Trainer, want: list[float], version: str) -> None:
    """A new join, every weight in two buckets: bitwise a fresh Scorer on the new weights."""
    trainer.join()
    names = sorted(trainer.shapes)
    half = len(names) // 2
    out = trainer.update(names[:half])  # a bucket: held
    assert out["reply"][0] == 200 and "held" in out["reply"][1]["message"], out
    out = trainer.update(names[half:], weight_version=version)
    assert out["reply"][0] == 200 and out["reply"][1]["weight_version"] == version, out
    assert scores(url) == (want, version)
    assert trainer(op="destroy")["reply"][0] == 200


def test_mis_sized_broadcast_leaves_the_group_and_the_server_serves(setup):
    """A broadcast of another size than declared: before, gloo aborted the server (``EnforceNotMet
    76800 vs 36``, uncatchable) on a longer one, and took a shorter one into part of the buffer.
    Declared wrong: refused before receiving. Declared right but sent longer: the receiver process
    ends; shorter: the receiver sees it. Each time the server answers naming the tensor."""
    url, trainer, want = setup
    before = scores(url)
    trainer.join()
    out = trainer.update(["lm_head.weight"], shapes=[[3, 3]], send=[[300, 64]])
    left(out["reply"], "shapes[0]")
    assert "(3, 3)" in out["reply"][1]["error"]["message"]
    still_serving(url, before)
    gone = trainer.update(["lm_head.weight"], send=[])  # the group was left: refused until joined again
    assert gone["reply"][0] == 400 and gone["reply"][1]["error"]["param"] == "group_name", gone
    trainer.join()
    lm_head = trainer.shapes["lm_head.weight"]
    out = trainer.update(["model.embed_tokens.weight", "lm_head.weight"],
                         send=["model.embed_tokens.weight", [lm_head[0] + 44, lm_head[1]]])
    left(out["reply"], "shapes[1]")  # the receiver ended on the second tensor, the first one came
    assert out["seconds"] < TIMEOUT, out
    still_serving(url, before)
    trainer.join()  # shorter than declared: gloo takes it silently, the rest of the buffer unwritten
    out = trainer.update(["lm_head.weight"], send=[[lm_head[0] - 100, lm_head[1]]])
    left(out["reply"], "shapes[0]")
    assert "shorter than the" in out["reply"][1]["error"]["message"] and out["seconds"] < TIMEOUT, out
    still_serving(url, before)
    valid_round(url, trainer, want["b"], "after-abort")


def test_name_held_from_an_earlier_bucket_refused_before_receiving(setup):
    """A bucket is held; the next one names a weight of it again: 400 at once naming it, the held
    bucket dropped, the group left with nothing pending in it: the next group's round works."""
    url, trainer, want = setup
    before = scores(url)
    trainer.join()
    names = sorted(trainer.shapes)
    out = trainer.update(names[:2])
    assert out["reply"][0] == 200 and "held" in out["reply"][1]["message"], out
    out = trainer.update(names[1:3], send=names[1:3])
    left(out["reply"], "names[0]")
    assert "already received" in out["reply"][1]["error"]["message"] and out["seconds"] < TIMEOUT / 2, out
    still_serving(url, before)
    valid_round(url, trainer, want["b"], "after-twice")


@pytest.mark.slow  # a join per case (a receiver process each): the fast tier keeps its budget
@pytest.mark.parametrize("names,shapes,field", [
    (["model.no_such.weight"], [[4, 4]], "names[0]"),
    (["lm_head.weight"], [[64, 256]], "shapes[0]"),
    (["lm_head.weight", "lm_head.weight"], None, "names[1]"),
    (["lm_head.weight"], [[0, 64]], "shapes[0]"),
], ids=["unknown-name", "wrong-shape", "twice", "zero-size"])
def test_metadata_refused_before_receiving(setup, names, shapes, field):
    """Refused at once (no receive waits for the timeout), naming the entry; the group is left,
    nothing of it stays pending: the next group's round works."""
    url, trainer, want = setup
    before = scores(url)
    trainer.join()
    out = trainer.update(names, shapes=shapes, send=names if shapes is None else [])
    left(out["reply"], field)
    assert out["seconds"] < TIMEOUT / 2, out
    still_serving(url, before)
    valid_round(url, trainer, want["b"], f"after-{field}")


def test_metadata_without_broadcast_times_out(setup):
    url, trainer, _ = setup
    before = scores(url)
    trainer.join()
    names = sorted(trainer.shapes)
    out = trainer.update(names[:2], send=names[:1])  # the second tensor never comes
    left(out["reply"], "names[1]")
    assert TIMEOUT <= out["seconds"] < TIMEOUT + 10, out
    assert "did not arrive within 2.5 s" in out["reply"][1]["error"]["message"]
    still_serving(url, before)


@pytest.mark.parametrize("world_size", [10**30, 2**31])
def test_world_size_refused_before_connecting(setup, world_size):
    url, _, _ = setup
    with socket.create_server(("127.0.0.1", 0)) as store:  # a "store" that must see no connection
        store.setblocking(False)
        r = requests.post(url + "/init_weights_update_group", timeout=10, json={
            "master_address": "127.0.0.1", "master_port": store.getsockname()[1], "rank_offset": 1,
            "world_size": world_size, "backend": "gloo"})
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            store.accept()
    assert r.status_code == 400 and r.json()["error"]["param"] == "world_size", r.json()


def test_weight_sync_timeout_option():
    """``logprobe serve --weight-sync-timeout S`` -> ``ServerConfig.weight_sync_timeout``, a number
    of seconds > 0 (else refused, naming it)."""
    from logprobe.cli.main import build_parser
    from logprobe.errors import LogprobeError
    args = build_parser().parse_args(["serve", "--model", "m", "--weight-sync-timeout", "7.5"])
    assert args.weight_sync_timeout == 7.5
    assert ServerConfig().weight_sync_timeout == 300.0
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(LogprobeError) as e:
            ServerConfig(weight_sync_timeout=bad)
        assert e.value.field == "weight_sync_timeout", bad

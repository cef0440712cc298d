"""Weights pushed over NCCL between two GPUs (``gpu``; skipped without 2 CUDA devices): ``logprobe
serve`` (the real CLI, a subprocess) serves tiny Llama "a" in bf16 on GPU 1; a trainer process on
GPU 0 joins the weight update group with ``backend: "nccl"`` (its own ``init_custom_process_group``,
as SGLang's trainers build it) and broadcasts "b" in two buckets. A ``/generate`` sent with the
first bucket held answers the old weights; afterwards the scores equal a fresh Scorer's on "b" on
the same GPU, bitwise (deterministic mode), under the trainer's ``weight_version``. Both device
layouts of docs/rl.md: each process sees both GPUs (NCCL may copy peer to peer), or one GPU
each with NCCL's peer-to-peer and shared-memory transports off on both sides (torchrl's setting).
The same protocol over gloo, on CPU, is tests/test_weight_sync.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import make_hf_dir
from server_util import free_port, wait_http

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL between them)")]

IDS = [5, 71, 72, 3, 140, 8, 200, 17, 9, 66, 250, 12]

# argv: server URL, store port, checkpoint. Prints one JSON line: the replies it got.
TRAINER = textwrap.dedent('''
    import json, sys, threading
    from datetime import timedelta
    import requests, torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    url, port, path, ids = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.cuda.set_device(0)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(path, device="cuda:0").items()}
    names, out = sorted(weights), {}

    def call(key, route, body):
        r = requests.post(url + route, json=body, timeout=300)
        out[key] = (r.status_code, r.json())

    def beside(key, route, body):
        t = threading.Thread(target=call, args=(key, route, body))
        t.start()
        return t

    t = beside("init", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
               "rank_offset": 1, "world_size": 2, "group_name": "g", "backend": "nccl"})
    tm = timedelta(seconds=300)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=tm))
    store.set_timeout(tm)
    pg, _ = _new_process_group_helper(2, 0, [], Backend("nccl"), PrefixStore("g", store), group_name="g", timeout=tm)
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    t.join()
    half = len(names) // 2
    for j, bucket in enumerate((names[:half], names[half:])):
        t = beside(f"update{j}", "/update_weights_from_distributed", {
            "names": bucket, "dtypes": ["bfloat16"] * len(bucket), "shapes": [list(weights[n].shape) for n in bucket],
            "group_name": "g", **({"weight_version": "step-1"} if j else {})})
        for n in bucket:
            dist.broadcast(weights[n], src=0, group=pg)
        torch.cuda.synchronize()
        t.join()
        if j == 0:  # the first bucket is held: still the old weights
            call("between", "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0})
    call("after", "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0})
    call("destroy", "/destroy_weights_update_group", {"group_name": "g"})
    dist.destroy_process_group(pg)
    print(json.dumps(out))
''')

REFERENCE = textwrap.dedent('''
    import json, sys
    from logprobe import Scorer
    s = Scorer(sys.argv[1], device="cuda:0", dtype="bfloat16", progress=False, deterministic=True)
    ids = json.loads(sys.argv[2])
    print(json.dumps(s.logprobs([{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]}])[0].logprobs.tolist()))
''')


def env(**extra) -> dict:
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def reference(path) -> list[float]:
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(path), json.dumps(IDS)], env=env(CUDA_VISIBLE_DEVICES="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_server_update_weights_over_nccl(layout, tmp_path):
    make_hf_dir(tmp_path / "a", "llama", seed=3)
    make_hf_dir(tmp_path / "b", "llama", seed=4)
    nccl = {} if layout == "shared" else {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    server_env = env(CUDA_VISIBLE_DEVICES="1,0" if layout == "shared" else "1", **nccl)
    trainer_env = env(CUDA_VISIBLE_DEVICES="0,1" if layout == "shared" else "0", **nccl)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(tmp_path / "a"),
                               "--device", "cuda:0", "--dtype", "bfloat16", "--deterministic", "--port", str(port),
                               "--log-level", "warning", "--quiet"], env=server_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(url, timeout=300)
        except RuntimeError:
            server.kill()
            raise RuntimeError("server did not start:\n" + server.communicate()[0][-4000:]) from None
        p = subprocess.run([sys.executable, "-c", TRAINER, url, str(free_port()),
                            str(tmp_path / "b" / "model.safetensors"), json.dumps(IDS)], env=trainer_env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    for key in ("init", "update0", "update1", "destroy"):
        assert out[key][0] == 200 and out[key][1]["success"] is True, (key, out[key])
    assert out["update0"][1]["weights_version"] == 0 and "held" in out["update0"][1]["message"]
    assert out["update1"][1]["weights_version"] == 1 and out["update1"][1]["weight_version"] == "step-1"

    def scores(key):
        reply = out[key][1]
        return [e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]], reply["meta_info"]["weight_version"]

    want_a, want_b = reference(tmp_path / "a"), reference(tmp_path / "b")
    assert want_a != want_b
    assert scores("between") == (want_a, "0")  # the first bucket held: the old weights
    assert scores("after") == (want_b, "step-1")  # bitwise: a fresh Scorer on the pushed weights, same GPU

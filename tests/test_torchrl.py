"""torchrl's ``SGLangWeightSyncScheme``, its code unchanged, pointed at ``logprobe serve`` (the real
CLI in a subprocess): a trainer process registers a transformers Llama, joins the weight update
group through ``/init_weights_update_group`` and pushes its weights with ``update_weights()``
(``/pause_generation``, ``/get_load`` until idle, one ``/update_weights_from_distributed`` naming
every tensor, a broadcast per tensor, ``/continue_generation``). Then it loads other weights and
pushes again through the same group. After each push the server's scores equal a fresh Scorer's
on those weights, bitwise (deterministic mode), under a new ``weight_version``.

* ``gpu``: as torchrl runs it, NCCL between the trainer on GPU 0 and the server on GPU 1 (each
  process sees its own GPU only; NCCL's peer-to-peer and shared-memory transports are off on both
  sides, as the scheme sets them in the trainer). Needs 2 CUDA devices.
* CPU: the scheme hard-codes CUDA (``torch.cuda.set_device``, ``tensor.to("cuda:N")``,
  ``torch.cuda.synchronize``) and NCCL (its process group, and its ``/init_weights_update_group``
  body sends no backend: SGLang's default, ``"nccl"``). In the trainer process only, those calls are
  replaced: the CUDA ones do nothing, the group is built with gloo and the init body names
  ``"gloo"``. Everything else of the scheme (its HTTP calls and bodies, the pause and load polling,
  the order of the broadcasts, the group's lifetime) runs as written.
"""

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

from logprobe import Scorer

torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed")

SEQS = [[5, 71, 72, 3, 140, 8, 200, 17, 9, 66, 250, 12], [9, 8, 7, 100, 101, 102, 3, 4, 5, 6, 250]]

# argv: mode ("cpu" | "cuda"), server URL, checkpoint "b", checkpoint "a". Prints one JSON line:
# the /generate scores and weight_version after each push (b, then a again).
TRAINER = textwrap.dedent('''
    import json, sys, types
    import requests, torch, transformers
    from torchrl.weight_update.llm import SGLangWeightSyncScheme
    from torchrl.weight_update.llm import sglang_nccl
    from torchrl.weight_update.llm.sglang_nccl import get_model_metadata

    mode, url, path_b, path_a = sys.argv[1:5]
    seqs = json.loads(sys.argv[5])
    if mode == "cpu":  # the scheme's CUDA and NCCL calls, replaced in this process only
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.synchronize = lambda *a, **k: None
        to = torch.Tensor.to
        torch.Tensor.to = lambda self, *a, **k: (self if a and isinstance(a[0], str) and a[0].startswith("cuda")
                                                 else to(self, *a, **k))
        group = sglang_nccl._init_custom_process_group
        sglang_nccl._init_custom_process_group = lambda backend="nccl", **k: group(backend="gloo", **k)

        def post(u, json=None, **k):
            if u.endswith("/init_weights_update_group"):
                json = {**json, "backend": "gloo"}
            return requests.post(u, json=json, **k)

        sglang_nccl.requests = types.SimpleNamespace(post=post, get=requests.get, exceptions=requests.exceptions)
    dtype, device = (torch.float32, "cpu") if mode == "cpu" else (torch.bfloat16, "cuda:0")
    model = transformers.AutoModelForCausalLM.from_pretrained(path_b, dtype=dtype).to(device)
    scheme = SGLangWeightSyncScheme(server_url=url, master_address="127.0.0.1", num_gpus=1, strategy="state_dict",
                                    device=0)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.init_all_workers_group(get_model_metadata(model))
    out = []
    for step, path in enumerate((path_b, path_a)):
        if step:  # the trainer's next weights: the other checkpoint's, into the same registered model
            other = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            model.load_state_dict(other.state_dict())
        sender.update_weights()
        scores, version = [], None
        for ids in seqs:
            r = requests.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                       "logprob_start_len": 0}, timeout=60).json()
            scores.append([e[0] for e in r["meta_info"]["input_token_logprobs"][1:]])
            version = r["meta_info"]["weight_version"]
        out.append({"scores": scores, "weight_version": version,
                    "load": requests.get(url + "/get_load", timeout=60).json()})
    sender.shutdown()
    print(json.dumps(out))
''')

# the fresh reference on the GPU the server used (a child process: that GPU is its only one)
REFERENCE = textwrap.dedent('''
    import json, sys
    from logprobe import Scorer
    s = Scorer(sys.argv[1], device="cuda:0", dtype="bfloat16", progress=False, deterministic=True)
    out = s.logprobs([{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]} for ids in json.loads(sys.argv[2])])
    print(json.dumps([r.logprobs.tolist() for r in out]))
''')


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        d = tmp_path_factory.mktemp(f"torchrl-{name}")
        make_hf_dir(d, "llama", seed=seed)
        out[name] = d
    return out


def env_with_src(**extra) -> dict:
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def push_twice(mode: str, models, server_env: dict, trainer_env: dict) -> list[dict]:
    """Serve "a", let the trainer push "b" then "a" through torchrl's scheme; its JSON report."""
    port = free_port()
    device, dtype = ("cpu", "float32") if mode == "cpu" else ("cuda:0", "bfloat16")
    server = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(models["a"]),
                               "--device", device, "--dtype", dtype, "--deterministic", "--port", str(port),
                               "--log-level", "warning", "--quiet"], env=server_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(url, timeout=300)
        except RuntimeError:
            server.kill()
            raise RuntimeError("server did not start:\n" + server.communicate()[0][-4000:]) from None
        p = subprocess.run([sys.executable, "-c", TRAINER, mode, url, str(models["b"]), str(models["a"]),
                            json.dumps(SEQS)], env=trainer_env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def check(report: list[dict], want: dict[str, list[list[float]]]) -> None:
    assert want["a"] != want["b"]
    (b, a) = report
    assert b["weight_version"] == "1" and a["weight_version"] == "2", report
    assert b["scores"] == want["b"]  # bitwise: a fresh Scorer on the pushed weights
    assert a["scores"] == want["a"]
    for r in report:  # resumed after each push (the scheme paused the server around it), idle
        assert r["load"][0]["paused"] is False and r["load"][0]["num_running_reqs"] == 0, r["load"]


@pytest.mark.slow  # 11 s: a server process, torchrl's receiver and sender (the fast tier keeps its budget)
def test_torchrl_scheme_drives_the_server_over_gloo(models):
    want = {}
    for name in ("a", "b"):
        s = Scorer(str(models[name]), device="cpu", dtype="float32", progress=False, deterministic=True)
        want[name] = [r.logprobs.tolist() for r in s.logprobs(
            [{"prompt_token_ids": ids[:1], "completion_token_ids": ids[1:]} for ids in SEQS])]
        s.close()
    report = push_twice("cpu", models, env_with_src(), env_with_src())
    check(report, want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torchrl's SGLang scheme unchanged needs CUDA and NCCL: "
                                                          "2 CUDA devices (trainer on GPU 0, server on GPU 1)")
def test_torchrl_scheme_unchanged_over_nccl(models):
    nccl = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # what the scheme sets in the trainer
    report = push_twice("cuda", models, env_with_src(CUDA_VISIBLE_DEVICES="1", **nccl),
                        env_with_src(CUDA_VISIBLE_DEVICES="0"))
    want = {}
    for name in ("a", "b"):
        p = subprocess.run([sys.executable, "-c", REFERENCE, str(models[name]), json.dumps(SEQS)],
                           env=env_with_src(CUDA_VISIBLE_DEVICES="1"), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        want[name] = json.loads(p.stdout.strip().splitlines()[-1])
    check(report, want)

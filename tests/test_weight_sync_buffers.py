"""The collective weight sync on a model whose transformers form holds weights as buffers (GLM-4.5's
``mlp.gate.e_score_correction_bias``): a trainer broadcasting only ``named_parameters()`` in
buckets is applied once every parameter has come, the buffers kept (named in the reply's
``kept_buffers``); buffers that come in the round are taken, all of them (some of them: held for
the rest); a bucket of buffers alone sent after the one that completed the parameters is refused
after receipt, the group usable (``loading.collective``'s module docstring).

Checkpoint A is a tiny random GLM-4.5; B is A with the parameters drawn anew (the buffers A's: a
trainer's gradient step), C is B with the buffers drawn anew (aux-loss-free balancing).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import requests
import torch
from helpers import TRAINER_GROUP, random_sequences
from server_util import free_port, serve

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading.collective import WeightGroup, check_declared, covers
from logprobe.server import create_app

transformers = pytest.importorskip("transformers")
import test_moe_sigmoid_families  # noqa: E402
from test_update_trainer_names import _draw, _save  # noqa: E402

DET = EngineConfig(deterministic=True, progress=False)
BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint dirs a, b, c; A's parameters and buffers, B's (and C's) parameters, C's buffers:
    (name, tensor) lists as the trainer's ``named_parameters()`` / ``named_buffers()`` give them)."""
    root = tmp_path_factory.mktemp("glm_buffers")
    torch.manual_seed(0)
    model = test_moe_sigmoid_families.make_model("glm4_moe").float().eval()
    _draw(model.named_parameters(), 1)
    _draw(model.named_buffers(), 2)
    a = _save(model, root / "a")
    params_a = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    buffers_a = [(n, t.detach().clone()) for n, t in model.named_buffers() if n.endswith(BIAS)]
    _draw(model.named_parameters(), 3)
    b = _save(model, root / "b")
    params_b = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    with torch.no_grad():  # the biases far apart (routing changes): a kept bias shows in the scores
        gen = torch.Generator().manual_seed(4)
        for n, t in model.named_buffers():
            if n.endswith(BIAS):
                t.copy_(torch.randn(t.shape, generator=gen))
    c = _save(model, root / "c")
    buffers_c = [(n, t.detach().clone()) for n, t in model.named_buffers() if n.endswith(BIAS)]
    assert len(buffers_c) == 2  # blocks 1 and 2 (block 0 is dense)
    return a, b, c, params_a, buffers_a, params_b, buffers_c


def _scorer(path) -> Scorer:
    return Scorer(path, device="cpu", dtype="float32", config=DET)


def _meta(bucket) -> list:
    return [(n, t.dtype, tuple(t.shape)) for n, t in bucket]


def test_buckets_cover_by_parameters_buffers_all_or_none(glm):
    """``WeightGroup.collect`` (what each ``/update_weights_from_distributed`` runs after receipt),
    on the orders a trainer sends: parameters only (applied, the buffers kept); then the buffers
    alone (refused, naming them: they came after the parameters); buffers with parameters
    (taken); one buffer of two (held for the other); buffers alone opening a round after one
    that sent them (held for the parameters)."""
    a, _, _, _, _, params, buffers = glm
    model = _scorer(a).loaded.model
    half = len(params) // 2
    group = WeightGroup("g", process=None, rank=1, world_size=2, backend="gloo", device=torch.device("cpu"))
    slots = ["layers.1.mlp.e_score_correction_bias", "layers.2.mlp.e_score_correction_bias"]

    def send(bucket, version=None):
        return group.collect(bucket, check_declared(model, _meta(bucket), group.declared), version, model)

    assert send(params[:half]) == (None, None)
    held, version = send(params[half:], "p")  # every parameter: applied, the buffers kept
    assert version == "p" and len(held) == len(params) and group.kept == slots
    with pytest.raises(LogprobeError) as e:  # the buffers after the parameters: refused
        send(buffers)
    assert e.value.field == "names[0]" and buffers[0][0] in e.value.problem and "one update late" in e.value.problem
    assert "stays joined" in e.value.fix and group.held == [] and group.kept == []
    assert len(send(params)[0]) == len(params) and group.kept == slots  # the next step's parameters
    assert send(buffers + params[:half]) == (None, None)  # with a parameter: a round of its own
    held, _ = send(params[half:])
    assert len(held) == len(params) + 2 and group.kept == []
    assert send(buffers[:1] + params) == (None, None)  # one buffer of two: held for the other
    assert len(send(buffers[1:])[0]) == len(params) + 2
    assert send(buffers) == (None, None)  # the last round sent them: buffers first, held
    assert len(send(params)[0]) == len(params) + 2
    assert not covers(model, params[:-1]) and covers(model, params) and not covers(model, params + buffers[:1])


TRAINER = TRAINER_GROUP + textwrap.dedent('''
    import json, sys, threading
    from datetime import timedelta
    import requests
    import torch.distributed as dist
    from safetensors.torch import load_file

    port, url, plan = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])

    def update(bucket, tensors, version, out):
        body = {"names": bucket, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in bucket],
                "shapes": [list(tensors[n].shape) for n in bucket], "weight_version": version}
        r = requests.post(url + "/update_weights_from_distributed", json=body, timeout=120)
        out.append((r.status_code, r.json()))

    t = threading.Thread(target=requests.post, args=(url + "/init_weights_update_group",), kwargs=dict(json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "backend": "gloo"}, timeout=120))
    t.start()
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "weight_update_group",
                                   timedelta(seconds=60))
    t.join()
    for k, (path, buckets) in enumerate(plan):  # a round, its replies, then wait for the test's go
        tensors, replies = load_file(path), []
        for bucket in buckets:  # the request from a thread, the broadcasts from here
            t = threading.Thread(target=update, args=(bucket, tensors, f"step-{k}", replies))
            t.start()
            for name in bucket:
                dist.broadcast(tensors[name].contiguous(), src=0, group=pg)
            t.join()
        print(json.dumps(replies), flush=True)
        sys.stdin.readline()
    requests.post(url + "/destroy_weights_update_group", json={}, timeout=120)
    dist.destroy_process_group(pg)
''')


def _file(tmp_path, name, named) -> str:
    from safetensors.torch import save_file
    path = tmp_path / f"{name}.safetensors"
    save_file({n: t.contiguous() for n, t in named}, str(path))
    return str(path)


def _library_scores(scorer: Scorer, seqs) -> list[list[float]]:
    return [r.logprobs.tolist() for r in scorer.logprobs(
        [{"prompt_token_ids": s["input_ids"][:1], "completion_token_ids": s["input_ids"][1:]} for s in seqs])]


def test_server_takes_named_parameters_in_buckets(glm, tmp_path):
    """A gloo trainer process against the real server, on one group, served scores read after
    each step:
    1. B's ``named_parameters()`` in two buckets: held, then applied; ``kept_buffers`` names both
       biases; bitwise a fresh scorer of B (whose biases are A's, the served ones);
    2. B's parameters and C's buffers, the buffers in the first bucket: applied, nothing kept;
       bitwise a fresh scorer of C;
    3. A's parameters in one bucket: applied, the biases kept; bitwise C's scorer given A's
       parameters; then A's buffers in a bucket of their own: a 400 naming ``names[0]``,
       nothing changed;
    4. C's buffers and B's parameters again, buffers first: the group still works; bitwise C."""
    a, b, c, params_a, buffers_a, params_b, buffers_c = glm
    pa, pb = _file(tmp_path, "pa", params_a + buffers_a), _file(tmp_path, "pb", params_b)
    pc = _file(tmp_path, "pc", params_b + buffers_c)
    names, buf = [n for n, _ in params_b], [n for n, _ in buffers_c]
    half = len(names) // 2
    plan = [(pb, [names[:half], names[half:]]),
            (pc, [buf + names[:half], names[half:]]),
            (pa, [names]),
            (pa, [buf]),  # after the bucket that completed the parameters
            (pc, [buf + names[:half], names[half:]])]
    seqs = [{"input_ids": s["prompt_token_ids"] + s["completion_token_ids"], "return_logprob": True,
             "logprob_start_len": 0} for s in random_sequences(2, seed=5, max_prompt=16, max_completion=16)]
    mixed = _scorer(c)
    mixed.update_weights(params_a)
    assert mixed.kept_buffers == tuple(buf)
    want = {"b": _library_scores(_scorer(b), seqs), "c": _library_scores(_scorer(c), seqs),
            "c+pa": _library_scores(mixed, seqs)}
    assert want["b"] != want["c"] and want["c+pa"] not in (want["b"], want["c"])

    def served(url):
        return [[e[0] for e in requests.post(url + "/generate", json=s, timeout=60).json()["meta_info"][
            "input_token_logprobs"][1:]] for s in seqs]

    port = free_port()
    with serve(create_app(_scorer(a))) as url:
        p = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), url, json.dumps(plan)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            steps = []
            for _ in plan:
                line = p.stdout.readline()
                assert line, p.stderr.read()[-3000:]
                steps.append((json.loads(line), served(url)))
                p.stdin.write("go\n")
                p.stdin.flush()
            p.communicate(timeout=120)
        finally:
            p.kill()
    assert p.returncode == 0
    (held, applied), got = steps[0]
    assert held[0] == 200 and held[1]["kept_buffers"] == [] and "held" in held[1]["message"], held
    assert applied[0] == 200 and applied[1]["weights_version"] == 1, applied
    assert applied[1]["kept_buffers"] == buf and "2 buffers kept" in applied[1]["message"]
    assert got == want["b"]  # bitwise: the biases kept are A's, which B has
    (_, applied), got = steps[1]
    assert applied[0] == 200 and applied[1]["weights_version"] == 2 and applied[1]["kept_buffers"] == [], applied
    assert got == want["c"]
    ([applied], got), ([late], after) = steps[2], steps[3]
    assert applied[0] == 200 and applied[1]["weights_version"] == 3 and applied[1]["kept_buffers"] == buf
    assert late[0] == 400 and late[1]["success"] is False and late[1]["error"]["param"] == "names[0]", late
    assert "one update late" in late[1]["message"] and "stays joined" in late[1]["message"]
    assert got == after == want["c+pa"]  # the late buffers changed nothing
    (_, applied), got = steps[4]
    assert applied[0] == 200 and applied[1]["weights_version"] == 4 and applied[1]["kept_buffers"] == [], applied
    assert got == want["c"]

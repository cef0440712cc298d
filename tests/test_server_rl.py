"""The RL-framework endpoints on the real stack (uvicorn + the app, loopback), tiny random Llamas:
SGLang's ``/generate`` for scoring, vLLM's ``prompt_logprobs`` on ``/v1/completions``, SGLang's
``/update_weights_from_disk`` and ``weights_version``. Every number is checked against the float64
transformers model (``ref_logprobs``) and against the library (``Scorer.logprobs``: bitwise, both
deterministic)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from helpers import make_hf_dir, ref_logprobs
from server_util import serve

from logprobe import Scorer
from logprobe.engine.request import RequestResult, ScoreRequest
from logprobe.server import ServerConfig, create_app
from logprobe.server.batcher import Batcher

TOL = 1e-4  # float32 engine vs float64 reference
IDS = [5, 71, 72, 3, 140, 8, 200, 17, 9, 66, 250, 12]
IDS2 = [33, 34, 35, 36, 101]


def scorer(path, **kw) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"a", "b"}: (directory, float64 reference) of two tiny Llamas of one shape; "wide": another shape."""
    out = {}
    for name, kind, seed in (("a", "llama", 3), ("b", "llama", 4), ("wide", "llama256", 5)):
        d = tmp_path_factory.mktemp(f"rl-{name}")
        out[name] = (d, make_hf_dir(d, kind, seed=seed))
    return out


@pytest.fixture(scope="module")
def server(models):
    """A server on model "a" (its weights never change) and a library Scorer on the same files."""
    app = create_app(scorer(models["a"][0]), ServerConfig(max_top_logprobs=20, max_request_items=8))
    with serve(app) as url:
        yield url, scorer(models["a"][0])


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=120)


def library(lib: Scorer, ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """Log-probs of ids[start + 1:] (each after all the tokens before it) from Scorer.logprobs."""
    seq = {"prompt_token_ids": ids[:start + 1], "completion_token_ids": ids[start + 1:]}
    return lib.logprobs([seq], temperature=temperature)[0].logprobs.tolist()


def generate(url, ids, **kw) -> dict:
    r = post(url, "/generate", {"input_ids": ids, "return_logprob": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# -- /generate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_rl_groups_one_request_per_sample(models, pipeline):
    """Two RL groups (a prompt, four sampled responses) sent as eight concurrent ``/generate``
    requests, as a rollout worker sends samples: without pipelined steps (the default) and with,
    the prefix cache on, every answer is bitwise the library's (deterministic mode) and within
    1e-4 of float64; the steps' sizes are what the batcher chose, the numbers are not."""
    path, ref = models["a"]
    prompts = [IDS[:6], IDS2[:4]]
    samples = [(g, p + [40 + g * 10 + k, 41 + k, 42]) for g, p in enumerate(prompts) for k in range(4)]
    app = create_app(scorer(path, prefix_cache=True), ServerConfig(pipeline_steps=pipeline))
    lib = scorer(path)
    with serve(app) as url:
        start = threading.Barrier(len(samples))

        def send(sample):
            g, ids = sample
            start.wait()
            return generate(url, ids, logprob_start_len=len(prompts[g]) - 1)

        with ThreadPoolExecutor(len(samples)) as ex:
            replies = list(ex.map(send, samples))
    for (g, ids), reply in zip(samples, replies):
        got = [e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]]
        assert got == library(lib, ids, len(prompts[g]) - 1)
        lp, begin = ref_logprobs(ref, ids), len(prompts[g]) - 1
        assert len(got) == len(ids) - 1 - begin
        assert max(abs(got[j] - lp[begin + j, ids[begin + j + 1]].item()) for j in range(len(got))) < TOL

def test_generate_slime_request(server, models):
    """slime's on-policy distillation body, read as slime reads it: entries [1:], element 0."""
    url, lib = server
    body = {"input_ids": IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}
    out = post(url, "/generate", body).json()
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == IDS and entries[0] == [None, IDS[0], None]
    teacher = [e[0] for e in entries[1:]]
    ref = ref_logprobs(models["a"][1], IDS)  # temperature 0 is greedy in SGLang: the model's own log-probs
    assert teacher == library(lib, IDS, 0)
    for j in range(1, len(IDS)):
        assert abs(teacher[j - 1] - ref[j - 1, IDS[j]].item()) < TOL
    assert out["text"] == "" and out["output_ids"] == []
    assert meta["prompt_tokens"] == len(IDS) and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    assert "input_top_logprobs" not in meta
    assert out["weights_version"] == 0 and meta["weight_version"] == "0"


@pytest.mark.parametrize("start", [0, 1, 5, len(IDS) - 2])
def test_generate_logprob_start_len(server, start):
    """Entry j is token ids[start + j]; the first is null (SGLang pads it), the rest are scored."""
    url, lib = server
    entries = generate(url, IDS, logprob_start_len=start)["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(IDS) - start
    assert [e[1] for e in entries] == IDS[start:] and entries[0][0] is None
    assert [e[0] for e in entries[1:]] == library(lib, IDS, start)
    assert all(e[2] is None for e in entries)


def test_generate_default_start_is_last_token(server):
    url, _ = server
    out = post(url, "/generate", {"input_ids": IDS, "return_logprob": True}).json()
    assert out["meta_info"]["input_token_logprobs"] == [[None, IDS[-1], None]]
    out = post(url, "/generate", {"input_ids": IDS}).json()  # no return_logprob: nothing but the counts
    assert "input_token_logprobs" not in out["meta_info"] and out["meta_info"]["prompt_tokens"] == len(IDS)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5, 0.0, 1e-7])
def test_generate_temperature(server, models, temperature):
    """log_softmax(logits / T); T below 1e-6 is greedy in SGLang, which uses T = 1."""
    url, lib = server
    t = 1.0 if temperature < 1e-6 else temperature
    entries = generate(url, IDS, logprob_start_len=0, sampling_params={"temperature": temperature,
                                                                       "max_new_tokens": 0})
    got = [e[0] for e in entries["meta_info"]["input_token_logprobs"][1:]]
    assert got == library(lib, IDS, 0, t)
    ref = ref_logprobs(models["a"][1], IDS, t)
    assert max(abs(g - ref[j, IDS[j + 1]].item()) for j, g in enumerate(got)) < TOL


def test_generate_top_logprobs(server, models):
    url, _ = server
    start, n = 2, 4
    meta = generate(url, IDS, logprob_start_len=start, top_logprobs_num=n,
                    sampling_params={"temperature": 0.8})["meta_info"]
    ref = ref_logprobs(models["a"][1], IDS, 0.8)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(IDS) - start and tops[0] is None and meta["output_top_logprobs"] == []
    for j, top in enumerate(tops[1:], 1):  # entry j: token IDS[start + j], scored by row start + j - 1
        row = ref[start + j - 1]
        want = row.topk(n)
        assert [e[1] for e in top] == want.indices.tolist()
        assert max(abs(e[0] - v) for e, v in zip(top, want.values.tolist())) < TOL
        assert all(e[2] is None for e in top)
        tok = meta["input_token_logprobs"][j]
        assert tok[1] == IDS[start + j] and abs(tok[0] - row[tok[1]].item()) < TOL


def test_generate_text_and_batches(server):
    """A list is a batch (a list of replies, each equal to its single request); text is tokenized
    as SGLang does (this tokenizer adds no BOS); per-item lists of options."""
    url, lib = server
    single = [generate(url, ids, logprob_start_len=0, top_logprobs_num=2)["meta_info"] for ids in (IDS, IDS2)]
    batch = post(url, "/generate", {"input_ids": [IDS, IDS2], "return_logprob": True, "logprob_start_len": 0,
                                    "top_logprobs_num": 2}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for one, many in zip(single, batch):
        for key in ("input_token_logprobs", "input_top_logprobs", "prompt_tokens"):
            assert many["meta_info"][key] == one[key]
        assert many["weights_version"] == 0
    per_item = post(url, "/generate", {"input_ids": [IDS, IDS2], "return_logprob": [True, False],
                                       "logprob_start_len": [3, 0], "rid": ["x", "y"]}).json()
    assert [e[0] for e in per_item[0]["meta_info"]["input_token_logprobs"][1:]] == library(lib, IDS, 3)
    assert "input_token_logprobs" not in per_item[1]["meta_info"]
    assert [r["meta_info"]["id"] for r in per_item] == ["x", "y"]

    tok = lib.tokenizer
    texts = ["Hello, world", "RL!"]
    ids = [tok.encode(t) for t in texts]
    assert not tok.add_bos
    for body_text, many in ((texts[0], False), (texts, True)):
        out = post(url, "/generate", {"text": body_text, "return_logprob": True, "logprob_start_len": 0,
                                      "return_text_in_logprobs": True}).json()
        outs = out if many else [out]
        for o, want_ids in zip(outs, ids):
            entries = o["meta_info"]["input_token_logprobs"]
            assert [e[1] for e in entries] == want_ids
            assert [e[2] for e in entries] == tok.token_texts(want_ids)
            assert [e[0] for e in entries[1:]] == library(lib, want_ids, 0)


@pytest.mark.parametrize("body,param", [
    ({"input_ids": IDS, "sampling_params": {"max_new_tokens": 1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": IDS, "sampling_params": {"max_new_tokens": 16}}, "sampling_params.max_new_tokens"),
    ({"input_ids": IDS, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": IDS, "sampling_params": {"top_p": 0.9}}, "sampling_params.top_p"),
    ({"input_ids": IDS, "sampling_params": {"temprature": 1}}, "sampling_params.temprature"),
    ({"input_ids": IDS, "stream": True}, "stream"),
    ({"input_ids": IDS, "text": "hi"}, "input_ids"),
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"input_ids": [1, 300]}, "input_ids[1]"),
    ({"text": ""}, "text"),
    ({"input_ids": IDS, "return_logprob": True, "logprob_start_len": len(IDS)}, "logprob_start_len"),
    ({"input_ids": IDS, "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": IDS, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [IDS], "logprob_start_len": [0, 1]}, "logprob_start_len"),
    ({"input_ids": [IDS] * 9}, "input_ids"),
])
def test_generate_refusals(server, body, param):
    url, _ = server
    r = post(url, "/generate", body)
    assert r.status_code in (400, 413), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    if param == "sampling_params.temprature":
        assert "accepted fields: max_new_tokens, temperature" in err["message"]



def test_generate_out_of_memory_names_the_item(models):
    """An input that does not fit in memory even alone is a 413 naming it (the body's item, though
    item 0 needs no engine request); the engine's fault hook raises out of memory on passes over
    200 tokens."""
    served = scorer(models["a"][0], max_batch_tokens=512)

    def hook(rows: int, tokens: int) -> None:
        if tokens > 200:
            raise torch.OutOfMemoryError("injected")

    long = [5 + k % 250 for k in range(300)]
    with serve(create_app(served)) as url:
        served.engine.fault_hook = hook
        r = post(url, "/generate", {"input_ids": [IDS, IDS2, long], "return_logprob": [False, True, True],
                                    "logprob_start_len": 0})
        served.engine.fault_hook = None
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "input_ids[2]" and err["code"] == "out_of_memory"
    assert err["message"].startswith("input_ids[2]: 299 input tokens do not fit"), err

# -- prompt_logprobs (vLLM) ----------------------------------------------------------------------

def ranks_between(row: torch.Tensor, value: float) -> range:
    """Ranks (1-based, vLLM's) a float32 computation may give a token of log-prob ``value`` in ``row``:
    1 + the tokens above it, counted with a margin for float32 rounding."""
    return range(int((row > value + TOL).sum()) + 1, int((row > value - TOL).sum()) + 2)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs(server, models, k):
    url, lib = server
    r = post(url, "/v1/completions", {"prompt": IDS, "max_tokens": 0, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    out = r.json()
    pl = out["choices"][0]["prompt_logprobs"]
    assert out["weights_version"] == 0 and out["choices"][0]["logprobs"] is None
    ref = ref_logprobs(models["a"][1], IDS)
    lib_lps = library(lib, IDS, 0)
    names = lib.tokenizer.token_texts
    assert len(pl) == len(IDS) and pl[0] is None
    for j in range(1, len(IDS)):
        entry, row, t = pl[j], ref[j - 1], IDS[j]
        keys = list(entry)
        assert keys[0] == str(t)  # the prompt token first, then the k most likely
        assert entry[str(t)]["logprob"] == lib_lps[j - 1]
        assert entry[str(t)]["decoded_token"] == names([t])[0]
        assert entry[str(t)]["rank"] in ranks_between(row, row[t].item())
        want = row.topk(k)
        assert set(keys) == {str(t)} | {str(i) for i in want.indices.tolist()}
        for rank, (i, v) in enumerate(zip(want.indices.tolist(), want.values.tolist()), 1):
            e = entry[str(i)]
            assert abs(e["logprob"] - v) < TOL and e["decoded_token"] == names([i])[0]
            assert e["rank"] == rank or i == t


def test_prompt_logprobs_with_echo_and_generation(server):
    """Beside echo's logprobs and one greedy token: the same numbers, prompt tokens only."""
    url, _ = server
    out = post(url, "/v1/completions", {"prompt": [IDS, IDS2], "max_tokens": 1, "echo": True, "logprobs": 2,
                                        "prompt_logprobs": 1}).json()
    for choice, ids in zip(out["choices"], (IDS, IDS2)):
        pl, lp = choice["prompt_logprobs"], choice["logprobs"]
        assert len(pl) == len(ids) and len(lp["token_logprobs"]) == len(ids) + 1
        assert [None] + [pl[j][str(ids[j])]["logprob"] for j in range(1, len(ids))] == lp["token_logprobs"][:-1]
    r = post(url, "/v1/completions", {"prompt": IDS, "max_tokens": 0, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    one = post(url, "/v1/completions", {"prompt": [7], "max_tokens": 0, "prompt_logprobs": 2}).json()
    assert one["choices"][0]["prompt_logprobs"] == [None]


def test_weights_version_everywhere(server):
    url, _ = server
    assert requests.get(url + "/health", timeout=30).json()["weights_version"] == 0
    for path, body in (("/v1/score", {"prompt": "a", "continuations": ["b"]}),
                       ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5], "completion_token_ids": [6]}]}),
                       ("/v1/perplexity", {"texts": "hello world"}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        r = post(url, path, body)
        assert r.status_code == 200 and r.json()["weights_version"] == 0, (path, r.text)


# -- the batcher's exclusive section (what a weight swap runs in) -----------------------------------

def test_exclusive_waits_for_started_jobs_and_holds_new_ones():
    """Job A (3 requests, one per step) has started when exclusive(fn) is called: A's later steps
    still run before fn; job B, queued meanwhile, starts only after fn, under fn's tag."""
    log: list = []
    step = threading.Semaphore(0)

    def engine(reqs: list[ScoreRequest], cancelled=None) -> list[RequestResult]:
        step.acquire(timeout=10)
        log.extend(r.tokens[0] for r in reqs)
        return [RequestResult(torch.zeros(r.num_scored), torch.zeros(r.num_scored, dtype=torch.long)) for r in reqs]

    b = Batcher(engine, max_batch_tokens=2, max_queue_requests=10, max_queue_tokens=1000)
    b.tag = 0

    async def main():
        b.start()
        a = asyncio.ensure_future(b.submit_tagged([ScoreRequest([10 + i, 0, 0], 1) for i in range(3)]))
        await asyncio.sleep(0.05)
        step.release()  # a0 runs
        await asyncio.sleep(0.05)
        swap = asyncio.ensure_future(asyncio.to_thread(b.exclusive, lambda: log.append("swap") or 1))
        await asyncio.sleep(0.05)
        bjob = asyncio.ensure_future(b.submit_tagged([ScoreRequest([20, 0, 0], 1)]))
        for _ in range(3):
            await asyncio.sleep(0.05)
            step.release()
        out = await asyncio.gather(a, swap, bjob)
        b.close()
        return out

    (_, tag_a), version, (_, tag_b) = asyncio.run(main())
    assert log == [10, 11, 12, "swap", 20]
    assert (tag_a, version, tag_b) == (0, 1, 1)


# -- /update_weights_from_disk -------------------------------------------------------------------

@pytest.fixture(scope="module")
def updatable(models):
    """A server whose weights the tests replace; small engine steps, so that one request of many
    sequences spans several of them."""
    app = create_app(scorer(models["a"][0], max_batch_tokens=64), ServerConfig(max_request_items=64))
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def libraries(models):
    return {name: scorer(models[name][0]) for name in ("a", "b")}


def update(url, path) -> requests.Response:
    return post(url, "/update_weights_from_disk", {"model_path": str(path)})


def health_version(url) -> int:
    return requests.get(url + "/health", timeout=30).json()["weights_version"]


def test_update_weights_from_disk(updatable, models, libraries, tmp_path):
    url = updatable
    v0 = health_version(url)
    before = generate(url, IDS, logprob_start_len=0)
    assert before["weights_version"] == v0
    assert [e[0] for e in before["meta_info"]["input_token_logprobs"][1:]] == library(libraries["a"], IDS, 0)

    r = update(url, models["b"][0])
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weights_version"] == v0 + 1 and health_version(url) == v0 + 1
    after = generate(url, IDS, logprob_start_len=0)
    got = [e[0] for e in after["meta_info"]["input_token_logprobs"][1:]]
    assert after["weights_version"] == v0 + 1 and after["meta_info"]["weight_version"] == str(v0 + 1)
    assert got == library(libraries["b"], IDS, 0)  # a fresh Scorer on the new weights, bitwise
    ref = ref_logprobs(models["b"][1], IDS)
    assert max(abs(g - ref[j, IDS[j + 1]].item()) for j, g in enumerate(got)) < TOL

    # what cannot be loaded changes nothing: a missing path, another architecture's shapes, a broken file
    broken = tmp_path / "broken"
    shutil.copytree(models["b"][0], broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for path in (tmp_path / "missing", models["wide"][0], broken):
        r = update(url, path)
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["error"]["param"] == "model_path" and body["error"]["message"].startswith("model_path")
        assert body["success"] is False
        assert health_version(url) == v0 + 1
        again = generate(url, IDS, logprob_start_len=0)
        assert [e[0] for e in again["meta_info"]["input_token_logprobs"][1:]] == got
        assert again["weights_version"] == v0 + 1

    r = update(url, models["a"][0])  # and back
    assert r.status_code == 200 and r.json()["weights_version"] == v0 + 2
    back = generate(url, IDS, logprob_start_len=0)
    assert [e[0] for e in back["meta_info"]["input_token_logprobs"][1:]] == library(libraries["a"], IDS, 0)


def test_update_never_mixes_weights_in_one_request(updatable, models, libraries):
    """Clients keep sending 12-sequence requests (several engine steps each) while the weights
    flip between a and b: every reply equals, bitwise, the library on the weights its
    weights_version names, for all of its sequences."""
    from helpers import random_sequences

    url = updatable
    seqs = random_sequences(12, seed=1, max_prompt=20, max_completion=30)
    want = {name: [r.logprobs.tolist() for r in lib.logprobs(seqs)] for name, lib in libraries.items()}
    r = update(url, models["a"][0])
    assert r.status_code == 200
    loaded = {r.json()["weights_version"]: "a"}  # version -> weights
    stop = threading.Event()

    def client() -> list[tuple[int, list]]:
        out = []
        while not stop.is_set() or not out:
            reply = post(url, "/v1/logprobs", {"sequences": seqs}).json()
            out.append((reply["weights_version"], [x["logprobs"] for x in reply["results"]]))
        return out

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(client) for _ in range(4)]
        for name in ("b", "a", "b", "a"):
            r = update(url, models[name][0])
            assert r.status_code == 200, r.text
            loaded[r.json()["weights_version"]] = name
        stop.set()
        replies = [x for f in futures for x in f.result()]
    versions = {v for v, _ in replies}
    assert len(versions) >= 2, versions  # the swaps happened while clients were being answered
    for version, lps in replies:
        assert lps == want[loaded[version]], version

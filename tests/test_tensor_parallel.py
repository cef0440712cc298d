"""Tensor and data parallelism on CPU: worker processes over gloo, owned by the library.

TP = 2 and 4 against TP = 1 on tiny Llama (GQA: 2 kv heads, replicated at TP = 4), Qwen2 (qkv bias,
tied embeddings), Qwen3 (q/k norm, head_dim 32 != hidden / heads) and Mistral (sliding window):
<= 1e-5 in default mode, raw bits equal in deterministic mode (log-probs, entropy, ranks, top-k),
<= 1e-4 against float64 transformers. Then shard-by-shard loading, prefix sharing / chunking /
hooks under TP, data-parallel replicas, and the errors (sizes that do not split the model, a
GGUF block cut, a worker killed mid-run).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from helpers import make_hf_dir, random_sequences, ref_logprobs, skip_old_interpreter, write_tiny_gguf

from logprobe import Scorer
from logprobe.config import Deterministic, EngineConfig
from logprobe.errors import LogprobeError

OPTS = dict(temperature=0.7, top_k=5, entropy=True)
FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")


def _set_mode(scorer: Scorer, deterministic: bool) -> None:
    scorer.config = EngineConfig(deterministic=deterministic)


def _sequences():
    seqs = random_sequences(6, seed=3)
    shared = [7] * 20  # two completions of one prompt: a shared prefix tree under TP too
    seqs += [{"prompt_token_ids": shared, "completion_token_ids": [9, 10, 11]},
             {"prompt_token_ids": shared, "completion_token_ids": [12, 13]}]
    return seqs


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {k: (root / k, make_hf_dir(root / k, k)) for k in ("llama", "qwen2", "qwen3", "mistral")}


def _bits_equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return len(a) == len(b) and all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


def _max_diff(a, b) -> float:
    return max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kind, sizes", [pytest.param("llama", (2, 4), marks=pytest.mark.slow),
                                         pytest.param("qwen2", (2, 4), marks=pytest.mark.slow),
                                         pytest.param("qwen3", (2, 4), marks=pytest.mark.slow), ("mistral", (2,))])
def test_tp_equals_tp1(kind, sizes, hf_models, capfd):
    path, ref_model = hf_models[kind]
    seqs = _sequences()
    one = Scorer(str(path), device="cpu")
    want = {}
    for det in (False, True):
        _set_mode(one, det)
        want[det] = one.logprobs(seqs, **OPTS)
    for seq, got in zip(seqs, want[False]):  # TP = 1 itself against float64
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        ref = ref_logprobs(ref_model, ids, OPTS["temperature"])
        n = len(seq["prompt_token_ids"])
        exact = ref[torch.arange(n - 1, len(ids) - 1), torch.tensor(ids[n:])]
        assert (got.logprobs.double() - exact).abs().max() < 1e-4
    for tp in sizes:
        with Scorer(str(path), device="cpu", tensor_parallel_size=tp) as s:
            for det in (False, True):
                _set_mode(s, det)
                got = s.logprobs(seqs, **OPTS)
                for seq, g in zip(seqs, got):  # each TP size against float64 on its own
                    ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
                    n = len(seq["prompt_token_ids"])
                    ref = ref_logprobs(ref_model, ids, OPTS["temperature"])
                    assert (g.logprobs.double() - ref[torch.arange(n - 1, len(ids) - 1), torch.tensor(ids[n:])]
                            ).abs().max() < 1e-4
                if det:
                    assert _bits_equal(got, want[det]), (kind, tp)
                else:
                    assert _max_diff(got, want[det]) <= 1e-5, (kind, tp)
                    for x, y in zip(got, want[det]):
                        assert (x.entropy - y.entropy).abs().max() <= 1e-5
                        assert torch.equal(x.topk_ids, y.topk_ids)
    # the workers write to this process's stderr: their start-up (runpy warned of a module run
    # twice when they were started with -m) says nothing
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.slow  # slow tier (pytest -m slow): worker processes, several configurations
def test_tp_engine_features_and_data_parallel(hf_models):
    """Chunked long sequences, prefix sharing, capture and steering under TP = 2 (deterministic:
    bitwise equal to TP = 1), and 2 data-parallel replicas of TP = 2 equal to one scorer."""
    path, _ = hf_models["llama"]
    long = {"prompt_token_ids": list(range(2, 250)), "completion_token_ids": list(range(40, 140))}
    seqs = _sequences() + [long]
    hooks = dict(capture=[{"at": "blocks.1.resid_post", "positions": "last"}],
                 steer=[{"at": "blocks.0.resid_post", "vector": [0.5] * 64, "coeff": 2.0}])
    one = Scorer(str(path), device="cpu", deterministic=True, max_batch_tokens=96)
    want = one.logprobs(seqs, **OPTS)
    want_hooks = one.logprobs(seqs[:3], **hooks)
    with Scorer(str(path), device="cpu", deterministic=True, max_batch_tokens=96, tensor_parallel_size=2,
                data_parallel_size=2) as s:
        assert s.engine.dp == 2 and len(s.engine.groups) == 2
        got = s.logprobs(seqs, **OPTS)
        assert _bits_equal(got, want)
        got_hooks = s.logprobs(seqs[:3], **hooks)
        assert _bits_equal(got_hooks, want_hooks)
        for x, y in zip(got_hooks, want_hooks):
            assert x.captures[0].value.shape[-1] == 64 and torch.equal(x.captures[0].value, y.captures[0].value)
        ppl = s.perplexity("The quick brown fox jumps over the lazy dog. " * 8, context_length=64, stride=16)
        assert ppl.perplexity == one.perplexity("The quick brown fox jumps over the lazy dog. " * 8,
                                                context_length=64, stride=16).perplexity


@pytest.mark.slow  # slow tier (pytest -m slow): measures each rank's memory while loading
def test_shard_loading_holds_only_the_rank_share(tmp_path):
    """Each rank reads and keeps only its slices: its parameter bytes, and the peak growth of its
    anonymous resident memory while loading (sampled every 2 ms; a whole float32 checkpoint can
    stay memory-mapped, so the whole model's own peak is no yardstick: its byte count is). Each
    worker then freezes its heap (``workers.freeze_heap``): its modules out of the collector's scans."""
    import transformers as tf
    from helpers import byte_tokenizer

    from logprobe.executor.engine import ParallelEngine

    cfg = tf.Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    byte_tokenizer()[0].save_pretrained(str(tmp_path))
    whole = ParallelEngine(str(tmp_path), "cpu", "float32", EngineConfig(), tp=1, dp=1)
    full_bytes = whole.groups[0].param_bytes[0]
    whole.close()
    split = ParallelEngine(str(tmp_path), "cpu", "float32", EngineConfig(), tp=2, dp=1)
    per_rank, peaks = split.groups[0].param_bytes, split.groups[0].load_peak_bytes
    frozen = split.groups[0].frozen  # each worker's loaded heap left out of garbage collection
    split.close()
    assert all(f > 10_000 for f in frozen), frozen
    assert full_bytes > 250e6
    assert all(b < 0.51 * full_bytes for b in per_rank), (per_rank, full_bytes)  # only norms are replicated
    assert all(0 < p < 0.55 * full_bytes for p in peaks), (peaks, full_bytes)


@pytest.mark.slow  # slow tier (pytest -m slow): TP = 2 and 4 of a GGUF file
def test_gguf_tp_reads_whole_blocks(tmp_path, hf_models):
    """Every split is by rows, so TP = 4 reads o_proj (64 inputs, 32-weight Q8_0 blocks) in whole
    blocks too: a Megatron split by inputs would cut them in 16-wide pieces."""
    _, ref_model = hf_models["llama"]
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, ref_model.float(), "Q8_0")
    seqs = _sequences()[:4]
    want = Scorer(str(gguf), device="cpu", deterministic=True).logprobs(seqs)
    for tp in (2, 4):
        with Scorer(str(gguf), device="cpu", deterministic=True, tensor_parallel_size=tp) as s:
            assert _bits_equal(s.logprobs(seqs), want), tp


def test_tp_size_errors(hf_models):
    path, _ = hf_models["llama"]
    before = _children()
    with pytest.raises(LogprobeError, match="does not divide the 4 attention heads"):
        Scorer(str(path), device="cpu", tensor_parallel_size=3)
    with pytest.raises(LogprobeError, match="positive integer"):
        Scorer(str(path), device="cpu", tensor_parallel_size=0)
    with pytest.raises(LogprobeError, match="default model|heads"):
        Scorer(None, device="cpu", tensor_parallel_size=2)  # SmolLM2: 9 heads
    with pytest.raises(LogprobeError, match="model"):
        Scorer(str(path / "missing"), device="cpu", tensor_parallel_size=2)
    assert _children() <= before  # the workers launched before the model was read are gone


@pytest.mark.slow  # slow tier (pytest -m slow): worker processes
def test_workers_start_while_the_driver_reads_the_model(hf_models, monkeypatch):
    """The ranks' processes exist (importing torch and the package) before the driver reads the
    model's config and tokenizer, so the two run side by side instead of one after the other."""
    import logprobe.executor.engine as ex

    path, _ = hf_models["llama"]
    before, seen = _children(), []
    real = ex.describe_model

    def describe(*a, **k):
        seen.append(len(_children() - before))
        return real(*a, **k)

    monkeypatch.setattr(ex, "describe_model", describe)
    with Scorer(str(path), device="cpu", tensor_parallel_size=2, data_parallel_size=2) as s:
        assert s.logprobs([{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}])[0].logprobs.shape == (2,)
    assert seen == [4]
    assert _children() <= before


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo workers, ~3.5 s
def test_worker_ranks_read_no_tokenizer(hf_models, monkeypatch, tmp_path):
    """A rank has no text to read: its load reads no tokenizer (reading one imports much of
    transformers, seconds of a worker's start on a GPU host). The tokenizer's files are taken
    away once the driver has read them: the ranks still load."""
    import shutil

    import logprobe.executor.engine as ex

    path = tmp_path / "model"
    shutil.copytree(hf_models["llama"][0], path)
    real = ex.describe_model

    def describe(*a, **k):
        loaded = real(*a, **k)
        for f in path.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                f.unlink()
        return loaded

    monkeypatch.setattr(ex, "describe_model", describe)
    with Scorer(str(path), device="cpu", tensor_parallel_size=2) as s:
        assert s.logprobs([{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}])[0].logprobs.shape == (2,)
    assert not any(f.name.startswith("tokenizer") for f in path.iterdir())


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo workers, ~3.5 s
def test_worker_ranks_import_no_transformers(hf_models, monkeypatch, tmp_path):
    """A rank imports no transformers (2-10 s on a GPU host; native models, the only ones split,
    need none): a ``transformers`` package first on the workers' path marks a file when imported."""
    blocker = tmp_path / "blocker" / "transformers"
    blocker.mkdir(parents=True)
    mark = tmp_path / "imported"
    (blocker / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\nraise ImportError('not in a rank')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")]))
    with Scorer(str(hf_models["llama"][0]), device="cpu", tensor_parallel_size=2) as s:
        assert s.logprobs([{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}])[0].logprobs.shape == (2,)
    assert not mark.exists()


def _children() -> set[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


@pytest.mark.slow  # slow tier (pytest -m slow): kills a worker process
def test_worker_killed_mid_run_is_an_error_naming_the_rank(hf_models):
    path, _ = hf_models["llama"]
    before = _children()
    s = Scorer(str(path), device="cpu", tensor_parallel_size=2, max_batch_tokens=16)
    victim = s.engine.groups[0].procs[1]
    seqs = [{"prompt_token_ids": list(range(2, 200)), "completion_token_ids": list(range(2, 200))}] * 30
    threading.Timer(1.5, lambda: os.kill(victim.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(LogprobeError, match=r"worker rank 1 of replica 0 died \(signal 9"):
        s.logprobs(seqs)
    assert time.monotonic() - t0 < 60  # no hang
    with pytest.raises(LogprobeError, match="has died"):
        s.logprobs(seqs[:1])
    s.close()
    assert _children() <= before  # no process left behind (reaped: no zombies)


@pytest.mark.slow  # slow tier (pytest -m slow): a real server with workers
def test_serve_with_tensor_parallelism_matches_the_library(hf_models):
    """``logprobe serve --tensor-parallel-size 2 --deterministic`` (a real process, real HTTP):
    /v1/logprobs equals the library at TP = 1, bitwise (JSON floats round-trip float32 exactly)."""
    import subprocess
    import sys

    import requests
    from server_util import free_port, wait_http

    path, _ = hf_models["llama"]
    seqs = _sequences()[:4]
    want = Scorer(str(path), device="cpu", deterministic=True).logprobs(seqs, temperature=0.7)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(path), "--device",
                             "cpu", "--port", str(port), "--deterministic", "--tensor-parallel-size", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(f"http://127.0.0.1:{port}", timeout=180)
        r = requests.post(f"http://127.0.0.1:{port}/v1/logprobs", json={"sequences": seqs, "temperature": 0.7},
                          timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["results"]
        for g, w in zip(got, want):
            assert torch.equal(torch.tensor(g["logprobs"], dtype=torch.float32), w.logprobs)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow  # slow tier (pytest -m slow): worker processes
def test_deterministic_without_tp_invariance_is_batch_invariant(hf_models):
    """``tp_invariant=False``: one product per rank (the old cost), still bitwise batch-invariant at
    the TP size in use: requests alone equal them among others."""
    path, _ = hf_models["qwen3"]
    seqs = _sequences()
    cfg = EngineConfig(deterministic=Deterministic(tp_invariant=False), max_batch_tokens=64)
    with Scorer(str(path), device="cpu", config=cfg, tensor_parallel_size=2) as s:
        together = s.logprobs(seqs, **OPTS)
        alone = [s.logprobs([q], **OPTS)[0] for q in seqs[:3]]
    assert _bits_equal(alone, together[:3])


TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from logprobe import Scorer
s = Scorer(sys.argv[1], device="cpu", deterministic=True, tensor_parallel_size=dist.get_world_size())
seqs = [{"prompt_token_ids": [5, 6, 7, 8], "completion_token_ids": [9, 10, 11]}]
out = s.logprobs(seqs)[0].logprobs
torch.save(out, sys.argv[2] + f"/rank{dist.get_rank()}.pt")
s.close()  # before the group goes: a shard left to the interpreter's exit may outlive it
dist.destroy_process_group()
# skip C++ teardown, as HEAD_SCRIPT does: under load a thread destroyed at interpreter exit (after
# this point, the numbers saved) aborted a rank ("terminate called without an active exception")
os._exit(0)
"""


def _torchrun(tmp_path, script: str, *args: str, env: dict | None = None):
    """``script`` on two gloo ranks under ``torch.distributed.run``: the CompletedProcess."""
    import subprocess
    import sys

    from server_util import free_port

    path = tmp_path / "run.py"
    path.write_text(script)
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(path), *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow  # slow tier (pytest -m slow): torchrun
def test_under_torchrun_every_rank_is_one_shard(hf_models, tmp_path):
    """An already initialised process group (torchrun): each process holds one shard and every rank
    returns the same numbers, bitwise equal to TP = 1."""
    path, _ = hf_models["llama"]
    r = _torchrun(tmp_path, TORCHRUN_SCRIPT, str(path), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    want = Scorer(str(path), device="cpu", deterministic=True).logprobs(
        [{"prompt_token_ids": [5, 6, 7, 8], "completion_token_ids": [9, 10, 11]}])[0].logprobs
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), want)


HEAD_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from logprobe.kernels.logprob_head import fused_head_partials
from logprobe.parallel.context import ParallelContext
from logprobe.parallel.shard import vocab_chunk_width, vocab_shard
from logprobe.layers.logprob_head import HeadParams, logprob_head
rank, V, H, N = dist.get_rank(), 1000, 32, 6
g = torch.Generator().manual_seed(0)
w, h = torch.randn(V, H, generator=g), torch.randn(N, H, generator=g)
y = torch.randint(0, V, (N,), generator=g)
v0, v1 = vocab_shard(V, vocab_chunk_width(V), rank, 2)
p = HeadParams(w[v0:v1].contiguous(), vocab_start=v0, vocab_total=V, comm=ParallelContext(rank, 2, dist.group.WORLD))
t = torch.full((N,), 0.7)
splits = fused_head_partials(h, p.weight, y - v0, torch.zeros(N), 1 / t)[0].shape[0]
out = logprob_head(h, p, y, 0.7, top_k=3, entropy=True, backend="triton")
gathered, plain = [], ParallelContext.all_gather
def traced(self, x):
    gathered.append((x.dtype, tuple(x.shape)))
    return plain(self, x)
ParallelContext.all_gather = traced  # the second call: every rank's split count known on the host
again = logprob_head(h, p, y, 0.7, top_k=3, entropy=True, backend="triton")
known, gathered = gathered, []
wide = logprob_head(h, p, y, 0.7, top_k=30, backend="triton")  # may fall back on one rank: asks
torch.save(dict(splits=splits, lp=out.logprobs, ent=out.entropy, ids=out.topk_ids, h=h, w=w, y=y,
                again=again.logprobs, known=known, asked=gathered, wide=wide.logprobs, shard=v1 - v0),
           sys.argv[1] + f"/rank{rank}.pt")
dist.destroy_process_group()
# skip C++ teardown: under load a thread destroyed at interpreter exit (seen after this point,
# work saved) aborted the process ("terminate called without an active exception")
os._exit(0)
"""


@pytest.mark.slow  # two torchrun ranks under the interpreter (6 s): the fast tier stays within 4 minutes
def test_vocab_parallel_kernel_head_in_default_mode(tmp_path):
    """The fused head kernel on vocabulary shards in default mode (Triton's CPU interpreter, two
    gloo ranks): each rank splits its shard into several partials to fill the device, and every
    one of them reaches the combine. Until the counts were exchanged, only each rank's first split
    was kept, and TP = 2 on two H200s gave log-probs up to 1.1 nats off (a random bf16 Llama)."""
    skip_old_interpreter()
    r = _torchrun(tmp_path, HEAD_SCRIPT, str(tmp_path), env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = [torch.load(tmp_path / f"rank{k}.pt") for k in (0, 1)]
    assert min(g["splits"] for g in got) > 1  # what made the bug: more than one partial per rank
    z = (got[0]["h"].double() @ got[0]["w"].double().T) / 0.7  # [N, V] float64 reference
    logp = torch.log_softmax(z, -1)
    want = logp.gather(1, got[0]["y"][:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    assert got[0]["shard"] != got[1]["shard"]  # uneven shards: the counts differ by rank
    for g in got:
        assert torch.equal(g["again"], g["lp"])
        torch.testing.assert_close(g["wide"].double(), want, rtol=0, atol=1e-4)
        # the partials' gathers alone (6 of them, [S, N(, K)]); no [1]-long count exchange, which
        # waits for the GPU; a top-k past ALWAYS_LAUNCHES_TOP_K asks (a fallback is per rank)
        assert len(g["known"]) == 6 and all(len(shape) >= 2 for _, shape in g["known"]), g["known"]
        assert (torch.int64, (1,)) in g["asked"]
        torch.testing.assert_close(g["lp"].double(), want, rtol=0, atol=1e-4)
        torch.testing.assert_close(g["ent"].double(), ent, rtol=0, atol=1e-4)
        assert torch.equal(g["ids"], logp.topk(3, -1).indices)


def test_more_ranks_than_gpus_is_an_error(hf_models, monkeypatch):
    """Checked before any process starts (CUDA is faked: the check reads only the device count)."""
    path, _ = hf_models["llama"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LogprobeError, match=r"2 x 1 ranks need 2 GPUs, this machine has 1"):
        Scorer(str(path), device="cuda", tensor_parallel_size=2)
    with pytest.raises(LogprobeError, match=r"2 x 2 ranks need 4 GPUs"):
        Scorer(str(path), device="cuda", tensor_parallel_size=2, data_parallel_size=2)


@pytest.mark.slow  # slow tier (pytest -m slow): the CLI with worker processes
def test_cli_logprobs_with_tensor_parallelism(hf_models, tmp_path):
    """``logprobe logprobs --tensor-parallel-size 2 --deterministic`` (a real process): the JSONL lines
    equal the library at TP = 1, bitwise."""
    import json
    import subprocess
    import sys

    path, _ = hf_models["llama"]
    seqs = _sequences()[:4]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(s) + "\n" for s in seqs))
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "logprobe.cli.main", "logprobs", "--model", str(path), "--device", "cpu",
                        "--deterministic", "--tensor-parallel-size", "2", "--input", str(src), "--output", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = Scorer(str(path), device="cpu", deterministic=True).logprobs(seqs)
    lines = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda d: d["index"])
    assert len(lines) == len(seqs)
    for line, w in zip(lines, want):
        assert torch.equal(torch.tensor(line["logprobs"], dtype=torch.float32), w.logprobs)


@pytest.mark.slow  # slow tier (pytest -m slow): three worker processes started and stopped
def test_deterministic_tp_size_refused_when_the_scorer_starts(tmp_path):
    """6 query heads over 3 kv heads (hidden 48, intermediate 96): TP = 3 splits them, but
    deterministic mode's column blocks are 2 (the largest power of two dividing every width), so
    a deterministic Scorer at TP = 3 is refused when it starts, naming the field, and its workers
    are gone; a server started so fails at its start, not at its first request. Default mode at
    TP = 3 starts and scores."""
    import transformers as tf
    from helpers import byte_tokenizer

    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    byte_tokenizer()[0].save_pretrained(str(tmp_path))
    before = _children()
    with pytest.raises(LogprobeError, match="2 column blocks; 3 does not") as e:
        Scorer(str(tmp_path), device="cpu", tensor_parallel_size=3, deterministic=True, progress=False)
    assert e.value.field == "tensor_parallel_size"
    assert _children() <= before
    with Scorer(str(tmp_path), device="cpu", tensor_parallel_size=3, progress=False) as s:
        assert s.logprobs([{"prompt_token_ids": [3, 4], "completion_token_ids": [5]}])[0].logprobs.shape == (1,)

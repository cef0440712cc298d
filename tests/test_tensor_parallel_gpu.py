"""Tensor parallelism on two GPUs (NCCL): skipped unless CUDA sees at least two devices.

A Llama of 8 heads (2 kv heads: replicated at TP = 4... here TP = 2) in bf16: TP = 2 against
TP = 1 within bf16 noise in default mode and bitwise in deterministic mode (log-probs, entropy,
ranks, top-k), data-parallel replicas bitwise equal in deterministic mode, and
``logprobe serve --tensor-parallel-size 2`` answering /v1/logprobs with the library's bits."""

from __future__ import annotations

import pytest
import torch
from helpers import random_sequences

from logprobe import Scorer
from logprobe.config import EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]
FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers as tf
    from helpers import byte_tokenizer

    path = tmp_path_factory.mktemp("tpgpu") / "llama"
    cfg = tf.LlamaConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.02, bos_token_id=1, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return path


def _mode(s: Scorer, det: bool) -> None:
    s.config = EngineConfig(deterministic=det)  # max_batch_tokens None: the budget chosen at start


def _equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


def test_tp2_and_dp2_on_two_gpus(model_dir):
    seqs = random_sequences(16, seed=5, vocab=32768, max_prompt=600, max_completion=900)
    opts = dict(temperature=0.7, top_k=5, entropy=True)
    one = Scorer(str(model_dir), device="cuda")
    want = {}
    for det in (False, True):
        _mode(one, det)
        want[det] = one.logprobs(seqs, **opts)
    for kw in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
        with Scorer(str(model_dir), device="cuda", **kw) as s:
            for det in (False, True):
                _mode(s, det)
                got = s.logprobs(seqs, **opts)
                if det:
                    assert _equal(got, want[True]), kw
                else:
                    diff = max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(got, want[False]))
                    assert diff < 0.25, (kw, diff)  # bf16 activations: rounding of a different sum order


def test_serve_tp2_bitwise(model_dir):
    import subprocess
    import sys

    import requests
    from server_util import free_port, wait_http

    seqs = random_sequences(4, seed=6, vocab=32768)
    want = Scorer(str(model_dir), device="cuda", deterministic=True).logprobs(seqs)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(model_dir),
                             "--port", str(port), "--deterministic", "--tensor-parallel-size", "2"])
    try:
        wait_http(f"http://127.0.0.1:{port}", timeout=300)
        r = requests.post(f"http://127.0.0.1:{port}/v1/logprobs", json={"sequences": seqs}, timeout=300)
        assert r.status_code == 200, r.text
        for g, w in zip(r.json()["results"], want):
            assert torch.equal(torch.tensor(g["logprobs"], dtype=torch.float32), w.logprobs)
    finally:
        proc.terminate()
        proc.wait(60)

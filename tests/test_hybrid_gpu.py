"""The hybrid (Gated DeltaNet) model on CUDA: exact against the float64 transformers forward in
float32, and deterministic mode bitwise batch-invariant (alone vs a shuffled mix under budgets that
chunk long requests and share prefixes), in float32 and bf16. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import byte_tokenizer, ref_logprobs
from test_hybrid_engine import mix, packed_like_alone, tiny_qwen35
from test_hybrid_engine import torch_reference as torch_reference  # noqa: F401 (a fixture used by name)

from logprobe import Scorer
from logprobe.loading import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, torch_reference):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    path = tmp_path_factory.mktemp("hybridgpu") / "qwen35"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_qwen35()).float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return path, model.double()


def test_float32_matches_float64_transformers(hybrid_dir):
    path, ref = hybrid_dir
    loaded = load_model(str(path), "cuda", "float32")
    assert loaded.info.backend == "native"
    scorer = Scorer(loaded)
    reqs = mix(1)
    for r, got in zip(reqs, scorer.engine.run(reqs)):
        lp = ref_logprobs(ref, r.tokens, r.temperature)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (got.logprobs.double() - want).abs().max() < 2e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_is_batch_invariant(hybrid_dir, dtype):
    path, _ = hybrid_dir
    loaded = load_model(str(path), "cuda", dtype)
    reqs = mix(2)
    packed_like_alone(loaded, reqs, (64, 257, 1 << 20))

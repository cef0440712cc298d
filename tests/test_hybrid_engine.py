"""The engine on a hybrid (Gated DeltaNet + gated attention) model: long requests cut into chunks,
shared prefixes, random mixes under several budgets; against the float64 transformers forward
(≤ 1e-4 per token), and bitwise against each request run alone in deterministic mode.

The linear-attention layers carry a state instead of keys: a chunk continues the state its
sequence's earlier chunks left, a branch starts from its prefix's final state, and the planner cuts
sequences only on multiples of 64 rows (``ModelCaps.state_align``), where the chunked rule
reproduces the uncut run's arithmetic (``layers.linear_state``)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from helpers import byte_tokenizer, ref_logprobs
from test_determinism import bits, same

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.scheduler import Chunk, plan_work
from logprobe.loading import load_model

transformers = pytest.importorskip("transformers")
VOCAB = 300


def tiny_qwen35():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1024, initializer_range=0.1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        bos_token_id=1, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def torch_reference():
    """transformers' own PyTorch gated delta rule and conv, even where fla-core is installed (its
    Triton kernels would be the reference otherwise, and do not run on CPU)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    mp = pytest.MonkeyPatch()
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        mp.setattr(mod, name, inspect.unwrap(getattr(mod, name)))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, torch_reference):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    path = tmp_path_factory.mktemp("hybrid") / "qwen35"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_qwen35()).float().eval()
    with torch.no_grad():  # the norms' and decays' stored parameters away from their init values
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    loaded = load_model(str(path), "cpu", "float32")
    if loaded.info.backend != "native":
        pytest.skip("the native hybrid model is not loaded for qwen3_5_text")
    return loaded, model.double()


def save_tiny_qwen35(path, reqs: list[ScoreRequest]) -> None:
    """The tiny Qwen3.5 (seed 0) saved at ``path`` with a byte tokenizer, and ``want.pt``: the
    float64 transformers log-probs of each request's scored tokens (what the interpreted model
    checks of the kernels compare with). Needs transformers' PyTorch kernels (fla's do not run
    on CPU)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_qwen35()).float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    want = []
    for r in reqs:
        lp = ref_logprobs(model.double(), r.tokens, r.temperature)[r.score_begin - 1:-1]
        want.append(lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0])
    torch.save(want, f"{path}/want.pt")


def mix(seed: int) -> list[ScoreRequest]:
    """RL-style groups whose shared contexts run past one and two 64-row blocks, long requests,
    partial score windows, options."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for ctx_len in (70, 140):
        ctx = tok(ctx_len)
        for _ in range(3):
            cont = tok(rng.randint(1, 30))
            reqs.append(ScoreRequest(ctx + cont, rng.choice([len(ctx), 1]), temperature=rng.choice([1.0, 0.7]),
                                     top_k=rng.choice([0, 3]), entropy=rng.random() < 0.3))
    for n in (3, 65, 200):
        t = tok(n)
        reqs.append(ScoreRequest(t, rng.randint(1, n - 1)))
    return reqs


def test_alone_matches_float64_transformers(hybrid):
    loaded, ref = hybrid
    scorer = Scorer(loaded, config=EngineConfig(share_prefixes=False))
    for r in mix(1):
        got = scorer.engine.run([r])[0].logprobs
        lp = ref_logprobs(ref, r.tokens, r.temperature)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert len(got) == len(want)
        assert (got.double() - want).abs().max() < 1e-4


def packed_like_alone(loaded, reqs, budgets, deterministic: bool = True) -> None:
    """Each request scored alone (no prefix sharing) against the same requests shuffled and packed
    with shared prefixes at each budget: ``same`` (bitwise in deterministic mode)."""
    alone = [Scorer(loaded, config=EngineConfig(deterministic=deterministic, share_prefixes=False))
             .engine.run([r])[0] for r in reqs]
    rng = random.Random(3)
    for budget in budgets:
        order = list(range(len(reqs)))
        rng.shuffle(order)
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic, share_prefixes=True)
        out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
        for i, res in zip(order, out):
            same(alone[i], res, deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
def test_chunks_and_shared_prefixes(hybrid, deterministic):
    loaded, _ = hybrid
    reqs = mix(2)
    packed_like_alone(loaded, reqs, (64, 100, 257, 1 << 20), deterministic)
    inputs = [r.tokens[:-1] for r in reqs]
    plans = {b: plan_work(inputs, b, align=64) for b in (100, 257)}
    assert {t.shared for t in (x for b in plans[257] for x in b if not isinstance(x, Chunk))} >= {64, 128}
    assert any(isinstance(b[0], Chunk) and b[0].begin == 128 for b in plans[100])  # 100 rows: cut at 64s


def test_suffix_invariance(hybrid):
    """Appending tokens never changes the earlier tokens' bits (deterministic, budget 64: chunks)."""
    loaded, _ = hybrid
    scorer = Scorer(loaded, config=EngineConfig(deterministic=True, max_batch_tokens=64))
    tokens = torch.randint(2, VOCAB, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    full = scorer.engine.run([ScoreRequest(tokens, 1)])[0].logprobs
    for n in (2, 64, 65, 130):
        short = scorer.engine.run([ScoreRequest(tokens[:n], 1)])[0].logprobs
        assert torch.equal(bits(short), bits(full[: n - 1]))

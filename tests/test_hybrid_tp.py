"""Tensor parallelism for the hybrid linear-attention Qwen families (``models.qwen3_next``): worker
processes over gloo on CPU, TP = 2 against TP = 1.

Two tiny random checkpoints saved by transformers (the configs of ``test_qwen3_next``): Qwen3.5
dense (``qwen3_5_text``) and a Qwen3-Next whose MLPs are all dense (``num_experts`` 0: fused
``in_proj_qkvz`` / ``in_proj_ba``, split at load before a rank's rows are cut). Both have linear-
and full-attention blocks, key heads Hk = 2, value heads Hv = 4, 4 attention heads, 2 kv heads:
at TP = 2 a rank holds one key head, two value heads (its ``in_proj_qkv`` rows and conv channels
are three ranges: q, k, v), two attention heads and one kv head.

Deterministic mode: the raw bits equal TP = 1's (log-probs, entropy, ranks, top-k); default mode
within 1e-5. Long sequences cut into chunks and shared prefixes at TP = 2 equal TP = 1 alone,
bitwise. Sizes that do not split the linear-attention heads are refused (MoE variants split:
``tests/test_moe_parallel.py``).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import VOCAB, byte_tokenizer
from test_qwen3_next import TEXT, _randomise, _sequences

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading.loader import parallel_context
from logprobe.models.qwen3_next import HybridConfig

transformers = pytest.importorskip("transformers")

OPTS = dict(temperature=0.7, top_k=5, entropy=True)
FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")


def _make(kind: str):
    tf = transformers
    if kind == "qwen3_5_text":
        cfg = tf.Qwen3_5TextConfig(**TEXT, intermediate_size=96, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        cls = tf.Qwen3_5ForCausalLM
    else:  # Qwen3-Next with every MLP dense
        cfg, cls = tf.Qwen3NextConfig(**TEXT, intermediate_size=96, num_experts=0), tf.Qwen3NextForCausalLM
    return cls._from_config(cfg, attn_implementation="eager")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for i, kind in enumerate(("qwen3_5_text", "qwen3_next")):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(i)
        model = _make(kind).float().eval()
        _randomise(model, seed=200 + i)
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = d
    return out


def _bits_equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return len(a) == len(b) and all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


def _seqs() -> list[dict]:
    shared = list(range(3, 73))  # two completions of one 70-token prompt: a shared prefix
    return _sequences() + [{"prompt_token_ids": shared, "completion_token_ids": [9, 10, 11]},
                           {"prompt_token_ids": shared, "completion_token_ids": [12, 13]}]


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per model (~15 s each)
@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_tp2_equals_tp1(kind, dirs):
    path = str(dirs[kind])
    seqs = _seqs()
    one = Scorer(path, device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det)
        want[det] = one.logprobs(seqs, **OPTS)
    with Scorer(path, device="cpu", dtype="float32", progress=False, tensor_parallel_size=2) as s:
        for det in (False, True):
            s.config = EngineConfig(deterministic=det)
            got = s.logprobs(seqs, **OPTS)
            if det:
                assert _bits_equal(got, want[det]), kind
            else:
                for x, y in zip(got, want[det]):
                    assert (x.logprobs - y.logprobs).abs().max() <= 1e-5
                    assert (x.entropy - y.entropy).abs().max() <= 1e-5
                    assert torch.equal(x.topk_ids, y.topk_ids)


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes
def test_tp2_chunks_and_shared_prefixes_are_bitwise(dirs):
    """Deterministic mode at TP = 2: groups sharing a 70-token context (shared prefixes cut back to 64,
    the state grid) and long requests cut into chunks by small budgets equal each request alone at
    TP = 1, bitwise; captures (whole hidden width on every rank) too."""
    chunked_groups_bitwise(str(dirs["qwen3_5_text"]), "blocks.2.resid_post")


def chunked_groups_bitwise(path: str, at: str, **split) -> None:
    """Deterministic mode at TP = 2 (``split``: more Scorer options): three requests sharing a
    70-token context, a short one and a long one cut into chunks by budgets of 64 and 100 tokens,
    each equal to the request alone on one process, bitwise, with a capture at ``at``."""
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    ctx = tok(70)
    seqs = [{"prompt_token_ids": ctx, "completion_token_ids": tok(rng.randint(1, 20))} for _ in range(3)]
    seqs += [{"prompt_token_ids": tok(4), "completion_token_ids": tok(3)},
             {"prompt_token_ids": tok(30), "completion_token_ids": tok(150)}]
    capture = [{"at": at, "positions": "last"}]
    one = Scorer(path, device="cpu", dtype="float32", config=EngineConfig(deterministic=True, share_prefixes=False,
                                                                            progress=False))
    alone = [one.logprobs([q], capture=capture)[0] for q in seqs]
    for budget in (64, 100):
        cfg = EngineConfig(deterministic=True, share_prefixes=True, max_batch_tokens=budget, progress=False)
        with Scorer(path, device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2, **split) as s:
            got = s.logprobs(seqs, capture=capture)
        for a, b in zip(alone, got):
            assert torch.equal(a.logprobs, b.logprobs), budget
            assert b.captures[0].value.shape[-1] == 64 and torch.equal(a.captures[0].value, b.captures[0].value)


def _cfg(**kw) -> HybridConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, layer_types=("linear_attention", "full_attention"),
                num_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96)
    return HybridConfig(**{**base, **kw})


def test_indivisible_heads_refused_and_moe_split():
    assert parallel_context(_cfg(), 1, 2).size == 2
    with pytest.raises(LogprobeError) as e:
        parallel_context(_cfg(), 0, 4)  # 4 attention heads, 4 value heads: the 2 key heads do not split
    assert e.value.field == "tensor_parallel_size" and "linear_num_key_heads 2" in str(e.value)
    with pytest.raises(LogprobeError) as e:
        parallel_context(_cfg(num_heads=8, linear_num_value_heads=6), 0, 4)
    assert "does not divide linear_num_value_heads 6" in str(e.value)
    with pytest.raises(LogprobeError, match="attention heads"):
        parallel_context(_cfg(), 0, 3)
    from logprobe.layers.moe import MoeSpec

    moe = _cfg(moe=MoeSpec(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True), intermediate_size=0)
    assert parallel_context(moe, 0, 2, None, 2).experts == 2  # experts split (tests/test_moe_parallel.py)
    with pytest.raises(LogprobeError) as e:
        parallel_context(moe, 0, 2, None, 3)
    assert e.value.field == "expert_parallel_size"


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_rank_reads_its_heads_rows(kind, dirs):
    """Rank 1 of 2 reads (``hybrid_shard_tensors``): of in_proj_qkv and the conv weight its key heads
    of q and of k and its value heads of v (three ranges); of in_proj_z / a / b, A_log and dt_bias
    its value heads; of q_proj its heads' query+gate blocks; the norms whole. Qwen3-Next's fused
    projections are split first, then cut the same way."""
    from logprobe.loading.hf import read_config
    from logprobe.loading.hybrid import hybrid_config, hybrid_shard_tensors, hybrid_tensors

    path = dirs[kind]
    cfg = hybrid_config(read_config(path))
    whole = dict(hybrid_tensors(path, cfg))
    got = dict(hybrid_shard_tensors(path, cfg, parallel_context(cfg, 1, 2)))
    assert got.keys() == whole.keys()
    la, sa = "layers.0.linear_attn.", "layers.1.self_attn."
    for name in ("in_proj_qkv.weight", "conv_weight"):  # [q 0:32 | k 32:64 | v 64:128], 16 per key/value head
        w = whole[la + name]
        assert torch.equal(got[la + name], torch.cat([w[16:32], w[48:64], w[96:128]]))
    assert torch.equal(got[la + "in_proj_z.weight"], whole[la + "in_proj_z.weight"][32:64])
    for name in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        assert torch.equal(got[la + name], whole[la + name][2:4])
    assert torch.equal(got[la + "norm.weight"], whole[la + "norm.weight"])
    assert torch.equal(got[la + "out_proj.weight"], whole[la + "out_proj.weight"][32:64])  # rows of the output
    assert torch.equal(got[sa + "q_proj.weight"], whole[sa + "q_proj.weight"][128:256])  # heads 2, 3: 2 x 64 rows
    assert torch.equal(got[sa + "k_proj.weight"], whole[sa + "k_proj.weight"][32:64])


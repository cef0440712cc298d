"""The default token budget (``max_batch_tokens=None``) from the device and free memory (issue 19):
the rule pinned by a literal table, and what the Scorer, the CLI and tensor-parallel ranks end with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from logprobe import EngineConfig, Scorer
from logprobe.engine.budget import (
    CPU_BUDGET,
    MAX_AUTO_MOE,
    MAX_AUTO_MOE_SPLIT,
    activation_bytes_per_token,
    auto_budget,
    budget_for,
    gathered_bytes_per_token,
    ranks_budget,
)
from logprobe.errors import LogprobeError
from logprobe.layers.moe import MoeSpec
from logprobe.layers.moe_gpt_oss import GptOssMoeSpec

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["llama"][0]

LLAMA_8B = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                           moe=None)
LLAMA_1B = SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
                           moe=None)
QWEN3_30B_A3B = SimpleNamespace(hidden_size=2048, intermediate_size=6144, num_heads=32, num_kv_heads=4, head_dim=128,
                                moe=MoeSpec(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True))


# the Moonlight / DeepSeek-V2-Lite-like MLA shape of bench/gpu_moe_parallel.py (no q latent)
MLA = SimpleNamespace(hidden_size=2048, intermediate_size=10944, num_heads=16, q_lora_rank=None, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                      moe=MoeSpec(num_experts=64, top_k=6, intermediate_size=1408, norm_topk_prob=False,
                                  shared_intermediate_size=2816, dense_layers=(0,)))


# gpt-oss-20b: 64 heads + 2 x 8 kv heads of 64, top-4 of 32 experts of 2880; its MoE spec has no
# shared expert and no dense blocks (the budget fell back to 8192 on those missing fields)
GPT_OSS_20B = SimpleNamespace(hidden_size=2880, intermediate_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                              moe=GptOssMoeSpec(num_experts=32, top_k=4, intermediate_size=2880))
# a Gemma-4-like config: head widths and kv heads per block (256 / 8 sliding, 512 / 4 full), a
# double-wide MLP; the widest block counts (it fell back to 8192 on the missing num_kv_heads)
GEMMA4 = SimpleNamespace(hidden_size=2560, intermediate_size=10240, num_heads=8, layer_head_dims=(256, 256, 512),
                         layer_kv_heads=(8, 8, 4), use_double_wide_mlp=True, moe=None)


@pytest.mark.parametrize("cfg,size,want", [
    (LLAMA_8B, 2, 2 * (6 * 4096 + 48 * 128 + 3 * 14336)),  # 147,456
    (LLAMA_1B, 2, 2 * (6 * 2048 + 48 * 64 + 3 * 8192)),  # 79,872
    (LLAMA_8B, 4, 294912),
    (QWEN3_30B_A3B, 2, 2 * (6 * 2048 + 40 * 128 + 3 * 8 * 768)),  # experts: 8 of 768 each
    # latent attention: 16 heads x (q, k, v padded to 192 + the expanded nope 128 | v 128) + the
    # latent 512 + its rope 64; MLP: routed 3 * 6 * 1408 + shared 3 * 2816 (> the dense 3 * 10944)
    (MLA, 2, 2 * (6 * 2048 + 16 * (3 * 192 + 256) + 512 + 64 + 3 * 6 * 1408 + 3 * 2816)),  # 119,936
    (SimpleNamespace(**{**vars(MLA), "q_lora_rank": 1536}), 2, 119936 + 2 * 1536),
    (GPT_OSS_20B, 2, 2 * (6 * 2880 + 80 * 64 + 3 * 4 * 2880)),  # 113,920
    (GEMMA4, 2, 2 * (6 * 2560 + (8 + 2 * 4) * 512 + 3 * 2 * 10240)),  # full 8,192 > sliding 6,144: 169,984
])
def test_bytes_per_token_gold(cfg, size, want):
    assert activation_bytes_per_token(cfg, size) == want


@pytest.mark.parametrize("device,free,per_token,want", [
    ("cpu", None, None, 8192),
    ("cpu", 500 * GiB, 1, 8192),  # CPU never changes
    ("cuda", None, 147456, 8192),  # no figure: the conservative default
    ("cuda", 60 * GiB, 147456, 32768),  # llama-8b on an 80 GB card: the cap
    ("cuda", 7 * GiB, 147456, 8192),  # 12,743 tokens fit in a quarter -> 8192
    ("cuda", 2 * GiB, 147456, 2048),  # 3,640 -> 2048
    ("cuda", GiB // 8, 147456, 1024),  # 227 tokens -> the floor (OOM retries below it)
    ("cuda", 20 * GiB, 79872, 32768),
    ("cuda", int(2.5 * GiB), 79872, 8192),  # 8,402 -> 8192
])
def test_auto_budget_gold(device, free, per_token, want):
    assert auto_budget(device, free, per_token) == want


@pytest.mark.parametrize("free,want", [
    (100 * GiB, 65536),  # Qwen3-30B-A3B (71,680 bytes a token) on an H200 after its weights: the MoE cap
    (12 * GiB, 32768),  # 44,938 tokens fit in a quarter -> 32768, under either cap
    (4 * GiB, 8192),  # 14,979 -> 8192
])
def test_moe_cap_gold(free, want):
    per_token = activation_bytes_per_token(QWEN3_30B_A3B, 2)
    assert per_token == 71680
    assert auto_budget("cuda", free, per_token, cap=MAX_AUTO_MOE) == want
    assert auto_budget("cuda", free, per_token) == min(want, 32768)  # the dense cap


@pytest.mark.parametrize("free,ranks,want", [
    # data-parallel attention over N ranks: an own row costs 71,680 + N * 12,352 gathered bytes
    # (x bf16 + the float32 partial of H = 2048, the routing 8 * 8); the share per rank x N
    (100 * GiB, 1, 65536),
    (100 * GiB, 2, 262144),  # 278,506 rows per rank -> 262,144 -> the cap across ranks, 131,072
    (100 * GiB, 4, 524288),  # 221,686 -> 131,072 per rank
    (40 * GiB, 2, 131072),  # 111,402 -> 65,536 per rank, under either cap
    (12 * GiB, 2, 65536),  # 33,420 -> 32768 per rank
    (4 * GiB, 2, 16384),  # 11,140 -> 8192 per rank
    (4 * GiB, 8, 32768),  # 6,297 (8 gathered rows per own row) -> 4096 per rank
])
def test_data_attention_budget_gold(free, ranks, want):
    assert MAX_AUTO_MOE_SPLIT == 2 * MAX_AUTO_MOE
    assert gathered_bytes_per_token(QWEN3_30B_A3B, 2) == 12352 and gathered_bytes_per_token(LLAMA_8B, 2) == 0
    assert ranks_budget("cuda", free, QWEN3_30B_A3B, 2, ranks) == want
    assert ranks_budget("cpu", free, QWEN3_30B_A3B, 2, ranks) == ranks * CPU_BUDGET
    assert ranks_budget("cuda", 60 * GiB, LLAMA_8B, 2) == 32768  # dense: the dense cap, one rank
    # latent attention has a rule too (it fell back to 8192 before): 119,936 + 2 * 12,336 a row
    assert gathered_bytes_per_token(MLA, 2) == 12336
    assert ranks_budget("cuda", 40 * GiB, MLA, 2) == 65536 and ranks_budget("cuda", 40 * GiB, MLA, 2, 2) == 131072
    assert ranks_budget("cuda", 8 * GiB, MLA, 2, 2) == 2 * 8192  # 14,850 per rank -> 8192


def test_config_default_is_none_and_validated():
    assert EngineConfig().max_batch_tokens is None
    for bad in (0, -5, 2.5, True):
        with pytest.raises(LogprobeError, match="max_batch_tokens"):
            EngineConfig(max_batch_tokens=bad)


def test_scorer_resolves_the_default(tiny_dir):
    s = Scorer(str(tiny_dir), device="cpu", dtype="float32")
    assert s.config.max_batch_tokens == CPU_BUDGET and s.engine.budget == CPU_BUDGET
    assert s.config is s.engine.config  # what the server reads is what the engine runs
    assert Scorer(s.loaded, max_batch_tokens=300).config.max_batch_tokens == 300
    assert budget_for(s.loaded.model, torch.device("cpu")) == CPU_BUDGET


def test_config_set_later_keeps_the_start_budget(tiny_dir):
    """A config set after start with ``max_batch_tokens=None`` (deterministic switched on, say)
    runs under the budget chosen at start; a new budget replaces the working one. Before the
    setter resolved None, the first good batch compared ``int < None`` and raised."""
    s = Scorer(str(tiny_dir), device="cpu", dtype="float32", max_batch_tokens=300)
    seqs = [{"prompt_token_ids": list(range(5, 15)), "completion_token_ids": list(range(15, 40))}]
    want = s.logprobs(seqs)[0].logprobs
    s.config = EngineConfig(deterministic=True)
    assert s.config.max_batch_tokens == 300 and s.config.deterministic and s.engine.budget == 300
    torch.testing.assert_close(s.logprobs(seqs)[0].logprobs, want, rtol=0, atol=2e-5)
    s.config = EngineConfig(max_batch_tokens=64)
    assert s.engine.budget == 64 and s.config.max_batch_tokens == 64 and not s.config.deterministic
    s.engine.budget = 32  # lowered after an out-of-memory: an unchanged budget keeps the lowering
    s.config = EngineConfig(max_batch_tokens=64, deterministic=True)
    assert s.engine.budget == 32


@pytest.mark.slow  # slow tier (pytest -m slow): worker processes
def test_tensor_parallel_ranks_agree(tiny_dir):
    """Worker ranks resolve the budget, agree on the smallest and tell the driver (gloo, CPU)."""
    with Scorer(str(tiny_dir), device="cpu", dtype="float32", tensor_parallel_size=2) as s:
        assert s.config.max_batch_tokens == CPU_BUDGET and s.engine.config is s.config
        s.config = EngineConfig(deterministic=True)  # sent to the workers each run, None resolved
        assert s.config.max_batch_tokens == CPU_BUDGET
        ids = list(range(5, 40))
        lp = s.logprobs([{"prompt_token_ids": ids[:10], "completion_token_ids": ids[10:]}])[0].logprobs
    ref = Scorer(str(tiny_dir), device="cpu", dtype="float32").logprobs(
        [{"prompt_token_ids": ids[:10], "completion_token_ids": ids[10:]}])[0].logprobs
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-5)

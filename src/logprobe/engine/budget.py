"""The default token budget of one forward pass (``EngineConfig.max_batch_tokens=None``), chosen
from the device and the memory left once the weights are loaded.

* CPU: ``CPU_BUDGET`` (8192; larger buys nothing on CPU, bench/cpu_engine_budget.py); N times it
  under data-parallel attention over N ranks (the same rows per rank).
* CUDA: the largest power of two whose activations take at most ``MEMORY_SHARE`` of the free
  memory, clamped to [``MIN_AUTO``, ``MAX_AUTO``]. 32768 ran RL groups 7% (llama-8b) and 14% (llama-1b)
  faster than 8192 on an H100 (issue 19's table); the rest of the free memory is the
  allocator's slack and the head's fixed chunks. Mixture-of-experts models clamp at
  ``MAX_AUTO_MOE`` instead: a pass of T tokens gives each of E experts about T * top_k / E rows,
  and the expert GEMMs' 128-row tiles run fuller with more (Qwen3-30B-A3B, 128 experts, top-8, on
  an H200: W1 5.76 s at 32768, 5.52 s at 65536, ``bench/gpu_moe.py --batch-tokens``). A pass that
  still runs out is split and retried (``Engine.run``), so the estimate only has to be right most
  of the time.

Data-parallel attention over N ranks (``parallel.rows``: each rank runs attention and dense
layers on its share of the batch's rows, the experts gather every rank's rows) holds per rank
the activations of its own rows and, in the MoE layer, ``gathered_bytes_per_token`` for every
rank's rows: N of them per own row. The rule then picks a share per rank and the budget of a
pass (the rows of every rank together) is N times it. The share clamps at
``MAX_AUTO_MOE_SPLIT`` (twice one GPU's cap): a pass across ranks pays more for its ends (the
micro-batches' fill and drain, the ranks agreeing, the last transfers alone), so fewer, larger
passes pay off there. Two H200s, whole Qwen3-30B-A3B shape, W1 (239k rows): one pass of 262,144
rows 2.639 s against two of 131,072 2.703 s (2.4%); one GPU at 131,072 against 65,536: 1.0%
(MLA shape: 0.7% slower), so one GPU keeps its cap (docs/perf.md).

Activations per token of one block, in the model's dtype (the widest moment of each half):
attention ``6 H + (heads + 2 kv_heads) * head_dim`` (residual, norm, q/k/v, output and its
projection, with slack; latent attention: ``attention_width``), MLP ``3 I`` (gate and up, then
their product), for MoE ``3 * top_k * I_e`` plus a shared expert's ``3 I_s``.

    llama-8b (H 4096, I 14336, 32 + 2 * 8 heads of 128), bf16:
        2 * (6 * 4096 + 48 * 128 + 3 * 14336) = 2 * 73,728 = 147,456 bytes per token
    60 GiB free: 15 GiB / 147,456 = 109,226 tokens -> 65,536 -> clamped to 32,768
     7 GiB free: 1.75 GiB / 147,456 = 12,743 tokens -> 8,192

>>> from types import SimpleNamespace as C
>>> cfg = C(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128, moe=None)
>>> activation_bytes_per_token(cfg, 2)
147456
>>> auto_budget("cuda", 60 * 2**30, 147456), auto_budget("cuda", 7 * 2**30, 147456), auto_budget("cpu")
(32768, 8192, 8192)
>>> auto_budget("cuda", 60 * 2**30, 147456, cap=MAX_AUTO_MOE)
65536

Qwen3-30B-A3B (H 2048, 32 + 2 * 4 heads of 128, top-8 of 768), bf16, over 2 ranks with 100 GiB
free each: 71,680 bytes an own row plus 2 * 12,352 gathered = 96,384; a quarter of 100 GiB holds
278,506 rows -> 262,144 -> the cap across ranks, 131,072 per rank -> 262,144 a pass:

>>> q = C(hidden_size=2048, intermediate_size=6144, num_heads=32, num_kv_heads=4, head_dim=128,
...       moe=C(top_k=8, intermediate_size=768, shared_intermediate_size=0, dense_layers=()))
>>> activation_bytes_per_token(q, 2), gathered_bytes_per_token(q, 2)
(71680, 12352)
>>> ranks_budget("cuda", 100 * 2**30, q, 2, ranks=2), ranks_budget("cuda", 100 * 2**30, q, 2)
(262144, 65536)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import EngineConfig
from ..models.base import ScoringModel

CPU_BUDGET = 8192
MAX_AUTO = 32768
MAX_AUTO_MOE = 65536
MAX_AUTO_MOE_SPLIT = 131072  # per rank under data-parallel attention (the module docstring)
MIN_AUTO = 1024
MEMORY_SHARE = 0.25
CUDA_UNKNOWN = 8192  # the transformers backend on CUDA, whose shapes logprobe does not read


def attention_width(cfg) -> int:
    """Elements per token of attention's projected heads: q, k, v (``(heads + 2 kv_heads) * head_dim``);
    for multi-head latent attention (``models.deepseek``, ``kv_lora_rank``) q, k and v each padded
    to one head width, the expanded ``[nope | v]`` of every head, and the latents."""
    if getattr(cfg, "layer_head_dims", None) is not None:  # Gemma 4: widths per block, the widest counts
        return max((cfg.num_heads + 2 * kv) * d for d, kv in zip(cfg.layer_head_dims, cfg.layer_kv_heads))
    if getattr(cfg, "kv_lora_rank", None) is None:
        return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    width = max(nope + rope, dv)
    return cfg.num_heads * (3 * width + nope + dv) + cfg.kv_lora_rank + rope + (cfg.q_lora_rank or 0)


def activation_bytes_per_token(cfg, element_size: int) -> int:
    """Bytes of activations one token needs in a block (see the module docstring)."""
    attn = 6 * cfg.hidden_size + attention_width(cfg)
    moe = getattr(cfg, "moe", None)
    if moe is None:  # Gemma 4's double-wide MLP blocks: twice the width
        mlp = 3 * cfg.intermediate_size * (2 if getattr(cfg, "use_double_wide_mlp", False) else 1)
    else:  # the widest of a dense block and an expert block (gpt-oss's spec has neither field)
        dense = getattr(moe, "dense_layers", ()) or getattr(cfg, "first_k_dense_replace", 0)
        mlp = max(3 * cfg.intermediate_size if dense else 0,
                  3 * moe.top_k * moe.intermediate_size + 3 * getattr(moe, "shared_intermediate_size", 0))
    return element_size * (attn + mlp)


def gathered_bytes_per_token(cfg, element_size: int) -> int:
    """Bytes a rank's MoE layer holds for each row of the pass under data-parallel attention
    (``Experts.split_forward``): the gathered x (H in the model's dtype), the float32 [rows, H]
    partial reduce-scattered in default mode, and the gathered routing (k ids and k weights,
    float32). 0 for a dense model (nothing is gathered before the final norm)."""
    moe = getattr(cfg, "moe", None)
    if moe is None:
        return 0
    return (element_size + 4) * cfg.hidden_size + 8 * moe.top_k


def ranks_budget(device_type: str, free_bytes: int | None, cfg, element_size: int, ranks: int = 1) -> int:
    """The budget of a pass whose rows split over ``ranks`` ranks (data-parallel attention; 1:
    every rank runs every row): ``ranks`` x the rule's share per rank, each own row counting its
    activations plus ``ranks`` gathered rows (the module docstring)."""
    per_token = activation_bytes_per_token(cfg, element_size)
    if ranks > 1:
        per_token += ranks * gathered_bytes_per_token(cfg, element_size)
    moe = getattr(cfg, "moe", None) is not None
    cap = (MAX_AUTO_MOE_SPLIT if ranks > 1 else MAX_AUTO_MOE) if moe else MAX_AUTO
    return ranks * auto_budget(device_type, free_bytes, per_token, cap)


def row_ranks(model: torch.nn.Module) -> int:
    """How many ranks share a pass's rows: the group size under data-parallel attention
    (``ParallelContext.data_attention``), else 1."""
    ctx = getattr(model, "ctx", None)
    return ctx.size if getattr(ctx, "data_attention", False) else 1


def auto_budget(device_type: str, free_bytes: int | None = None, per_token: int | None = None,
                cap: int = MAX_AUTO) -> int:
    """The budget for a device (the module docstring's rule, clamped at ``cap``); CUDA without a
    memory figure or a per-token size gets ``CUDA_UNKNOWN``."""
    if device_type != "cuda":
        return CPU_BUDGET
    if free_bytes is None or not per_token:
        return CUDA_UNKNOWN
    tokens = int(free_bytes * MEMORY_SHARE) // per_token
    power = 1 << max(0, tokens.bit_length() - 1) if tokens > 0 else 0  # the largest power of two <= tokens
    return max(MIN_AUTO, min(cap, power))


def agreed_budget(model: torch.nn.Module, device: torch.device, group=None) -> int:
    """``budget_for`` on every rank of a tensor-parallel group, then the smallest: the ranks must
    plan the same batches (each runs its shard of the same forward passes)."""
    import torch.distributed as dist

    mine = torch.tensor([budget_for(model, device)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    return int(mine.item())


def budget_for(model: torch.nn.Module, device: torch.device) -> int:
    """The budget for ``model`` (loaded) on ``device``, from the memory free now; under
    data-parallel attention the rows of all ranks together (``ranks_budget``). Only the
    transformers backend gets ``CUDA_UNKNOWN``: a native family's config always gives its shapes
    (a field missing there is a bug to see, not a budget to guess)."""
    ranks = row_ranks(model)
    if device.type != "cuda":
        return ranks * CPU_BUDGET
    if not isinstance(model, ScoringModel):
        return CUDA_UNKNOWN
    return ranks_budget("cuda", torch.cuda.mem_get_info(device)[0], model.config,
                        next(model.parameters()).element_size(), ranks)


def pass_bytes(cfg, element_size: int, rows: int, ranks: int = 1) -> int:
    """The working memory a rank reserves before a pass of ``rows`` rows (``Engine._preflight``,
    in a replica on CUDA): the budget rule's activations, ``activation_bytes_per_token`` for each
    of its own rows (under data-parallel attention over ``ranks`` ranks its share,
    ``ceil(rows / ranks)``) plus ``gathered_bytes_per_token`` for every row of the pass. A pass
    of the default budget so asks at most ``MEMORY_SHARE`` of the memory that was free after
    loading; the head's fixed tiles and the allocator's slack are the rest.

    Qwen3-30B-A3B (the module docstring's ``q``), bf16, over 2 ranks, a pass of 131,072 rows:
    65,536 * 71,680 + 131,072 * 12,352 bytes (5.9 GiB) on each rank; llama-8b, 1,000 rows:

    >>> from types import SimpleNamespace as C
    >>> q = C(hidden_size=2048, intermediate_size=6144, num_heads=32, num_kv_heads=4, head_dim=128,
    ...       moe=C(top_k=8, intermediate_size=768, shared_intermediate_size=0, dense_layers=()))
    >>> pass_bytes(q, 2, 131072, ranks=2)
    6316621824
    >>> pass_bytes(C(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
    ...              moe=None), 2, 1000)
    147456000
    """
    own = -(-rows // ranks)
    gathered = rows * gathered_bytes_per_token(cfg, element_size) if ranks > 1 else 0
    return own * activation_bytes_per_token(cfg, element_size) + gathered


def model_pass_bytes(model: torch.nn.Module, rows: int) -> int:
    """``pass_bytes`` of a loaded model (its config, dtype and row ranks); 0 for a model whose
    shapes logprobe does not read (the transformers backend)."""
    if not isinstance(model, ScoringModel):
        return 0
    return pass_bytes(model.config, next(model.parameters()).element_size(), rows, row_ranks(model))


def resolved_budget(config: EngineConfig, start_budget: int) -> EngineConfig:
    """``config`` with ``max_batch_tokens=None`` replaced by the budget an engine started with
    (set after start, None means "the default", which was chosen once from the device).

    >>> from logprobe.config import EngineConfig
    >>> resolved_budget(EngineConfig(deterministic=True), 32768).max_batch_tokens
    32768
    >>> resolved_budget(EngineConfig(max_batch_tokens=4096), 32768).max_batch_tokens
    4096
    """
    return replace(config, max_batch_tokens=start_budget) if config.max_batch_tokens is None else config

"""What more than one benchmark script uses: the workloads W1-W4, timing, the matmul ceiling, FLOP
counts, the random-init model shapes, a byte tokenizer, random checkpoints on disk, the transformers
baseline. A helper one script alone uses lives in that script. Not a script: ``sys.path.insert(0, <bench/>)`` then ``from common import ...``.

Imports without a GPU (triton and transformers are imported where they are used).

Workloads (seeded, the same ids in every run and every script):
  W1  RL groups: 32 prompts of 256-2048 ids x 8 completions of 16-4096 ids (log-uniform); the
      completions are scored
  W2  multiple choice: 512 contexts of 200-1000 ids x 4 continuations of 1-30
  W3  perplexity: 262,144 ids in windows of 2048, stride 512
  W4  long context: one 32,768-id and one 131,072-id sequence, every token scored
"""

from __future__ import annotations

import gc
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

from logprobe.engine.request import ScoreRequest
from logprobe.scoring.windows import sliding_windows

GiB = 1024**3
_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.1's
MODELS = {
    # Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M shapes (random weights)
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters=dict(_LLAMA31_ROPE)),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    # Llama-3.1-70B's shape (80 layers, 64 query / 8 key-value heads): 141 GB in bf16, 71 GB as FP8 blocks
    "llama-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_parameters=dict(_LLAMA31_ROPE)),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}
# Qwen3.5 hybrids (Gated DeltaNet linear attention, 3 linear : 1 full layers): the text configs of
# Qwen3.5-9B and Qwen3.5-35B-A3B (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig, whose
# defaults are these two models), and tiny ones for CPU runs; bench/gpu_hybrid.py writes them
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
_QWEN35_COMMON = dict(vocab_size=248320, num_attention_heads=16, head_dim=256, linear_conv_kernel_dim=4,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32, max_position_embeddings=262144, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, rope_parameters=_QWEN35_ROPE, bos_token_id=1, eos_token_id=2)
_QWEN35_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, max_position_embeddings=32768)
HYBRID_MODELS = {  # name: (transformers config class, kwargs)
    "qwen35-9b": ("Qwen3_5TextConfig", dict(_QWEN35_COMMON, hidden_size=4096, intermediate_size=12288,
                                             num_hidden_layers=32, num_key_value_heads=4)),
    "qwen35-4b": ("Qwen3_5TextConfig", dict(_QWEN35_COMMON, hidden_size=2560, intermediate_size=9216,
                                             num_hidden_layers=32, num_key_value_heads=4)),
    "qwen35-35b-a3b": ("Qwen3_5MoeTextConfig", dict(_QWEN35_COMMON, hidden_size=2048, num_hidden_layers=40,
                                                   num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                                   moe_intermediate_size=512, shared_expert_intermediate_size=512)),
}
HYBRID_TINY = {
    "qwen35-9b": dict(_QWEN35_TINY, intermediate_size=128),
    "qwen35-4b": dict(_QWEN35_TINY, intermediate_size=128),
    "qwen35-35b-a3b": dict(_QWEN35_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32),
}
# the shapes save_model writes (transformers' default rope and untied head, 8192 positions)
# mixtures of experts as (transformers config class, its arguments): Qwen3-30B-A3B's shape, the one
# the MoE benches share (bench/gpu_moe_parallel.py, bench/gpu_small_passes.py)
QWEN3_30B_A3B = ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, norm_topk_prob=True))
SAVED_SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
def log(*a):
    print(*a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn):
    """``(fn(), seconds)``, the GPU synchronised before and after."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def bench_ms(fn, rep=200, warmup=50):
    """Median milliseconds of ``triton.testing.do_bench`` (CUDA)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_ceiling() -> float:
    """bf16 8192^3 TFLOP/s on random data (median of do_bench)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def workload(name: str, vocab: int) -> list[ScoreRequest]:
    """W1-W4 (see the module docstring) over ids 3 .. vocab - 1."""
    rng = random.Random({"W1": 1, "W2": 2, "W3": 3, "W4": 4}[name])
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    reqs = []
    if name == "W1":  # RL groups: 32 prompts x 8 completions
        for _ in range(32):
            prompt = tok(rng.randint(256, 2048))
            for _ in range(8):
                n = int(round(math.exp(rng.uniform(math.log(16), math.log(4096)))))
                reqs.append(ScoreRequest(prompt + tok(n), len(prompt)))
    elif name == "W2":  # multiple choice: 512 contexts x 4 continuations
        for _ in range(512):
            ctx = tok(rng.randint(200, 1000))
            for _ in range(4):
                reqs.append(ScoreRequest(ctx + tok(rng.randint(1, 30)), len(ctx)))
    elif name == "W3":  # perplexity: 256k tokens, context 2048, stride 512
        ids = tok(262144)
        for w in sliding_windows(len(ids), 2048, 512):
            reqs.append(ScoreRequest(ids[w.begin:w.end], w.score_begin - w.begin))
    elif name == "W4":  # long context: one 32k and one 128k sequence, all scored
        for n in (32768, 131072):
            reqs.append(ScoreRequest(tok(n + 1), 1))
    return reqs


def _per_token(lc) -> float:
    H, F, L = lc.hidden_size, lc.intermediate_size, lc.num_layers
    qd, kvd = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    return 2 * L * (H * qd + 2 * H * kvd + qd * H + 3 * H * F)


def flops(lc, seqs: list[tuple[int, int]]) -> float:
    """Forward FLOPs of the needed tokens: seqs = (input length, scored tokens)."""
    qd, L, per_token = lc.num_heads * lc.head_dim, lc.num_layers, _per_token(lc)
    total = 0.0
    for n, scored in seqs:  # causal attention: L^2 D per QK, PV
        total += per_token * n + 2 * L * qd * n * n + 2 * lc.hidden_size * lc.vocab_size * scored
    return total


def unique_flops(lc, reqs: list[ScoreRequest], min_shared: int | None = 16, per_token: float | None = None) -> float:
    """FLOPs left when shared prefixes run once (``share_prefixes``): in sorted order, a request's
    tokens past its longest common prefix with the previous one (if >= ``min_shared``) are new;
    None: every needed token counts. Attention of a new token still spans its whole context.
    ``per_token``: matmul FLOPs per computed token of the blocks (default: the dense Llama's)."""
    qd, L = lc.num_heads * lc.head_dim, lc.num_layers
    per_token = _per_token(lc) if per_token is None else per_token
    total, prev = 0.0, []
    for r in sorted(reqs, key=lambda r: r.inputs):
        x, n = r.inputs, r.num_inputs
        a = 0
        if min_shared is not None:
            while a < min(len(prev), n) and prev[a] == x[a]:
                a += 1
            a = a if a >= min_shared else 0
        total += per_token * (n - a) + 2 * L * qd * (n * n - a * a) + 2 * lc.hidden_size * lc.vocab_size * r.num_scored
        prev = x
    return total


def llama_config(name: str):
    """transformers' ``LlamaConfig`` of ``MODELS[name]``."""
    import transformers as tf

    return tf.LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2, initializer_range=0.02)


def byte_tokenizer():
    """A byte-level tokenizer (every byte a token, ids 3.. ): the random-weight benches score token
    ids, a model directory still needs one."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 codes, float32 scale_inv [ceil(out/b), ceil(in/b)]): absmax / 448 per block."""
    out, k = w.shape
    R, C = -(-out // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, C * block - k, 0, R * block - out))  # [R*b, C*b]
    scale = (padded.view(R, block, C, block).abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)  # [R, C]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (padded / full).to(torch.float8_e4m3fn)[:out, :k].contiguous(), scale


def save_model(shape: str, path: str, device: str):
    """The random bf16 Llama of ``SAVED_SHAPES[shape]`` (transformers' init, seed 0) saved to
    ``path`` (``save_pretrained``) with a 258-id byte tokenizer; the transformers model is returned."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = tf.LlamaConfig(**SAVED_SHAPES[shape], bos_token_id=1, eos_token_id=2, initializer_range=0.02,
                         torch_dtype="bfloat16", max_position_embeddings=8192)  # W1 rows reach 6,144 ids
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)} | {"<s>": 256, "</s>": 257}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return model.eval()


def run_transformers(hf, reqs, budget, dev="cuda", use_cache: bool = True):
    """The transformers baseline: right-padded batches (sorted by length) of at most ``budget``
    padded tokens; logits -> float32 log_softmax -> gather. Returns per-request logprobs (float32,
    on the CPU). ``use_cache=False``: no KV cache is built (bench/gpu_moe.py's baseline)."""
    order = sorted(range(len(reqs)), key=lambda i: -reqs[i].num_inputs)
    out = [None] * len(reqs)
    i = 0
    while i < len(order):
        L = reqs[order[i]].num_inputs
        B = max(1, budget // L)
        idx = order[i:i + B]
        i += B
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        mask = torch.zeros(len(idx), L, dtype=torch.long)
        for j, r in enumerate(idx):
            t = reqs[r].tokens[:-1]
            ids[j, :len(t)] = torch.tensor(t)
            mask[j, :len(t)] = 1
        logits = hf(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=use_cache).logits  # [B, L, V]
        lp = logits.float().log_softmax(-1)
        del logits
        for j, r in enumerate(idx):
            q = reqs[r]
            rows = torch.arange(q.score_begin - 1, q.num_inputs, device=dev)
            tgt = torch.tensor(q.tokens[q.score_begin:], device=dev)
            out[r] = lp[j, rows].gather(1, tgt[:, None])[:, 0].cpu()
        del lp
    return out


def hf_config(name: str, tiny: bool, layers: int | None):
    import transformers as tf

    cls, kw = HYBRID_MODELS[name]
    kw = dict(kw, **(HYBRID_TINY[name] if tiny else {}))
    if layers:
        kw["num_hidden_layers"] = layers
    return cls, getattr(tf, cls)(**kw)


def write_hybrid_checkpoint(cfg, path: Path, dev, dtype) -> str:
    """transformers' model of ``cfg`` (its own init, seed 0, made on ``dev``) saved with
    ``save_pretrained`` plus a byte tokenizer; kept when ``path`` already holds the same config."""
    from transformers import AutoModelForCausalLM

    stamp = json.dumps(cfg.to_dict(), sort_keys=True, default=str) + str(dtype)
    marker = path / "WRITTEN_BY_GPU_HYBRID"
    if marker.exists() and marker.read_text() == stamp:
        return "reused"
    if path.exists():
        shutil.rmtree(path)
    t = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.set_default_dtype(old)
    made = time.perf_counter() - t
    hf.save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))
    del hf
    free()
    marker.write_text(stamp)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return f"written: {size / GiB:.1f} GiB ({made:.1f} s to make, {time.perf_counter() - t - made:.1f} s to save)"


def mem_base(dev) -> int:
    if dev.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


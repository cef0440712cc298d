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
import sys
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


class TritonBuilds:
    """The Triton kernels a process builds (compiles, or loads from the disk cache) while this is
    open: a kernel met in a measured run that warm-up did not build shows as its name here.
    ``names``: one entry per build. Nothing is counted where Triton has no runtime hook."""

    def __init__(self):
        self.names: list[str] = []

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:
            self._knobs = None
            return self
        self._knobs, self._prev = knobs, knobs.runtime.jit_cache_hook

        def hook(*a, **k):
            fn = k.get("fn")
            self.names.append(getattr(fn, "name", "?"))
            return self._prev(*a, **k) if self._prev else False  # a true answer would skip the compile
        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc):
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook = self._prev


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


# ------------------------------------------- other families' shapes and their checkpoints
# (bench/gpu_families.py, bench/gpu_first_call.py)

GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=1024, max_position_embeddings=131072, rms_norm_eps=1e-6,
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                 bos_token_id=2, eos_token_id=1, pad_token_id=0)
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 4096},
                   bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)
# gpt-oss-120b's published config: gpt-oss-20b's but 36 layers and 128 experts
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
GLM4_9B = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
               num_attention_heads=32, num_key_value_heads=2, head_dim=128, attention_bias=True,
               partial_rotary_factor=0.5, max_position_embeddings=32768, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               bos_token_id=None, eos_token_id=151329, pad_token_id=151329)
PHI4_MINI = dict(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75, tie_word_embeddings=True,
                 max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 bos_token_id=199999, eos_token_id=199999, pad_token_id=199999)
GEMMA4_E4B = dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=2560, intermediate_size=10240,
                  num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  global_head_dim=512, hidden_size_per_layer_input=256, num_kv_shared_layers=18,
                  sliding_window=512, final_logit_softcapping=30.0, max_position_embeddings=131072,
                  rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
FAMILY_TINY = {"gemma3-4b": dict(GEMMA3_4B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                          bos_token_id=1, eos_token_id=2),
        "gpt-oss-20b": dict(GPT_OSS_20B, vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=64, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0),
        "glm4-9b": dict(GLM4_9B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=2, pad_token_id=0),
        "phi4-mini": dict(PHI4_MINI, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0),
        "gemma4-e4b": dict(GEMMA4_E4B, vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                           sliding_window=64)}
FAMILY_SHAPES = {"gemma3-4b": ("Gemma3TextConfig", GEMMA3_4B), "gpt-oss-20b": ("GptOssConfig", GPT_OSS_20B),
          "glm4-9b": ("Glm4Config", GLM4_9B), "phi4-mini": ("Phi3Config", PHI4_MINI),
          "gemma4-e4b": ("Gemma4TextConfig", GEMMA4_E4B)}
# Layers run by default on the GPU (``--layers`` overrides): each model in well under a minute with its
# checkpoint written; the rest are the full model's.
FAMILY_LAYERS = {"glm4-9b": 8, "phi4-mini": 16, "gemma4-e4b": 12}

def layer_cut(name: str, tiny: bool, layers: str) -> tuple[dict, str]:
    """(config keywords, label) of ``name`` cut to its first N layers: ``layers`` "" (the default cut),
    "all", or N. Gemma 4 keeps its share of KV-shared layers (18 of 42 in E4B), rounded."""
    kw = FAMILY_TINY[name] if tiny else FAMILY_SHAPES[name][1]
    full = kw["num_hidden_layers"]
    n = full if tiny or layers == "all" else int(layers) if layers else FAMILY_LAYERS.get(name, full)
    if not 0 < n <= full:
        sys.exit(f"--layers: {n} is not in 1 .. {full} for {name}")
    if n == full:
        return kw, f"all {full} layers"
    cut = dict(kw, num_hidden_layers=n)
    if "num_kv_shared_layers" in kw:
        cut["num_kv_shared_layers"] = round(kw["num_kv_shared_layers"] * n / full)
    return cut, f"{n} of {full} layers"


def family_config(name: str, tiny: bool, layers: str = ""):
    """(transformers config, layer label)."""
    import transformers as tf

    kw, label = layer_cut(name, tiny, layers)
    return getattr(tf, FAMILY_SHAPES[name][0])(**kw), label


# ------------------------------------------------------------------------------- checkpoints


def fresh_dir(path: Path, stamp: str) -> bool:
    """True when ``path`` holds a checkpoint of this stamp; else empties it for a new one."""
    marker = path / "WRITTEN_BY_GPU_FAMILIES"
    if marker.exists() and marker.read_text() == stamp:
        return True
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return False


def write_hf(cfg, path: Path, dev, dtype) -> str:
    from transformers import AutoModelForCausalLM

    stamp = json.dumps(cfg.to_dict(), sort_keys=True, default=str) + str(dtype)
    if fresh_dir(path, stamp):
        return "reused"
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    hf.save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))
    del hf
    free()
    (path / "WRITTEN_BY_GPU_FAMILIES").write_text(stamp)
    return f"written in {time.perf_counter() - t:.1f} s"


def write_shards(shards: list[dict], path: Path) -> None:
    """``shards`` (one dict of tensors per file) as safetensors files in ``path`` and their index."""
    from safetensors.torch import save_file

    index = {}
    for j, part in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(path / name), metadata={"format": "pt"})
        index.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def gpt_oss_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of gpt-oss as the hub ships it (MXFP4 experts)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    shapes = {}
    for k, v in hf.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, inner, out = v.shape  # transformers' x @ W layout [E, in, out]
            shapes[k + "_blocks"], shapes[k + "_scales"] = (E, out, inner // 32, 16), (E, out, inner // 32)
        else:
            shapes[k] = tuple(v.shape)
    return shapes


def write_gpt_oss(cfg, path: Path, dev, dtype) -> str:
    """The MXFP4 hub layout, every tensor seeded by its index (bench/gpu_families.py's docstring), shards
    of <= 4 GiB."""
    stamp = json.dumps(cfg.to_dict(), sort_keys=True, default=str) + str(dtype)
    if fresh_dir(path, stamp):
        return "reused"
    t = time.perf_counter()
    shards, part, size = [], {}, 0
    for i, (k, shape) in enumerate(sorted(gpt_oss_shapes(cfg).items())):
        g = torch.Generator(dev).manual_seed(i)
        if k.endswith("_blocks"):
            v = torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8)
        elif k.endswith("_scales"):
            v = torch.randint(119, 122, shape, generator=g, device=dev, dtype=torch.uint8)
        elif k.endswith("norm.weight"):
            v = torch.ones(shape, device=dev, dtype=dtype)
        else:
            std = 1.0 if k.endswith("sinks") else 0.02
            v = (torch.randn(shape, generator=g, device=dev) * std).to(dtype)
        part[k] = v.cpu()
        size += v.numel() * v.element_size()
        if size > 4 * GiB:
            shards.append(part)
            part, size = {}, 0
    shards.append(part)
    write_shards(shards, path)
    raw = cfg.to_dict()
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(raw, default=str))
    byte_tokenizer().save_pretrained(str(path))
    (path / "WRITTEN_BY_GPU_FAMILIES").write_text(stamp)
    disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return f"written in {time.perf_counter() - t:.1f} s ({disk / GiB:.1f} GiB)"


# GLM-4.5-Air's shape (``glm4_moe``: 128 experts top-8 + 1 shared, 96 query heads, half-rotary, q/k/v
# bias; 106B parameters in all), the transformers ``Glm4MoeConfig`` arguments
GLM45_AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                 num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1,
                 n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True,
                 use_qk_norm=False, tie_word_embeddings=False)


# Models larger than a machine's disk or host memory, as FP8 blocks: Qwen3-235B-A22B (235B, 22B active;
# 4 GPUs), GLM-4.5 (355B, 32B active; 4 GPUs), DeepSeek-V3 (671B, 37B active: latent attention, 256
# routed experts + 1 shared, top-8 of 8 groups keeping 4, sigmoid router; 8 GPUs). DeepSeek-V3's YaRN
# rotary is left out (the default rotary: the same work a token); "tiny-v3" is its shape cut down
# for a CPU trial of --random-weights (8 heads, 8 experts: every width divisible by 8, so deterministic
# mode runs at TP = EP = 8 as the full shape's does).
BIG_SHAPES = {
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                                               num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                               intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                                               num_experts_per_tok=8, norm_topk_prob=True)),
    "glm-4.5": ("Glm4MoeConfig", {**GLM45_AIR, **dict(hidden_size=5120, intermediate_size=12288,
                                                      moe_intermediate_size=1536, num_hidden_layers=92,
                                                      n_routed_experts=160, first_k_dense_replace=3,
                                                      routed_scaling_factor=2.5, use_qk_norm=True)}),
    "deepseek-v3": ("DeepseekV3Config", dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                             moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                             num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                                             num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5,
                                             norm_topk_prob=True)),
    "tiny-v3": ("DeepseekV3Config", dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
                                         n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                         topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32,
                                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                         routed_scaling_factor=2.5, norm_topk_prob=True)),
}
MOE_SHAPES = {  # transformers config class, its arguments
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "mla": ("DeepseekV3Config", dict(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                                     num_key_value_heads=16, intermediate_size=10944, moe_intermediate_size=1408,
                                     n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1,
                                     topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512,
                                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                     routed_scaling_factor=1.0, norm_topk_prob=False)),
    # a CPU trial of the script itself (gloo workers, float32)
    "tiny": ("Qwen3MoeConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # the largest of these: GLM-4.5-Air (106B; 106 GB as FP8 blocks) spans two GPUs of 80 GB
    "glm-air": ("Glm4MoeConfig", GLM45_AIR),
    # larger than a machine's disk: run with --random-weights (each rank builds its shard on its GPU)
    **BIG_SHAPES,
    # MXFP4 experts as the hub lays them out (``write_gpt_oss``; no --random-weights): 13 / 61 GB
    "gpt-oss-20b": ("GptOssConfig", GPT_OSS_20B),
    "gpt-oss-120b": ("GptOssConfig", GPT_OSS_120B),
    # the hybrid Qwen3.5-MoE (Gated DeltaNet and gated attention, 256 experts top-8 and a shared
    # one; no --random-weights): about 70 GB; "tiny-hybrid" its CPU trial
    "qwen35-35b-a3b": HYBRID_MODELS["qwen35-35b-a3b"],
    "tiny-hybrid": ("Qwen3_5MoeTextConfig", HYBRID_TINY["qwen35-35b-a3b"]),
}


def fp8_entries(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor of the bf16 checkpoint -> what DeepSeek's FP8 checkpoints store for it: each
    projection ``<m>.weight`` as codes and ``<m>.weight_scale_inv``; transformers' stacked experts
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) first split into one
    matrix per expert; anything else (norms, embeddings, routers) as it is.

    >>> sorted(fp8_entries("layers.1.mlp.experts.down_proj", torch.ones(2, 4, 3)))[:2]
    ['layers.1.mlp.experts.0.down_proj.weight', 'layers.1.mlp.experts.0.down_proj.weight_scale_inv']
    """
    base = key.rpartition(".")[0] + "."
    if key.endswith("experts.gate_up_proj"):
        inter = t.shape[1] // 2
        mats = {f"{base}{e}.{p}.weight": t[e, i * inter:(i + 1) * inter]
                for e in range(t.shape[0]) for i, p in enumerate(("gate_proj", "up_proj"))}
    elif key.endswith("experts.down_proj"):
        mats = {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    elif t.dim() == 2 and "_proj" in key:
        mats = {key: t}
    else:
        return {key: t}
    out = {}
    for k, w in mats.items():
        out[k], out[k.removesuffix(".weight") + ".weight_scale_inv"] = fp8_blocks(w)
    return out


def skewed(key: str, t: torch.Tensor, skew: float, hot: int) -> torch.Tensor:
    """A skewed router, as trained ones are (a few experts take much of the load): the router rows
    of the ``hot`` first experts scaled by 1 + ``skew``, so their logits spread wider and they win
    the top-k more often, whatever the hidden rows hold (``skew`` 0: unchanged). On 128 experts,
    top-8, with the 8 first hot: 0.5 gives them about 14% of the slots (the busiest expert 2.4x
    the mean load), 1.0 about 21% (3.4x); the share is measured and printed (``hot_share``). The
    hot experts are consecutive, so one rank holds them all under expert parallelism: the worst
    placement. (An earlier form added a shared direction to the embeddings and hot rows: after a
    few blocks it moved no load, hot_share 0.04-0.06 at 0.05-2.0.)"""
    if not skew or not key.endswith("mlp.gate.weight"):
        return t
    t = t.clone()
    t[:hot] *= 1 + skew
    return t


def moe_config(shape: str, layers: int):
    """The transformers config of ``shape`` (``layers``: fewer decoder layers, 0 = all)."""
    import transformers

    cls, kw = MOE_SHAPES[shape]
    ids = dict(max_position_embeddings=8192, bos_token_id=1, eos_token_id=0)  # unless the shape names its own
    return getattr(transformers, cls)(**{**ids, **kw, **({"num_hidden_layers": layers} if layers else {})})


def write_moe_checkpoint(shape: str, layers: int, path: Path, fp8: bool = False, device: str = "cuda",
                     skew: float = 0.0) -> None:
    """Random bf16 weights (seeded per tensor, made on ``device``), config.json and a byte tokenizer;
    ``fp8``: the same weights as an FP8 block checkpoint (``fp8_entries``); ``skew``: a skewed
    router (``skewed``)."""
    import transformers
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    cfg = moe_config(shape, layers)
    if cfg.model_type == "gpt_oss":  # the hub's MXFP4 layout; --fp8 and --skew are not built for it
        if fp8 or skew:
            raise SystemExit(f"{shape}: --fp8 / --skew are not built for gpt-oss (its experts are MXFP4)")
        write_gpt_oss(cfg, path, device, torch.bfloat16)
        return
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes.update({k: tuple(v.shape) for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    part, size, index = {}, 0, {}

    def save(part: dict) -> None:  # each file written as it fills: a 106B model is never held whole
        name = f"model-{len(set(index.values())):05d}.safetensors"
        save_file(part, str(path / name))
        index.update({k: name for k in part})

    for i, (k, s) in enumerate(sorted(shapes.items())):
        g = torch.Generator(device).manual_seed(i)
        if k.endswith("e_score_correction_bias"):
            t = torch.zeros(s, device=device)
        elif len(s) == 1:
            t = torch.ones(s, device=device)
        else:
            t = torch.randn(s, generator=g, device=device) * 0.02
        t = t.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
        t = skewed(k, t, skew, hot=max(1, s[0] // 16) if k.endswith("mlp.gate.weight") else 0)
        for name, v in (fp8_entries(k, t) if fp8 else {k: t}).items():
            part[name] = v.cpu()
            size += v.numel() * v.element_size()
        if size > 4 << 30:
            save(part)
            part, size = {}, 0
    if part:
        save(part)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg.save_pretrained(str(path))
    if fp8:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}, indent=2))
    byte_tokenizer().save_pretrained(str(path))

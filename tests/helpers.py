"""Test fixtures that make real files: a byte-level tokenizer, tiny random HF models, tiny GGUFs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

VOCAB = 300  # model vocabulary; the byte tokenizer uses the first 258 ids
SPECIALS = ["<|endoftext|>", "<s>"]


def byte_tokenizer():
    """A real byte-level BPE tokenizer with no merges: one token per UTF-8 byte, ids 2..257."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>"), vocab


def tiny_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=0)
    if kind == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama256":  # rows of 256 and 512: whole k-quant super-blocks
        return tf.LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False)
    if kind == "llama3":  # Llama-3 rope scaling, untied
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":  # head_dim 32 != hidden / heads
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if kind == "mistral":  # a sliding window shorter than the test sequences
        return tf.MistralConfig(**common, sliding_window=16, tie_word_embeddings=False)
    if kind == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                             initializer_range=0.1, bos_token_id=1, eos_token_id=0)
    raise ValueError(kind)


def make_hf_dir(path: Path, kind: str, seed: int = 0):
    """Save a tiny random model + byte tokenizer; return the float64 transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager").float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return model.double()


def ref_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Independent reference: full float64 logits -> log_softmax. Row i predicts ids[i + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()  # [L, V]
    return torch.log_softmax(logits / temperature, dim=-1)


def random_sequences(n: int = 5, seed: int = 0, vocab: int = VOCAB, max_prompt: int = 30,
                     max_completion: int = 40) -> list[dict]:
    """Random RL sequences: prompt ids (>= 1 token) and completion ids (>= 1 token) in [2, vocab)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        p = torch.randint(2, vocab, (int(torch.randint(1, max_prompt, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(2, vocab, (int(torch.randint(1, max_completion, (1,), generator=g)),), generator=g).tolist()
        seqs.append({"prompt_token_ids": p, "completion_token_ids": c})
    return seqs


# -- GGUF -----------------------------------------------------------------------------------------

def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert permute of q/k rows (rotate-half -> interleaved RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_blocks(shape: tuple[int, int], name: str, rng) -> np.ndarray:
    """Random bytes laid out as Q4_K / Q6_K super-blocks of a [rows, cols] matrix, with f16 scales
    chosen so weights average about 0.05 (the codes and sub-block scales are arbitrary bytes)."""
    rows, cols = shape
    nb, size = cols // 256, (144 if name == "Q4_K" else 210)
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    lo, hi = (1e-4, 4e-4) if name == "Q4_K" else (2e-5, 1e-4)
    d = rng.uniform(lo, hi, (rows, nb)).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if name == "Q4_K":
        blocks[..., 0:2] = d  # d
        blocks[..., 2:4] = d[:, ::-1]  # dmin
    else:
        blocks[..., 208:210] = d
    return blocks.reshape(rows, nb * size)


def write_tiny_gguf(path: Path, hf_model, qtype_name: str, tie: bool = False) -> dict[str, np.ndarray]:
    """Write the weights of a tiny Llama HF model to GGUF with matrices in ``qtype_name``.

    Returns the dequantized weights (HF names, HF layout), decoded by gguf-py's own dequantizer,
    which is independent of logprobe's.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    cfg = hf_model.config
    qtype = Q[qtype_name]
    _, vocab = byte_tokenizer()
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # one merge (transformers' GGUF tokenizer reader wants at least one), then unused ids
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"] + [f"<unused{i}>" for i in range(VOCAB - len(vocab) - 1)]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(cfg.num_hidden_layers):
        for k, v in per_layer.items():
            names[f"model.layers.{i}.{k}"] = f"blk.{i}.{v}"
    decoded = {}
    rng = np.random.default_rng(0)
    for hf_name, arr in sd.items():
        if hf_name == "lm_head.weight" and tie:
            continue
        name = names[hf_name]
        if name.endswith("attn_q.weight"):
            arr = permute_for_gguf(arr, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            arr = permute_for_gguf(arr, cfg.num_key_value_heads)
        if arr.ndim == 1:  # norms stay F32, as llama.cpp writes them
            w.add_tensor(name, arr.astype(np.float32))
            decoded[hf_name] = sd[hf_name]
            continue
        if qtype_name in ("Q4_K", "Q6_K"):  # gguf-py cannot quantize these: random valid blocks
            data = random_kquant_blocks(arr.shape, qtype_name, rng)
        else:
            data = quants.quantize(arr, qtype) if qtype != Q.F32 else arr.astype(np.float32)
        w.add_tensor(name, data, raw_dtype=qtype)
        deq = quants.dequantize(data, qtype).reshape(arr.shape) if qtype != Q.F32 else arr
        # undo the permute on the decoded copy with an inverse written independently of the loader
        if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
            n = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
            inv = np.argsort(permute_for_gguf(np.arange(arr.shape[0]), n))
            deq = deq[inv]
        decoded[hf_name] = deq
    if tie:
        decoded["lm_head.weight"] = decoded["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def fp8_experts(num: int, hidden: int, inter: int, block: int, g: torch.Generator):
    """``Experts`` of ``num`` experts whose three matrices are random FP8 blocks (codes spread
    over e4m3's range, one scale per ``block`` columns of a row), the packed layout FP8 block
    checkpoints load into."""
    from logprobe.layers.fp8_block_linear import FP8BlockExperts
    from logprobe.layers.moe import Experts

    e = Experts(num, hidden, inter)
    for name, (o, i) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
        q = (torch.randn(num, o, i, generator=g) * 8).to(torch.float8_e4m3fn)
        scale = torch.rand(num, o, -(-i // block), generator=g) / (8 * i**0.5) + 1e-3
        e.set_packed(name, FP8BlockExperts(q, scale, block))
    return e


def skip_old_interpreter() -> None:
    """Skip under a Triton older than 3.9, whose interpreter cannot run the project's kernels
    (``run_interpreted``)."""
    import pytest
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run these kernels (3.9 can)")


def run_interpreted(code: str):
    """Run ``code`` in a fresh Python under Triton's CPU interpreter (``TRITON_INTERPRET=1`` is read
    when kernels are defined, so it cannot be switched on in this process), with tests/ importable.
    Returns the ``subprocess.CompletedProcess`` (stdout/stderr as text). Skips under a Triton older
    than 3.9 (the test extra's pin): 3.6's interpreter cannot run these kernels (a loop bound read as
    a 1-element array), seen on the GPU image, where the CUDA tests check the same kernels."""
    import os
    import subprocess
    import sys

    skip_old_interpreter()
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] + sys.path))
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)


def copy_checkpoint(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of checkpoint directory ``src`` at ``dst``, its config.json and first safetensors shard
    of two passed through the editing callbacks (in place)."""
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        f = dst / "model-00001-of-00002.safetensors"
        tensors = load_file(str(f))
        edit_tensors(tensors)
        save_file(tensors, str(f))
    return dst


# A trainer's process group as SGLang's, vLLM's and OpenRLHF's trainers build it
# (``init_custom_process_group``): the head of the trainer scripts the weight-sync tests run.
TRAINER_GROUP = """
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout):
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
"""


def random_image(h: int, w: int, seed: int):
    """An RGB PIL image of uniform random pixels (seeded), ``h`` x ``w``."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    """``image`` (PIL) encoded as PNG."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def tensor_parallel_matches_one(path, seqs: list[dict], want: dict | None = None, **tp2) -> None:
    """``Scorer(path)`` at TP = 2 (``tp2``: further options of the TP = 2 scorer) against TP = 1 on
    ``seqs`` with top-3 ids and entropies: bitwise in deterministic mode, within 1e-5 otherwise;
    ``want`` {request index: float64 reference log-probs} within 1e-4 at TP = 2. ``tp2`` may hold
    ``max_batch_tokens`` (passes cut to that many rows at TP = 2: chunks against whole requests)."""
    from logprobe import Scorer
    from logprobe.config import EngineConfig

    rows = tp2.pop("max_batch_tokens", None)
    one = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    single = {}
    for det in (True, False):
        one.config = EngineConfig(deterministic=det)
        single[det] = one.logprobs(seqs, top_k=3, entropy=True)
    with Scorer(str(path), device="cpu", dtype="float32", progress=False, tensor_parallel_size=2, **tp2) as scorer:
        for det in (True, False):
            scorer.config = EngineConfig(deterministic=det, **({} if rows is None else {"max_batch_tokens": rows}))
            got = scorer.logprobs(seqs, top_k=3, entropy=True)
            for g, s in zip(got, single[det]):
                if det:
                    assert torch.equal(g.logprobs, s.logprobs) and torch.equal(g.entropy, s.entropy)
                    assert torch.equal(g.topk_ids, s.topk_ids)
                else:
                    assert (g.logprobs - s.logprobs).abs().max() <= 1e-5
            for i, w in (want or {}).items():
                assert (got[i].logprobs.double() - w).abs().max() < 1e-4


def towers_agree_in_row_tiles(rank, one, pixels: torch.Tensor, grid: tuple[int, int, int], monkeypatch) -> list[int]:
    """A tensor-parallel rank's model and the one-rank model in deterministic mode: each embeds
    ``pixels`` of ``grid``, asserted bitwise equal; -> the row tile of every product they ran
    (``layers.linear.tiled_linear`` calls, both models)."""
    from logprobe.config import EngineConfig, numerics_for
    from logprobe.layers import linear

    numerics = numerics_for(EngineConfig(deterministic=True), "cpu")
    for model in (rank, one):
        model.set_numerics(numerics)
    tiles, real = [], linear.tiled_linear
    monkeypatch.setattr(linear, "tiled_linear", lambda *a, **k: tiles.append(a[3]) or real(*a, **k))
    with torch.no_grad():
        assert torch.equal(rank.encode_image(pixels, grid), one.encode_image(pixels, grid))
    return tiles

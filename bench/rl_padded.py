"""RL layouts and weight updates on a GPU: checks and timings (run by hand; issue 20).

    PYTHONPATH=src:tests python bench/rl_padded.py [--rows 256]
    PYTHONPATH=src:tests python bench/rl_padded.py --device cpu --rows 8 --hidden 64 --layers 2   # a smoke run

A random Llama (hidden 1024, 12 layers, vocab 32000, bf16) and a verl-style batch (prompts
left-padded, responses right-padded, random response lengths). Checks, on CUDA input tensors:
``logprobs_padded`` equals ``logprobs`` on the same sequences bitwise (deterministic mode), and
after ``update_weights`` (a stream of the trainer model's bf16 parameters on the GPU) the scores
equal a fresh Scorer's on the new checkpoint bitwise. Times: ``logprobs_padded`` vs transformers'
padded forward + float32 log_softmax + gather (micro-batches of 16 rows), and ``update_weights``.

``--w1 llama-8b`` (or llama-1b) adds the issue's whole-workload figures at the defaults a user gets:
a random-init bf16 model saved once and read by ``Scorer(dir, device="cuda")``; the 256 sequences of
bench/common.py's W1 (32 prompts x 8 completions) as one padded ``[256, P + R]`` batch (prompts
left-padded to P, completions right-padded to R) through ``logprobs_padded``, against
``Scorer.logprobs`` on the same sequences as lists (best of 2 runs each, alternated), with the max
|Δ| between the two; then ``update_weights`` from a state dict in memory (a dict of the trainer's
bf16 CUDA tensors: the whole model) timed with a CUDA sync, and the scores of 8 sequences after it
before and after (a check that it took), and an update back to the first weights (an iterator) that
must give the first scores bitwise.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import torch


def make_model(path: Path, seed: int, device: str, hidden: int, layers: int):
    """A random Llama in bf16 on CUDA (float32 elsewhere), saved with the byte tokenizer."""
    import transformers as tf
    from helpers import byte_tokenizer

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return model


def verl_batch(rows: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P, R = 512, 1024
    plen = torch.randint(64, P + 1, (rows,), generator=g)
    rlen = torch.randint(32, R + 1, (rows,), generator=g)
    col = torch.arange(P + R)
    am = ((col >= P - plen[:, None]) & (col < P + rlen[:, None])).long()  # [rows, P + R]
    ids = torch.randint(2, 32000, (rows, P + R), generator=g) * am
    return ids.to(device), am.to(device), am[:, P:].to(device)


def sequences(ids, am, R):
    out = []
    for b in range(ids.shape[0]):
        real = ids[b][am[b].bool()].tolist()
        n_resp = int(am[b, -R:].sum())
        out.append({"prompt_token_ids": real[:-n_resp], "completion_token_ids": real[-n_resp:]})
    return out


@torch.no_grad()
def hf_padded(model, ids, am, R, micro: int = 16):
    """transformers' way: padded forward, float32 log_softmax over the vocabulary, gather."""
    outs = []
    for i in range(0, ids.shape[0], micro):
        x, m = ids[i:i + micro], am[i:i + micro]
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=x, attention_mask=m, position_ids=pos, use_cache=False).logits[:, -R - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, -R:, None])[..., 0]  # [micro, R]
        outs.append(lp * m[:, -R:])
    return torch.cat(outs)


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def w1_section(shape: str, dev: str) -> None:
    """W1 as a padded batch vs as lists, and update_weights of the whole model (see the docstring)."""
    import sys

    from logprobe import Scorer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import save_model, workload

    path = Path(tempfile.mkdtemp()) / shape
    hf, t_save = timed(lambda: save_model(shape, str(path), dev))  # bf16, 8192 positions (W1 reaches 6,144)
    dtype = next(hf.parameters()).dtype
    s, t_load = timed(lambda: Scorer(str(path), device=dev, progress=False))
    print(f"\n## {shape} W1 at the defaults (Scorer(dir, device={dev!r})): built and saved in {t_save:.1f} s, "
          f"loaded in {t_load:.1f} s, budget {s.config.max_batch_tokens}")
    reqs = workload("W1", hf.config.vocab_size)
    seqs = [{"prompt_token_ids": r.tokens[:r.score_begin], "completion_token_ids": r.tokens[r.score_begin:]}
            for r in reqs]
    P = max(len(q["prompt_token_ids"]) for q in seqs)
    R = max(len(q["completion_token_ids"]) for q in seqs)
    ids = torch.zeros(len(seqs), P + R, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, q in enumerate(seqs):  # [bs, P + R]: prompt ends at column P, completion starts there
        p, c = q["prompt_token_ids"], q["completion_token_ids"]
        ids[b, P - len(p):P + len(c)] = torch.tensor(p + c)
        am[b, P - len(p):P + len(c)] = 1
    ids, am = ids.to(dev), am.to(dev)
    rm = am[:, P:]
    print(f"{len(seqs)} sequences, padded [{ids.shape[0]}, {ids.shape[1]}] ({ids.numel():,} cells), "
          f"{int(am.sum()):,} real tokens, {int(rm.sum()):,} scored")
    s.logprobs(seqs[:8]), s.logprobs_padded(ids[:8], am[:8], rm[:8])  # warm-up of both paths
    t_list, t_pad = [], []
    for _ in range(2):
        lists, t = timed(lambda: s.logprobs(seqs))
        t_list.append(t)
        padded, t = timed(lambda: s.logprobs_padded(ids, am, rm))
        t_pad.append(t)
    d = max(float((padded.logprobs[b, :len(r.logprobs)].cpu() - r.logprobs).abs().max()) for b, r in enumerate(lists))
    print(f"| path | s (best of 2) | tok/s | vs logprobs |\n| --- | ---: | ---: | ---: |\n"
          f"| Scorer.logprobs (lists) | {min(t_list):.2f} | {int(am.sum()) / min(t_list):,.0f} | 1 |\n"
          f"| Scorer.logprobs_padded [{ids.shape[0]}, {ids.shape[1]}] | {min(t_pad):.2f} | "
          f"{int(am.sum()) / min(t_pad):,.0f} | {min(t_pad) / min(t_list):.3f}x |")
    print(f"runs: lists {', '.join(f'{t:.2f}' for t in t_list)}; padded {', '.join(f'{t:.2f}' for t in t_pad)}; "
          f"max |padded - lists| {d:.2e}")
    g = torch.Generator(device=dev).manual_seed(1)  # a trainer's step: each weight moved by 10% of its std
    new = {k: v + 0.002 * torch.randn(v.shape, generator=g, device=dev, dtype=v.dtype) for k, v in hf.state_dict().items()}
    before = s.logprobs_padded(ids[:8], am[:8], rm[:8]).logprobs
    version, t_upd = timed(lambda: s.update_weights(new))
    after = s.logprobs_padded(ids[:8], am[:8], rm[:8]).logprobs
    n = sum(v.numel() for v in new.values())
    print(f"update_weights ({n / 1e9:.2f}B {dtype} params, a dict of {dev} tensors): {t_upd:.2f} s, version {version}; "
          f"scores moved: mean |Δ| {float((after - before).abs().mean()):.3f}")
    again, t_iter = timed(lambda: s.update_weights(iter(list(hf.state_dict().items()))))
    back = s.logprobs_padded(ids[:8], am[:8], rm[:8]).logprobs
    print(f"update_weights back to the first weights (an iterator, staged): {t_iter:.2f} s, version {again}; "
          f"scores == before the first update: {torch.equal(back, before)}")


def main() -> None:
    from logprobe import Scorer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--w1", default=None, help="also W1 padded vs lists and update_weights at this shape "
                    "(llama-1b, llama-8b; tiny with --device cpu for a smoke run)")
    ap.add_argument("--w1-only", action="store_true", help="skip the small-model checks")
    args = ap.parse_args()
    if args.w1:
        w1_section(args.w1, args.device)
        if args.w1_only:
            return
    dev, dt = args.device, "bfloat16" if args.device == "cuda" else "float32"
    tmp = Path(tempfile.mkdtemp())
    model_a = make_model(tmp / "a", 1, dev, args.hidden, args.layers)
    ids, am, rm = verl_batch(args.rows, dev)
    R = rm.shape[1]
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"{name}: {args.rows} rows, {int(am.sum())} real tokens, {int(rm.sum())} scored, "
          f"padded {ids.numel()}")
    s = Scorer(str(tmp / "a"), device=dev, dtype=dt, deterministic=True, progress=False)
    s.logprobs_padded(ids[:4], am[:4], rm[:4])  # warm-up
    out, t_pad = timed(lambda: s.logprobs_padded(ids, am, rm))
    seqs = sequences(ids, am, R)
    ref = s.logprobs(seqs)
    same = all(torch.equal(out.logprobs[b, :len(r.logprobs)].cpu(), r.logprobs) for b, r in enumerate(ref))
    print(f"logprobs_padded (deterministic): {t_pad:.2f} s, on {out.logprobs.device}; bitwise == logprobs: {same}")
    fast = Scorer(str(tmp / "a"), device=dev, dtype=dt, progress=False)
    fast.logprobs_padded(ids[:4], am[:4], rm[:4])
    out_fast, t_fast = timed(lambda: fast.logprobs_padded(ids, am, rm))
    print(f"logprobs_padded (default mode): {t_fast:.2f} s")
    hf_padded(model_a, ids[:4], am[:4], R)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    hf, t_hf = timed(functools.partial(hf_padded, model_a, ids, am, R))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
    diff = (hf - out_fast.logprobs).abs()
    print(f"transformers padded, micro-batch 16: {t_hf:.2f} s, {peak:.1f} GiB extra; |logprobe - transformers| "
          f"mean {float(diff.sum() / rm.sum()):.2e} max {float(diff.max()):.2e} ({dt} both)")
    del model_a
    model_b = make_model(tmp / "b", 2, dev, args.hidden, args.layers)
    version, t_upd = timed(lambda: s.update_weights(iter(list(model_b.named_parameters()))))
    fresh = Scorer(str(tmp / "b"), device=dev, dtype=dt, deterministic=True, progress=False)
    after = s.logprobs_padded(ids[:32], am[:32], rm[:32]).logprobs
    want = fresh.logprobs_padded(ids[:32], am[:32], rm[:32]).logprobs
    n = sum(p.numel() for p in model_b.parameters())
    print(f"update_weights ({n / 1e6:.0f}M {dt} params, a stream on {dev}): {t_upd:.3f} s, version {version}; "
          f"scores == fresh Scorer bitwise: {torch.equal(after, want)}")


if __name__ == "__main__":
    main()

"""First-call cost on the GPU (issue 19: "first-call compile/autotune time reported and kept below
10 s, or cached on disk"): what a user waits for before the first answer, with Triton's kernel cache
empty and then warm.

A random-init Llama of the chosen shape is saved once (bf16 safetensors, ``save_pretrained``). Then,
each in a fresh Python process (what a new ``logprobe`` command or server start is):

* ``load``: ``Scorer(dir, device="cuda")`` (read and place the weights);
* ``first``: the first ``Scorer.logprobs`` call on 8 RL sequences (compiles every Triton kernel the
  call meets, sets up cuBLAS and FlashAttention);
* ``second``: the same call again (the steady state);
* first - second: the one-off cost.

Runs: ``cold`` (an empty ``TRITON_CACHE_DIR``), ``warm`` (the cache the cold run filled), for the
default mode and ``--deterministic``.

    python bench/gpu_first_call.py                     # llama-1b shape
    python bench/gpu_first_call.py --model llama-8b
    python bench/gpu_first_call.py --model tiny --device cpu   # smoke run of the script on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}

CHILD = r"""
import json, random, sys, time
import torch
from logprobe import Scorer
path, det, dev, vocab = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
t0 = time.perf_counter()
s = Scorer(path, device=dev, deterministic=det)
sync()
t1 = time.perf_counter()
rng = random.Random(0)
seqs = []
for _ in range(8):
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(256, 1024))]
    seqs.append({"prompt_token_ids": prompt, "completion_token_ids": [rng.randrange(3, vocab) for _ in range(300)]})
a = s.logprobs(seqs, top_k=5, entropy=True)
sync()
t2 = time.perf_counter()
b = s.logprobs(seqs, top_k=5, entropy=True)
sync()
t3 = time.perf_counter()
same = all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
print(json.dumps({"load": t1 - t0, "first": t2 - t1, "second": t3 - t2, "same": same,
                  "budget": s.config.max_batch_tokens}))
"""


def save_model(shape: str, path: str, device: str):
    """The random bf16 model of ``shape`` (seed 0) saved to ``path`` with a byte tokenizer; returned."""
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, initializer_range=0.02,
                         torch_dtype="bfloat16", max_position_embeddings=8192)  # W1 rows reach 6,144 ids
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    # a byte-level tokenizer is enough: the bench passes token ids
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)} | {"<s>": 256, "</s>": 257}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return model.eval()


def child(path: str, det: bool, cache: str, device: str, vocab: int) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, path, "1" if det else "0", device, str(vocab)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --model tiny)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "model")
        t = time.perf_counter()
        save_model(args.model, path, args.device)
        print(f"{args.model}: saved in {time.perf_counter() - t:.1f} s", flush=True)
        rows = []
        for det in (False, True):
            cache = os.path.join(root, f"triton-{int(det)}")
            for run in ("cold", "warm"):
                r = child(path, det, cache, args.device, SHAPES[args.model]["vocab_size"])
                rows.append((run, "deterministic" if det else "default", r))
                print(run, det, r, flush=True)
    print("\n| run | mode | load s | first call s | second call s | one-off s | budget | same bits |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for run, mode, r in rows:
        print(f"| {run} | {mode} | {r['load']:.2f} | {r['first']:.2f} | {r['second']:.2f} | "
              f"{r['first'] - r['second']:.2f} | {r['budget']} | {r['same']} |")


if __name__ == "__main__":
    main()

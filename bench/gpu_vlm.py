"""Text scored given images: logprobe against transformers on a Qwen3.5 vision-language shape, on
an RL workload of groups that share their images and prompt.

The checkpoint (random init, bf16, written once under ``--dir`` with ``save_pretrained``):
``Qwen3_5ForConditionalGeneration`` with the text config of ``--text`` (bench/common.py
HYBRID_MODELS; qwen35-4b by default) and Qwen3.5's vision tower (``VISION``: 24 blocks of 1024,
patch 16, merged 2 x 2 into the text width), a byte tokenizer holding the vision tokens and a
``Qwen2VLImageProcessor`` (patch 16, merge 2, 448-1024 px images kept at their size).

The workload (``vlm_workload``, seeded): ``--groups`` groups of ``--group-size`` requests; a
group's requests share 1-4 random RGB images of 448-1024 px a side (multiples of 32) and a prompt
of 256-2048 random text token ids (each image's token once, spread through it), and each has its
own completion of 16-2048 ids. The images are PIL images, handed as they are to both.

Rows (same token ids, same images):
  1  logprobe at the defaults: ``Scorer(dir, device="cuda").logprobs(seqs)`` (the images read by
     the checkpoint's own image processor inside the call: counted)
  2  the same in deterministic mode (bitwise pass to pass is checked)
  3  transformers with fla-core: per group, the processor's pixel values and grids once, then the
     group's requests as one right-padded batch (the images' pixel values repeated per row, as a
     padded batch must), ``model(input_ids, attention_mask, pixel_values, image_grid_thw,
     mm_token_type_ids).logits`` -> float32 log_softmax -> the completion's log-probs; processing
     counted too

Each row: best of ``--passes`` after one warm-up pass on the first group; seconds, input tokens/s
(image tokens counted), speed-up of rows 1-2 against row 3, max / mean |Δ log-prob| against row 1,
peak GPU memory above the weights.

    python bench/gpu_vlm.py --groups 8                 # 64 requests: about 2 minutes on one H200
    python bench/gpu_vlm.py                            # the whole 256 (32 groups of 8)
    python bench/gpu_vlm.py --text tiny --device cpu --groups 2 --group-size 2 --small  # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HYBRID_MODELS, byte_tokenizer, hf_config, log  # noqa: E402

VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
              num_position_embeddings=2304, spatial_merge_size=2, temporal_patch_size=2)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                   num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_checkpoint(path: Path, text: str, device: str) -> int:
    """The VL checkpoint of text shape ``text`` (``tiny``: a CPU smoke shape) and its processor
    files; returns the image token id. Kept when ``path`` already holds it."""
    import transformers as tf

    done = path / "ids.json"
    if done.exists():
        return json.loads(done.read_text())["image"]
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in TOKENS}
    tiny = text == "tiny"
    _, text_cfg = hf_config("qwen35-4b" if tiny else text, tiny, None)
    vision = dict(TINY_VISION if tiny else VISION, out_hidden_size=text_cfg.hidden_size)
    cfg = tf.Qwen3_5Config(text_config=text_cfg.to_dict(), vision_config=vision,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = tf.Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=dtype)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    patch = vision["patch_size"]
    processor = getattr(tf, "Qwen2VLImageProcessorPil", None) or tf.Qwen2VLImageProcessor  # no torchvision needed
    processor(patch_size=patch, merge_size=2, temporal_patch_size=2,
              size={"shortest_edge": (2 * patch) ** 2, "longest_edge": 1024 * 1024}).save_pretrained(str(path))
    del model
    done.write_text(json.dumps({"image": ids["<|image_pad|>"], "vocab": text_cfg.vocab_size}))
    return ids["<|image_pad|>"]


def vlm_workload(groups: int, size: int, vocab: int, image_id: int, small: bool, seed: int = 0) -> list[dict]:
    """``groups`` x ``size`` sequences: each group's images (1-4, 448-1024 px a side in steps of 32;
    ``small``: 32-64 px) and prompt ids (256-2048, the image token once per image) shared, each
    completion its own (16-2048 ids)."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        images = []
        for _ in range(rng.randint(1, 4)):
            h, w = ((rng.randrange(32, 65, 32), rng.randrange(32, 65, 32)) if small else
                    (rng.randrange(448, 1025, 32), rng.randrange(448, 1025, 32)))
            px = np.random.default_rng(seed * 1000 + g * 10 + len(images)).integers(0, 256, (h, w, 3), dtype=np.uint8)
            images.append(Image.fromarray(px))
        n = rng.randint(16, 64) if small else rng.randint(256, 2048)
        prompt = [rng.randrange(300, vocab) for _ in range(n)]
        for k, at in enumerate(sorted(rng.sample(range(1, n), len(images)))):
            prompt.insert(at + k, image_id)
        for _ in range(size):
            m = rng.randint(4, 16) if small else rng.randint(16, 2048)
            out.append({"prompt_token_ids": prompt, "completion_token_ids": [rng.randrange(300, vocab) for _ in range(m)],
                        "images": images})
    return out


def expanded(seq: dict, grids: list[tuple[int, int, int]], image_id: int) -> list[int]:
    """The prompt ids with each image token expanded to its image's t * h * w / 4 tokens.

    >>> expanded({"prompt_token_ids": [5, 9, 6, 9]}, [(1, 4, 4), (1, 2, 4)], 9)
    [5, 9, 9, 9, 9, 6, 9, 9]
    """
    out, k = [], 0
    for t in seq["prompt_token_ids"]:
        if t == image_id:
            a, h, w = grids[k]
            out += [image_id] * (a * h * w // 4)
            k += 1
        else:
            out.append(t)
    return out


def transformers_pass(model, processor, seqs: list[dict], size: int, image_id: int, dev: str,
                      progress: bool = False) -> list[torch.Tensor]:
    """Row 3: each group's images processed once, its requests one right-padded batch
    (``progress``: each group's seconds logged, to see the rate of a pass cut short)."""
    out, t0 = [], time.perf_counter()
    for g in range(0, len(seqs), size):
        if progress:
            log(f"  transformers group {g // size}: {time.perf_counter() - t0:.1f} s into the pass")
        group = seqs[g:g + size]
        px = processor(images=group[0]["images"], return_tensors="pt")
        grids = [tuple(x) for x in px["image_grid_thw"].tolist()]
        prompt = expanded(group[0], grids, image_id)
        rows = [prompt + s["completion_token_ids"] for s in group]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=dev)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=dev)
        pixel = px["pixel_values"].to(dev, model.dtype).repeat(len(group), 1)
        grid = px["image_grid_thw"].repeat(len(group), 1).to(dev)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixel, image_grid_thw=grid,
                           mm_token_type_ids=(ids == image_id).int(), use_cache=False).logits
        n = len(prompt)
        for i, s in enumerate(group):
            c = torch.tensor(s["completion_token_ids"], device=dev)
            lp = torch.log_softmax(logits[i, n - 1:n - 1 + len(c)].float(), -1)
            out.append(lp.gather(1, c[:, None])[:, 0].cpu())
        del logits
    return out


def timed(fn, passes: int, dev: str, each: bool = False):
    """Best of ``passes`` calls (``each``: every pass's seconds logged) -> (seconds, last result)."""
    best, result = float("inf"), None
    for i in range(passes):
        torch.cuda.synchronize() if dev == "cuda" else None
        t = time.perf_counter()
        result = fn()
        torch.cuda.synchronize() if dev == "cuda" else None
        best = min(best, time.perf_counter() - t)
        if each:
            log(f"  pass {i + 1}: {time.perf_counter() - t:.2f} s")
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="qwen35-4b", help=f"text shape: {sorted(HYBRID_MODELS)} or tiny")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/logprobe-vlm"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="32-64 px images, short texts (a smoke run)")
    ap.add_argument("--rows", default="default,deterministic,transformers",
                    help="which rows to run (a comma list; the ratio column needs transformers)")
    ap.add_argument("--profile", action="store_true", help="one more default pass under torch.profiler: top ops")
    args = ap.parse_args()
    wanted = set(args.rows.split(","))
    import transformers as tf

    from logprobe import Scorer

    dev = args.device
    path = args.dir / f"{args.text}-vl"
    t = time.perf_counter()
    image_id = write_checkpoint(path, args.text, dev)
    vocab = json.loads((path / "ids.json").read_text())["vocab"]
    log(f"checkpoint {path} ({time.perf_counter() - t:.1f} s)")
    seqs = vlm_workload(args.groups, args.group_size, vocab, image_id, args.small)
    rows = {}
    scorer = Scorer(str(path), device=dev, progress=False)
    for mode in ("default", "deterministic"):
        if mode not in wanted:
            continue
        scorer.config = type(scorer.config)(progress=False, deterministic=mode == "deterministic")
        first, _ = timed(lambda: scorer.logprobs(seqs[:args.group_size]), 1, dev)  # warm-up: the first group
        secs, res = timed(lambda: scorer.logprobs(seqs), args.passes, dev, each=True)
        rows[mode] = (secs, [r.logprobs.float().cpu() for r in res])
        log(f"logprobe {mode}: {secs:.2f} s (warm-up group {first:.2f} s)")
    if args.profile:
        profile(lambda: scorer.logprobs(seqs), dev)
    processor = tf.AutoImageProcessor.from_pretrained(str(path))
    grids = [tuple(x) for s in seqs[::args.group_size]
             for x in processor(images=s["images"], return_tensors="pt")["image_grid_thw"].tolist()]
    tokens = sum(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) - len(s["images"]) for s in seqs) + \
        args.group_size * sum(a * h * w // 4 for a, h, w in grids)
    scorer = None  # frees its weights before transformers loads (a del would unbind the closures above)
    gc.collect()
    torch.cuda.empty_cache() if dev == "cuda" else None
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if "transformers" in wanted:
        model = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=dtype, device_map=dev).eval()
        first, _ = timed(lambda: transformers_pass(model, processor, seqs[:args.group_size], args.group_size,
                                                   image_id, dev), 1, dev)  # warm-up
        log(f"transformers warm-up group: {first:.2f} s")
        secs, res = timed(lambda: transformers_pass(model, processor, seqs, args.group_size, image_id, dev, True),
                          args.passes, dev, each=True)
        rows["transformers"] = (secs, res)
        log(f"transformers: {secs:.2f} s")
    table(rows, seqs, tokens, args.text, dev)


def table(rows: dict, seqs: list[dict], tokens: int, text: str, dev: str) -> None:
    """The rows as a markdown table (ratios only where transformers ran; diffs against the first row)."""
    ref = next(iter(rows.values()))[1]
    base = rows.get("transformers", (None,))[0]
    print(f"\n{len(seqs)} requests, {tokens} input tokens (image tokens included), {text} + vision tower, {dev}")
    print(f"| row | s | tokens/s | × transformers | max / mean abs diff against {next(iter(rows))} |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, (secs, lps) in rows.items():
        d = torch.cat([(a - b).abs() for a, b in zip(lps, ref)])
        ratio = f"{base / secs:.2f}" if base is not None else "-"
        print(f"| {name} | {secs:.2f} | {tokens / secs:,.0f} | {ratio} | {float(d.max()):.3g} / {float(d.mean()):.3g} |")


def profile(fn, dev: str) -> None:
    """One pass under torch.profiler: its wall time and the top ops by device (or CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with prof(activities=acts) as p:
        secs, _ = timed(fn, 1, dev)
    key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
    ops = p.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1e6
    print(f"\nprofiled default pass: {secs:.2f} s, device busy {busy:.2f} s")
    print(ops.table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(ops.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()

"""``logprobe compare``: quantization quality of --model against --reference (a thin shell over
``scoring.compare.compare_models``, what ``Scorer.compare`` runs, asked for both models' top-k
alternatives when ``--html`` shows them)."""

from __future__ import annotations

import argparse
import json
import time

from ..errors import LogprobeError
from ..loading import load_model
from ..scorer import Scorer
from ..scoring.compare import compare_models, kl_plot_html
from .common import ScorerOptions, read_text
from .mismatch import add_mismatch_args, cmd_mismatch
from .report import add_html_option, check_html, compare_html, compare_top_k, window_options


def add_window_args(p: argparse.ArgumentParser, policy_help: str, max_tokens_help: str,
                    text_required: bool = True) -> None:
    """The text and window options shared by ``perplexity`` and ``compare`` (llama.cpp's -f and
    -c/--ctx-size are aliases)."""
    p.add_argument("--text-file", "-f", required=text_required, metavar="FILE", help="UTF-8 text file; - reads stdin")
    p.add_argument("--context-length", "--ctx-size", "-c", type=int, default=None, metavar="N",
                   help="tokens per window (default: min(2048, the model's context))")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="sliding policy: tokens between window starts (default: context length / 4)")
    p.add_argument("--policy", choices=["sliding", "llama.cpp", "rolling"], default="sliding", help=policy_help)
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help=max_tokens_help)


def add_compare_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "compare", parents=[common], help="quantization quality: --model (Q) against --reference (R) on one text",
        description="Run both models on the same windows of the same token ids and report PPL(Q), PPL(R), their "
                    "ratio, KL(R || Q) over the full vocabulary (mean ± stderr, max, percentiles), how often the "
                    "top token agrees and Δp = p_Q(target) - p_R(target), like llama.cpp's --kl-divergence.",
        epilog="Both models must share a tokenizer and vocabulary (e.g. two quantizations of one model).")
    p.add_argument("--reference", default=None, metavar="R",
                   help="the reference model: a known name, a .gguf file or a Hugging Face directory")
    add_window_args(p, "window policy, as for `perplexity` (default: %(default)s)", "compare only the first N tokens",
                    text_required=False)
    p.add_argument("--no-prefix", action="store_true", help="do not put BOS before the text")
    p.add_argument("--weights", choices=["packed", "dense"], default="packed",
                   help="quantized weights of both models: packed in memory, expanded per layer inside the "
                        "matmul (default), or expanded once at load (faster, 4-8x the memory)")
    p.add_argument("--plot", default=None, metavar="FILE.html",
                   help="also write a self-contained HTML page plotting per-token KL along the text")
    add_html_option(p)
    add_mismatch_args(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    if args.logprobs_from is not None:
        if args.reference is not None:
            raise LogprobeError("--logprobs-from", "compares --model with a file's log-probs, not with --reference",
                                "give one of --reference and --logprobs-from")
        return cmd_mismatch(args, args.make_scorer(args))  # the model as every command loads it (TP/DP too)
    if args.reference is None or args.text_file is None:
        raise LogprobeError("--reference" if args.reference is None else "--text-file", "is required",
                            "give --reference R --text-file FILE (or --logprobs-from FILE)")
    check_html(args)
    text = read_text(args.text_file, "--text-file")
    if not text.strip():
        raise LogprobeError("--text-file", "is empty (no text to score)", "give a file with some text")
    if args.tensor_parallel_size != 1 or args.data_parallel_size != 1 or args.expert_parallel_size not in (None, 1):
        raise LogprobeError("--tensor-parallel-size", "compare runs both models in this process",
                            "drop --tensor-parallel-size / --data-parallel-size / --expert-parallel-size")
    options = ScorerOptions.from_args(args)
    config = options.engine_config()  # every model option, as every other command reads them
    q = Scorer(load_model(options.model, options.device, options.dtype, weights=args.weights), config=config,
               cache=options.cache)
    r = Scorer(load_model(args.reference, options.device, options.dtype, weights=args.weights), config=config,
               cache=options.cache)
    start = time.perf_counter()
    w = window_options(args)
    res = compare_models(q.context, q.engine, r.context, r.engine, text, w,
                         return_token_stats=args.plot is not None or args.html is not None, top_k=compare_top_k(args))
    elapsed = time.perf_counter() - start
    compare_html(args, q, r, text, res)
    if args.plot is not None:
        page = kl_plot_html(res.token_kl, f"KL(R || Q): Q = {q.info.name}, R = {r.info.name}", res.report())
        try:
            with open(args.plot, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as e:
            raise LogprobeError("--plot", f"cannot write {args.plot}: {e.strerror}", "give a writable path") from e
    if args.json:
        d = res.to_dict()
        for k in ("token_kl", "token_logprobs_q", "token_logprobs_r", "token_top_q", "token_top_r"):
            d.pop(k, None)
        d.update(model=q.info.name, reference=r.info.name, elapsed_s=elapsed)
        print(json.dumps(d))
        return 0
    print(f"Q: {q.info.name} ({q.info.backend}, {q.info.device}, {q.info.dtype})")
    print(f"R: {r.info.name} ({r.info.backend}, {r.info.device}, {r.info.dtype})")
    print(res.report())
    print(f"\n{2 * res.num_tokens / elapsed:.0f} tokens/s over both models ({elapsed:.2f} s)")
    return 0

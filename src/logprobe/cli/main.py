"""``logprobe``: score continuations, measure perplexity, and stream RL log-probs from the shell.

    logprobe score "The capital of France is" Paris London Berlin
    logprobe perplexity --text-file wiki.txt --context-length 1024
    logprobe logprobs --input rollouts.jsonl --output logprobs.jsonl
    logprobe serve --port 8000

Exit codes: 0 ok; 1 some ``logprobs`` input lines failed (each reported as ``line N: ...``);
2 bad usage, bad input or unusable model (one line ``logprobe: error: ...``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

import torch

from .. import __version__
from ..config import EngineConfig
from ..engine.runner import Engine, RunStopped
from ..errors import LogprobeError
from ..io.jsonsafe import dumps
from ..loading import LoadedModel, load_model
from ..scorer import Scorer
from .compare import add_window_args

PROG = "logprobe"
BLOCK_LINES = 64  # logprobs: input lines scored per engine run, so results reach the file incrementally

# Loaded models, by (model, device, dtype): one process (a test session) loads each model once.
_MODELS: dict[tuple[str | None, str, str], LoadedModel] = {}


def get_scorer(model: str | None = None, device: str = "auto", dtype: str = "auto",
               max_batch_tokens: int = 8192, deterministic: bool = False, tensor_parallel_size: int = 1,
               data_parallel_size: int = 1, tp_invariant: bool = True) -> Scorer:
    """A Scorer on a cached loaded model: the same weights the CLI uses within this process
    (parallel scorers own worker processes and are not cached)."""
    # validates before the slow load
    config = EngineConfig(max_batch_tokens=max_batch_tokens, deterministic=deterministic, tp_invariant=tp_invariant)
    if tensor_parallel_size != 1 or data_parallel_size != 1:
        return Scorer(model, device=device, dtype=dtype, config=config, tensor_parallel_size=tensor_parallel_size,
                      data_parallel_size=data_parallel_size)
    key = (model, device, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(model, device, dtype)
    return Scorer(_MODELS[key], config=config)


# -- argument parsing ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and output")
    g.add_argument("--model", default=None,
                   help="a known name (default: smollm2-135m), a .gguf file, or a Hugging Face model directory")
    g.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    g.add_argument("--max-batch-tokens", type=int, default=8192, metavar="N",
                   help="token budget of one forward pass (default: %(default)s); lower it if memory runs out")
    g.add_argument("--deterministic", "--batch-invariant", dest="deterministic", action="store_true",
                   help="bitwise-identical numbers whatever shares a batch, its order, budget, chunking or "
                        "prefix sharing (native models; slower, see docs/perf.md)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (GPUs, or gloo processes on CPU); worker processes are "
                        "started and owned by logprobe (default: %(default)s)")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=1, metavar="M",
                   help="M replicas (each of --tensor-parallel-size ranks) sharing the requests (default: %(default)s)")
    g.add_argument("--no-tp-invariant", dest="tp_invariant", action="store_false",
                   help="with --deterministic: bitwise repeatable at this tensor-parallel size only, not the same bits "
                        "at every size (cheaper; see docs/perf.md)")
    g.add_argument("--json", action="store_true", help="machine-readable JSON on stdout instead of a table/report")

    head = argparse.ArgumentParser(add_help=False)
    h = head.add_argument_group("scoring options")
    h.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="score log_softmax(logits / T) (default: %(default)s)")
    h.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="also report the K most likely tokens at each scored position (default: 0)")
    h.add_argument("--entropy", action="store_true", help="also report the entropy of each position's distribution")
    hk = argparse.ArgumentParser(add_help=False)
    k = hk.add_argument_group("hidden states (native models)")
    k.add_argument("--steer", default=None, metavar="JSON",
                   help='steering entries, a JSON list or @FILE: [{"at": "blocks.10.resid_post", "vector": '
                        '"v.gguf" | [..] | {layer: [..]}, "coeff": 4, "positions": "all", "op": "add"}]')
    k.add_argument("--capture", default=None, metavar="JSON",
                   help='capture entries, a JSON list or @FILE: [{"at": "blocks.*.resid_post", "positions": '
                        '"last", "reduce": "none"}] (results in --json output)')

    parser = argparse.ArgumentParser(
        prog=PROG, description="Exact log-probabilities of given text under a language model.",
        epilog="Exit codes: 0 ok, 1 some logprobs lines failed, 2 bad usage/input/model, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "score", parents=[common, head, hk], help="log-probability of each continuation after a prompt",
        description="Score each continuation after PROMPT and print them most likely first.",
        epilog="Joining: unless PROMPT ends with whitespace or a continuation starts with whitespace, "
               "--join is put between them, so `score \"The capital of France is\" Paris` scores \" Paris\" "
               "(the token a model actually sees after a word). Use --join '' to score the text as given.")
    p.add_argument("prompt", metavar="PROMPT", help="the context (may be empty)")
    p.add_argument("continuations", metavar="CONT", nargs="+",
                   help="continuations to score (--json lists them in this order, the table most likely first)")
    p.add_argument("--join", default=" ", metavar="STR",
                   help="put between PROMPT and each CONT unless either side already has whitespace there "
                        "(default: a space, so Paris is scored as ' Paris')")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser(
        "perplexity", parents=[common, hk], help="perplexity of a text file",
        description="Token perplexity (± standard error), word and byte perplexity and bits per byte of a text.",
        epilog="Policies: 'sliding' scores every token once with up to CONTEXT - STRIDE tokens of extra context "
               "(Hugging Face guide); 'rolling' is lm-eval's loglikelihood_rolling (disjoint windows, each with a "
               "full context; lm-eval's max_length L = --context-length L-1); 'llama.cpp' scores the second half of non-overlapping "
               "chunks, like llama-perplexity.")
    add_window_args(p, "window policy (default: %(default)s)",
                    "score only the first N tokens (word/byte perplexity are then not reported)")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not put BOS before the text (by default the sliding policy does, so the first "
                        "token is scored too)")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser(
        "logprobs", parents=[common, head, hk], help="per-token log-probs of RL sequences, JSONL in -> JSONL out",
        description="Stream per-token log-probs of completions. Each input line is "
                    '{"prompt_token_ids": [...], "completion_token_ids": [...]} with optional "id" (echoed; null when absent), '
                    '"temperature", "top_k", "entropy", "steer" and "capture" (override the options). Each output line is '
                    '{"index": <0-based input line>, "id": ..., "logprobs": [...], "sum_logprob": ..., '
                    '"is_greedy": [...]} (+ "entropy", "top_k_ids", "top_k_logprobs", "captures" when asked), '
                    "written as each batch completes, not in input order. Captures with reduce 'none' go to "
                    "safetensors side files in --capture-dir, referenced from the line by file and key.",
        epilog="Resume: if --output exists, lines already there are skipped and the rest appended (a truncated "
               "last line is removed first), so rerunning an interrupted command finishes it. Bad lines are "
               "reported as 'line N: ...' on stderr, not written, and make the exit code 1; fix them and rerun.")
    p.add_argument("--input", required=True, metavar="FILE", help="JSONL input; - reads stdin")
    p.add_argument("--output", required=True, metavar="FILE", help="JSONL output (appended to / resumed)")
    p.add_argument("--capture-dir", default=None, metavar="DIR",
                   help="where reduce 'none' captures are written, one INDEX.safetensors per line "
                        "(default: OUTPUT.captures/)")
    p.set_defaults(func=cmd_logprobs)

    p = sub.add_parser(
        "train-vector", parents=[common], help="a steering/reading vector from contrasting prompts",
        description="Capture the last-token residual stream (blocks.L.resid_post) of each positive and negative "
                    "prompt and write one direction per layer as a control-vector GGUF (llama.cpp --control-vector, "
                    "repeng) or safetensors.")
    p.add_argument("--positive", required=True, metavar="FILE", help="one prompt per line")
    p.add_argument("--negative", required=True, metavar="FILE", help="one prompt per line (paired with --positive)")
    p.add_argument("--layers", default=None, metavar="A:B",
                   help="layers, as a hook selector's layer part (e.g. 8:20, *, 12); default 1..L-1")
    p.add_argument("--method", choices=["pca_diff", "mean_diff"], default="pca_diff")
    p.add_argument("--output", required=True, metavar="FILE", help="a .gguf or .safetensors file")
    p.set_defaults(func=cmd_train_vector)

    from .serve import add_serve_parser  # the server's options live with the server command

    add_serve_parser(sub, common)
    from .compare import add_compare_parser

    add_compare_parser(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script passes it to sys.exit)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LogprobeError as e:
        return _fail(str(e))
    except OSError as e:  # a file we were given could not be read or written
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")
    except torch.OutOfMemoryError:
        return _fail("out of memory; lower --max-batch-tokens (or use a smaller --dtype / another --device)")
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)  # one line, always
    return 2


def _scorer(args: argparse.Namespace) -> Scorer:
    return get_scorer(args.model, args.device, args.dtype, args.max_batch_tokens, args.deterministic,
                      args.tensor_parallel_size, args.data_parallel_size, args.tp_invariant)


# -- score -----------------------------------------------------------------------------------------


def join_continuation(prompt: str, continuation: str, join: str) -> str:
    """``join + continuation`` unless the prompt ends or the continuation starts with whitespace."""
    if not prompt or not continuation or prompt[-1].isspace() or continuation[0].isspace():
        return continuation
    return join + continuation


def cmd_score(args: argparse.Namespace) -> int:
    Scorer._options(args.temperature, args.top_k)  # fail before loading the model
    scorer = _scorer(args)
    conts = [join_continuation(args.prompt, c, args.join) for c in args.continuations]
    results = scorer.score(args.prompt, conts, temperature=args.temperature, top_k=args.top_k,
                           entropy=args.entropy, steer=_json_option(args.steer, "--steer"),
                           capture=_json_option(args.capture, "--capture"))
    if args.json:
        print(dumps([r.to_dict() for r in results], compact=False))
        return 0
    ranked = sorted(results, key=lambda r: -r.log_prob)
    header = ["continuation", "tokens", "log_prob", "prob", "ppl", "greedy"]
    rows = [[_short(repr(r.continuation)), str(r.num_tokens), f"{r.log_prob:.4f}", f"{r.prob:.4g}",
             f"{r.perplexity:.4g}", "yes" if r.is_greedy else "no"] for r in ranked]
    if args.entropy:
        header.append("entropy")
        rows = [row + [f"{math.fsum(r.entropy) / len(r.entropy):.4f}"] for row, r in zip(rows, ranked, strict=True)]
    print(_table(header, rows, left={0}))
    if args.top_k:
        print()
        for r in ranked:
            print(f"{_short(repr(r.continuation))} top-{args.top_k} per token:")
            for tok, lp, alts in zip(r.tokens, r.token_logprobs, r.top_k, strict=True):
                choices = ", ".join(f"{t!r} {a:.3f}" for _, t, a in alts)
                print(f"  {tok!r} {lp:.3f}  <-  {choices}")
    return 0


def _short(s: str, width: int = 40) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def _table(header: list[str], rows: list[list[str]], left: set[int]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# -- perplexity ------------------------------------------------------------------------------------


def _read_text(path: str, option: str) -> str:
    try:
        if path == "-":
            raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
            name = "stdin"
        else:
            with open(path, "rb") as f:
                raw = f.read()
            name = repr(path)
        return raw.decode("utf-8")
    except OSError as e:
        raise LogprobeError(option, f"cannot read {path!r}: {e.strerror or e}", "check the path") from e
    except UnicodeDecodeError as e:
        raise LogprobeError(option, f"{name} is not UTF-8 text ({e.reason} at byte {e.start})",
                            "convert it to UTF-8") from e


def cmd_perplexity(args: argparse.Namespace) -> int:
    text = _read_text(args.text_file, "--text-file")
    if not text.strip():
        where = "stdin" if args.text_file == "-" else repr(args.text_file)
        raise LogprobeError("--text-file", f"{where} is empty (no text to score)", "give a file with some text")
    scorer = _scorer(args)
    start = time.perf_counter()
    res = scorer.perplexity(text, context_length=args.context_length, stride=args.stride, policy=args.policy,
                            prefix=False if args.no_prefix else None, max_tokens=args.max_tokens,
                            steer=_json_option(args.steer, "--steer"), capture=_json_option(args.capture, "--capture"))
    elapsed = time.perf_counter() - start
    speed = res.num_tokens / elapsed if elapsed > 0 else math.inf
    if args.json:
        d = res.to_dict()
        d.pop("token_nlls", None)
        if d.get("captures") is None:
            d.pop("captures", None)
        d.update(tokens_per_s=speed, elapsed_s=elapsed, model=scorer.info.name)
        print(dumps(d, compact=False))
        return 0
    info = scorer.info
    stride = f", stride {res.stride}" if res.stride is not None else ""
    lines = [
        ("model", f"{info.name} ({info.backend}, {info.device}, {info.dtype})"),
        ("perplexity", f"{res.perplexity:.4f} ± {res.perplexity_stderr:.4f}"),
        ("tokens", f"{res.num_tokens} scored in {res.num_windows} window{'s' * (res.num_windows != 1)} "
                   f"(policy {res.policy}, context {res.context_length}{stride})"),
    ]
    if res.word_perplexity is None:
        na = "n/a (not defined with --max-tokens)"
        lines += [("word ppl", na), ("byte ppl", na), ("bits/byte", na)]
    else:
        lines += [("word ppl", f"{res.word_perplexity:.4f} ({res.num_words} words)"),
                  ("byte ppl", f"{res.byte_perplexity:.4f} ({res.num_bytes} bytes)"),
                  ("bits/byte", f"{res.bits_per_byte:.4f}")]
    lines.append(("speed", f"{speed:.0f} tokens/s ({elapsed:.2f} s)"))
    for k, v in lines:
        print(f"{k:<11} {v}")
    return 0


# -- logprobs (streaming JSONL) --------------------------------------------------------------------


def resume_state(path: str) -> set[int]:
    """Indices already in ``path``; a partial or corrupt tail is cut off the file first.

    Every line we write ends with a newline, so a last line without one was interrupted. The
    file is truncated at the first line that is not a complete result; those get recomputed.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise LogprobeError("--output", f"cannot read {path!r}: {e.strerror or e}", "check the path") from e
    done: set[int] = set()
    keep = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                break
            if not (isinstance(rec, dict) and type(rec.get("index")) is int and "logprobs" in rec):
                break
            done.add(rec["index"])
        keep += len(line)
    if keep < len(data):
        dropped = data[keep:].count(b"\n") + (not data.endswith(b"\n"))
        print(f"{PROG}: {path}: removed {dropped} incomplete line{'s' * (dropped != 1)} at the end "
              "(they will be recomputed)", file=sys.stderr)
        try:
            with open(path, "r+b") as f:
                f.truncate(keep)
        except OSError as e:
            raise LogprobeError("--output", f"cannot truncate {path!r}: {e.strerror or e}") from e
    return done


def _line_request(scorer: Scorer, text: str, index: int, args: argparse.Namespace):
    """(request, id) for one input line; LogprobeError names the problem within the line."""
    try:
        seq = json.loads(text)
    except json.JSONDecodeError as e:
        raise LogprobeError("JSON", f"invalid: {e.msg} at column {e.colno}", "fix or remove the line") from e
    if not isinstance(seq, dict):
        raise LogprobeError("line", f"must be a JSON object, got {type(seq).__name__}",
                            'give {"prompt_token_ids": [...], "completion_token_ids": [...]}')
    temperature = seq.get("temperature", args.temperature)
    top_k = seq.get("top_k", args.top_k)
    entropy = seq.get("entropy", args.entropy)
    if not isinstance(entropy, bool):
        raise LogprobeError("entropy", f"must be true or false, got {entropy!r}")
    temperature, top_k = Scorer._options(temperature, top_k)
    try:
        caps, steers = scorer.hook_specs(seq.get("capture", args.capture_list), seq.get("steer", args.steer_list))
        req = scorer.sequence_request(seq, index, temperature, top_k, entropy, caps, steers)
    except LogprobeError as e:  # "sequences[i].completion_token_ids[3]" -> "completion_token_ids[3]"
        field = e.field.removeprefix(f"sequences[{index}]").lstrip(".").lstrip(": ") or "line"
        raise LogprobeError(field, e.problem, e.fix) from e
    return req, seq.get("id"), caps


def capture_records(captures, capture_dir: str, index: int) -> list[dict]:
    """Small captures inline; ``reduce: none`` ones ([n, H]) in ``capture_dir/INDEX.safetensors``,
    referenced by file and key (written before the JSONL line, so a line never points to nothing)."""
    from safetensors.torch import save_file

    recs, side = [], {}
    for k, c in enumerate(captures):
        if c.reduce == "none":
            key = f"{k}:{c.at}"
            side[key] = c.value.contiguous()
            recs.append({"at": c.at, "positions": c.positions, "reduce": c.reduce,
                         "file": os.path.join(capture_dir, f"{index}.safetensors"), "key": key,
                         "shape": list(c.value.shape)})
        else:
            recs.append(c.to_dict())
    if side:
        try:
            os.makedirs(capture_dir, exist_ok=True)
            save_file(side, os.path.join(capture_dir, f"{index}.safetensors"))
        except OSError as e:
            raise LogprobeError("--capture-dir", f"cannot write {capture_dir!r}: {e.strerror or e}") from e
    return recs


def _json_option(value: str | None, option: str):
    """A JSON value given inline or as @FILE."""
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise LogprobeError(option, f"cannot read {value[1:]!r}: {e.strerror or e}", "check the path") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LogprobeError(option, f"is not valid JSON ({e.msg} at column {e.colno})",
                            "give a JSON list, or @FILE holding one") from e


def cmd_train_vector(args: argparse.Namespace) -> int:
    def lines(path: str, option: str) -> list[str]:
        out = [x for x in _read_text(path, option).splitlines() if x.strip()]
        if not out:
            raise LogprobeError(option, f"{path!r} holds no prompts", "give one prompt per line")
        return out

    pos, neg = lines(args.positive, "--positive"), lines(args.negative, "--negative")
    if not args.output.endswith((".gguf", ".safetensors")):
        raise LogprobeError("--output", f"{args.output!r} is neither .gguf nor .safetensors", "name the file *.gguf")
    scorer = _scorer(args)
    layers = None
    if args.layers is not None:
        from ..interp.points import point_layer, resolve_points

        L = scorer.loaded.model.config.num_layers if getattr(scorer.loaded.model, "supports_hooks", False) else 0
        try:
            layers = [point_layer(p) for p in resolve_points(f"blocks.{args.layers}.resid_post", L)]
        except LogprobeError as e:
            raise LogprobeError("--layers", e.problem, e.fix) from None
    vec = scorer.train_vector(pos, neg, layers, args.method)
    path = vec.save_gguf(args.output) if args.output.endswith(".gguf") else vec.save_safetensors(args.output)
    summary = {"output": str(path), "layers": vec.layers, "method": args.method, "positive": len(pos),
               "negative": len(neg)}
    print(dumps(summary, compact=False) if args.json else
          f"{len(vec.layers)} layer{'s' * (len(vec.layers) != 1)} ({args.method}) -> {path}")
    return 0


def _blocks(f: TextIO, size: int) -> Iterator[list[tuple[int, str]]]:
    block: list[tuple[int, str]] = []
    for index, line in enumerate(f):
        if line.strip():
            block.append((index, line))
            if len(block) >= size:
                yield block
                block = []
    if block:
        yield block


def cmd_logprobs(args: argparse.Namespace) -> int:
    Scorer._options(args.temperature, args.top_k)  # fail before loading the model
    if args.input != "-" and not os.path.isfile(args.input):
        raise LogprobeError("--input", f"{args.input!r} is not a readable file", "check the path")
    if os.path.isdir(args.output):
        raise LogprobeError("--output", f"{args.output!r} is a directory", "give a file path")
    args.steer_list = _json_option(args.steer, "--steer")
    args.capture_list = _json_option(args.capture, "--capture")
    capture_dir = args.capture_dir or args.output + ".captures"
    scorer = _scorer(args)
    done = resume_state(args.output)
    written = skipped = failed = 0
    # SIGTERM/SIGINT: stop before the next forward pass; every line completed is written and flushed
    stopping: list[int] = []
    stop = lambda: bool(stopping)  # noqa: E731
    previous = {sig: signal.signal(sig, lambda signum, frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    start = time.perf_counter()
    try:
        src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as e:
        raise LogprobeError("--input", f"cannot read {args.input!r}: {e.strerror or e}", "check the path") from e
    try:
        out = open(args.output, "a", encoding="utf-8")
    except OSError as e:
        src.close()
        raise LogprobeError("--output", f"cannot write {args.output!r}: {e.strerror or e}", "check the path") from e
    try:
        with out:
            try:
                blocks = _blocks(src, BLOCK_LINES)
                for block in blocks:
                    if stopping:
                        break
                    requests, meta = [], []
                    for index, text in block:
                        if index in done:
                            skipped += 1
                            continue
                        try:
                            req, seq_id, caps = _line_request(scorer, text, index, args)
                        except LogprobeError as e:
                            print(f"line {index + 1}: {' '.join(str(e).split())}", file=sys.stderr)
                            failed += 1
                            continue
                        requests.append(req)
                        meta.append((index, seq_id, caps))

                    def write(i: int, r, meta=meta, requests=requests) -> None:
                        index, seq_id, caps = meta[i]
                        res = scorer.sequence_result(requests[i], r, caps)
                        rec = {"index": index, "id": seq_id, **res.to_dict()}
                        if res.captures is not None:
                            rec["captures"] = capture_records(res.captures, capture_dir, index)
                        out.write(dumps(rec) + "\n")
                        out.flush()
                        nonlocal written
                        written += 1

                    def too_big(i: int, e: Exception, meta=meta) -> None:  # out of memory even alone
                        nonlocal failed
                        text = f"{e.problem}; {e.fix}" if isinstance(e, LogprobeError) else str(e)
                        print(f"line {meta[i][0] + 1}: {' '.join(text.split())}", file=sys.stderr)
                        failed += 1

                    if requests:
                        try:
                            if isinstance(scorer.engine, Engine):
                                scorer.engine.run(requests, on_result=write, stop=stop, on_error=too_big)
                            else:  # ParallelEngine: stops between blocks
                                scorer.engine.run(requests, on_result=write)
                        except RunStopped:
                            break
            except UnicodeDecodeError as e:
                raise LogprobeError("--input", f"is not UTF-8 text ({e.reason})", "convert it to UTF-8") from e
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if src is not sys.stdin:
            src.close()
    elapsed = time.perf_counter() - start
    summary = {"output": args.output, "written": written, "already_done": skipped, "failed": failed,
               "elapsed_s": round(elapsed, 3)}
    if stopping:
        summary["interrupted"] = signal.Signals(stopping[0]).name
    if args.json:
        print(dumps(summary, compact=False))
    else:
        print(f"{written} written, {skipped} already done, {failed} failed -> {args.output} ({elapsed:.2f} s)")
    if stopping:
        print(f"{PROG}: stopped by {signal.Signals(stopping[0]).name}: {written} lines written and flushed; "
              "run the same command again to resume", file=sys.stderr)
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

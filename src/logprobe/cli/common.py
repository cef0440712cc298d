"""What every ``logprobe`` command shares: the model options (read from the arguments in one
place, ``ScorerOptions``), the cached model, one-line errors, reading text and JSON options.

>>> p = argparse.ArgumentParser(parents=[model_parser()])
>>> p.parse_args(["--model", "org/name@main", "--quiet"]).model
'org/name@main'
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from ..config import Deterministic, EngineConfig
from ..errors import LogprobeError
from ..loading import LoadedModel, load_model
from ..scorer import Scorer
from ..scoring.options import HeadOptions, HookSpecs

PROG = "logprobe"

# Loaded models, by (model, device, dtype): one process (a test session) loads each model once.
_MODELS: dict[tuple[str | None, str, str], LoadedModel] = {}

MODEL_HELP = ("a known name (default: smollm2-135m), a .gguf file, a Hugging Face model directory, or a hub id "
              "ORG/NAME[@REVISION] (ORG/NAME:FILE.gguf for one GGUF file of a repo; the local cache first)")


@dataclass(frozen=True, slots=True)
class ScorerOptions:
    """The options of ``model_parser``, the one place where a command's arguments become a model
    and an ``EngineConfig`` (every command that loads a model goes through it).

    >>> args = argparse.ArgumentParser(parents=[model_parser()]).parse_args(
    ...     ["--deterministic", "--no-tp-invariant", "--quiet", "--max-batch-tokens", "64"])
    >>> config = ScorerOptions.from_args(args).engine_config()
    >>> config.max_batch_tokens, config.progress, config.deterministic.tp_invariant, config.cuda_graph_tokens
    (64, False, False, 2048)
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_batch_tokens: int | None = None
    deterministic: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    tp_invariant: bool = True
    progress: bool | None = None  # --quiet: False; else a bar when stderr is a terminal
    cache: str | None = None  # --cache DIR: stored results (executor.cached)
    prefix_cache: bool | int | None = None  # --prefix-cache [BYTES]: engine.prefix_cache
    expert_parallel_size: int | None = None  # --ep M: experts in M groups over the ranks (None: the default)
    attention_parallel: str | None = None  # --attention-parallel data|tensor (None: the model's default)
    cuda_graph_tokens: int = 2048  # --cuda-graph-tokens N: small passes as CUDA graphs (0: off)
    load_format: str = "auto"  # --load-format dummy: random weights made where they run (speed only)

    @staticmethod
    def from_args(args: argparse.Namespace) -> ScorerOptions:
        return ScorerOptions(args.model, args.device, args.dtype, args.max_batch_tokens, args.deterministic,
                             args.tensor_parallel_size, args.data_parallel_size, args.tp_invariant,
                             False if getattr(args, "quiet", False) else None, getattr(args, "cache", None),
                             getattr(args, "prefix_cache", None), getattr(args, "expert_parallel_size", None),
                             getattr(args, "attention_parallel", None), getattr(args, "cuda_graph_tokens", 2048),
                             getattr(args, "load_format", "auto"))

    def engine_config(self) -> EngineConfig:
        """The engine's config (validated here, before any slow load)."""
        deterministic = Deterministic(tp_invariant=self.tp_invariant) if self.deterministic else None
        return EngineConfig(max_batch_tokens=self.max_batch_tokens, deterministic=deterministic,
                            progress=self.progress, cuda_graph_tokens=self.cuda_graph_tokens)


def get_scorer(model: str | None = None, device: str = "auto", dtype: str = "auto",
               max_batch_tokens: int | None = None, deterministic: bool = False, tensor_parallel_size: int = 1,
               data_parallel_size: int = 1, tp_invariant: bool = True, progress: bool | None = None,
               cache: str | None = None, prefix_cache: bool | int | None = None,
               expert_parallel_size: int | None = None, attention_parallel: str | None = None,
               cuda_graph_tokens: int = 2048, load_format: str = "auto") -> Scorer:
    """A Scorer on a cached loaded model: the same weights the CLI uses within this process
    (parallel scorers and random weights, ``load_format="dummy"``, are not cached)."""
    config = ScorerOptions(model, device, dtype, max_batch_tokens, deterministic, tensor_parallel_size,
                           data_parallel_size, tp_invariant, progress,
                           cuda_graph_tokens=cuda_graph_tokens).engine_config()
    if tensor_parallel_size != 1 or data_parallel_size != 1 or expert_parallel_size not in (None, 1) \
            or load_format != "auto":
        return Scorer(model, device=device, dtype=dtype, config=config, tensor_parallel_size=tensor_parallel_size,
                      data_parallel_size=data_parallel_size, cache=cache, prefix_cache=prefix_cache,
                      expert_parallel_size=expert_parallel_size, attention_parallel=attention_parallel,
                      load_format=load_format)
    key = (model, device, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(model, device, dtype)
    return Scorer(_MODELS[key], config=config, cache=cache, prefix_cache=prefix_cache,
                  attention_parallel=attention_parallel)


def prefix_cache_arg(text: str) -> bool | int:
    """``--prefix-cache`` [BYTES]: ``auto`` (the default budget), ``off``, or bytes with an optional
    K/M/G suffix (powers of 1024).

    >>> prefix_cache_arg("auto"), prefix_cache_arg("off"), prefix_cache_arg("2G"), prefix_cache_arg("1000")
    (True, False, 2147483648, 1000)
    """
    t = text.strip().lower()
    if t in ("auto", "on"):
        return True
    if t in ("off", "0"):
        return False
    scale = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, off or a number of bytes (e.g. 2G)")
    return int(digits) * scale


def model_parser() -> argparse.ArgumentParser:
    """The options of every command that loads a model (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and output")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    g.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="token budget of one forward pass (default: from the device: 8192 on CPU, up to 32768 "
                        "on CUDA as free memory allows); lower it if memory runs out")
    g.add_argument("--deterministic", dest="deterministic", action="store_true",
                   help="bitwise-identical numbers whatever shares a batch, its order, budget, chunking or "
                        "prefix sharing (native models; slower, see docs/perf.md)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (GPUs, or gloo processes on CPU); worker processes are "
                        "started and owned by logprobe (default: %(default)s)")
    g.add_argument("--expert-parallel-size", "--ep", type=int, default=None, metavar="M",
                   help="mixture-of-experts models: the experts in M groups over the --tensor-parallel-size ranks "
                        "(M divides the ranks and the expert count; each rank holds 1/M of the experts, split "
                        "further between the ranks of a group; default: N, whole experts per rank, where N "
                        "divides the expert count, else 1)")
    g.add_argument("--attention-parallel", choices=("data", "tensor"), default=None,
                   help="mixture-of-experts models over several ranks: attention, norms and dense blocks whole on "
                        "every rank, each rank running its share of the batch's sequences (data), or split by "
                        "heads with every rank running every row (tensor); default: data where the experts are "
                        "whole per rank (--ep = --tp) and the family has it, else tensor")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=1, metavar="M",
                   help="M replicas (each of --tensor-parallel-size ranks) sharing the requests (default: %(default)s)")
    g.add_argument("--no-tp-invariant", dest="tp_invariant", action="store_false",
                   help="with --deterministic: bitwise repeatable at this tensor-parallel size only, not the same bits "
                        "at every size (cheaper; see docs/perf.md)")
    g.add_argument("--cuda-graph-tokens", type=int, default=2048, metavar="N",
                   help="on CUDA, passes of at most N rows replay CUDA graphs captured per size (the host's "
                        "launches off the critical path; same numbers, bitwise with --deterministic); 0: off "
                        "(default: %(default)s)")
    g.add_argument("--cache", default=None, metavar="DIR",
                   help="a persistent result cache (SQLite in DIR): requests scored before under the same weights, "
                        "tokenizer, dtype, device kind, deterministic mode and options are answered from it "
                        "without a forward pass (see `logprobe cache stats|clear`)")
    g.add_argument("--prefix-cache", nargs="?", const=True, default=None, type=prefix_cache_arg, metavar="BYTES",
                   help="keep the keys/values of token prefixes across requests and resume later requests from "
                        "their longest cached prefix (same numbers; bitwise with --deterministic). BYTES: the "
                        "budget (e.g. 2G; default: a quarter of free CUDA memory, 512M on CPU), or off")
    g.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights made on each rank's device instead of the checkpoint's (vLLM's "
                        "name; the directory needs config.json and the tokenizer only): the speed of a model "
                        "larger than the disk, and weight-sync tests; its numbers mean nothing (default: auto)")
    g.add_argument("--json", action="store_true", help="machine-readable JSON on stdout instead of a table/report")
    g.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar (it shows only when stderr is a terminal anyway)")
    return common


def head_parser() -> argparse.ArgumentParser:
    head = argparse.ArgumentParser(add_help=False)
    h = head.add_argument_group("scoring options")
    h.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="score log_softmax(logits / T) (default: %(default)s)")
    h.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="also report the K most likely tokens at each scored position (default: 0)")
    h.add_argument("--entropy", action="store_true", help="also report the entropy of each position's distribution")
    return head


def head_options(args: argparse.Namespace) -> HeadOptions:
    """The options of ``head_parser`` as one record (not yet checked: ``HeadOptions.checked``)."""
    return HeadOptions(args.temperature, args.top_k, args.entropy)


def hook_specs(args: argparse.Namespace) -> HookSpecs:
    """The options of ``hooks_parser`` as one record, JSON (or @FILE) read; the steer first."""
    steer = json_option(args.steer, "--steer")
    return HookSpecs(json_option(args.capture, "--capture"), steer)


def hooks_parser() -> argparse.ArgumentParser:
    hk = argparse.ArgumentParser(add_help=False)
    k = hk.add_argument_group("hidden states (native models)")
    k.add_argument("--steer", default=None, metavar="JSON",
                   help='steering entries, a JSON list or @FILE: [{"at": "blocks.10.resid_post", "vector": '
                        '"v.gguf" | [..] | {layer: [..]}, "coeff": 4, "positions": "all", "op": "add"}]')
    k.add_argument("--capture", default=None, metavar="JSON",
                   help='capture entries, a JSON list or @FILE: [{"at": "blocks.*.resid_post", "positions": '
                        '"last", "reduce": "none"}] (results in --json output)')
    return hk


def fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)  # one line, always
    return 2


def read_text(path: str, option: str) -> str:
    """A UTF-8 text file (``-``: stdin); LogprobeError naming ``option`` otherwise."""
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


def json_option(value: str | None, option: str):
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

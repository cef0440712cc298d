"""``logprobe train-vector``: a steering/reading vector from contrasting prompts."""

from __future__ import annotations

import argparse

from ..errors import LogprobeError
from ..interp.points import point_layer, resolve_points
from ..io.jsonsafe import dumps
from .common import read_text


def add_train_vector_parser(sub, common: argparse.ArgumentParser) -> None:
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


def _lines(path: str, option: str) -> list[str]:
    out = [x for x in read_text(path, option).splitlines() if x.strip()]
    if not out:
        raise LogprobeError(option, f"{path!r} holds no prompts", "give one prompt per line")
    return out


def cmd_train_vector(args: argparse.Namespace) -> int:
    pos, neg = _lines(args.positive, "--positive"), _lines(args.negative, "--negative")
    if not args.output.endswith((".gguf", ".safetensors")):
        raise LogprobeError("--output", f"{args.output!r} is neither .gguf nor .safetensors", "name the file *.gguf")
    scorer = args.make_scorer(args)
    layers = None
    if args.layers is not None:
        L = scorer.context.hook_layers
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

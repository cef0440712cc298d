"""Hook points: canonical names, selectors and aliases (pure functions of a name and the depth).

Per decoder block ``l`` (0-based) of an ``L``-block model the residual stream reads:

    embed                   = token embeddings                       (= blocks.0.resid_pre)
    blocks.{l}.resid_pre    = input of block l                       (= blocks.{l-1}.resid_post)
    blocks.{l}.attn_out     = Attn_l(RMSNorm(resid_pre)), before it is added
    blocks.{l}.resid_mid    = resid_pre + attn_out
    blocks.{l}.mlp_out      = MLP_l(RMSNorm(resid_mid)), before it is added
    blocks.{l}.resid_post   = resid_mid + mlp_out                    (= transformers hidden_states[l+1], l < L-1)
    final_norm              = RMSNorm(blocks.{L-1}.resid_post), what the log-prob head reads
                                                                     (= transformers hidden_states[L])

Mixture-of-experts blocks also have (capture only, not a residual-stream state):

    blocks.{l}.router       = the router's probabilities [E] before top-k (layers.moe): softmax(float32
                              logits); sigmoid scores for DeepSeek's grouped router

Equal values keep distinct names: steering ``blocks.3.resid_post`` and ``blocks.4.resid_pre``
acts on the same tensor twice (in that order). Selectors expand to several canonical names:

    blocks.10:12.resid_post  -> blocks.10.resid_post, blocks.11.resid_post    (half-open slice)
    blocks.*.mlp_out         -> every block's mlp_out
    blocks.-1.resid_post     -> blocks.{L-1}.resid_post
    blocks.3.hook_resid_post -> blocks.3.resid_post     (TransformerLens)
    hidden_states.4          -> blocks.3.resid_post     (transformers; .0 -> embed, .L -> final_norm)
    l_out-3                  -> blocks.3.resid_post     (llama.cpp's tensor name)
"""

from __future__ import annotations

import re

from ..errors import LogprobeError

BLOCK_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
MOE_POINTS = ("router",)  # mixture-of-experts blocks only; the model refuses them elsewhere
TOP_POINTS = ("embed", "final_norm")
_TL_ALIASES = {f"hook_{p}": p for p in BLOCK_POINTS} | {"hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out"}
_TOP_ALIASES = {"hook_embed": "embed", "ln_final": "final_norm", "ln_final.hook_normalized": "final_norm",
                "norm": "final_norm", "token_embd": "embed"}
_BLOCK = re.compile(r"blocks\.([^.]+)\.(.+)")
_HIDDEN = re.compile(r"hidden_states\.(-?\d+)")
_LOUT = re.compile(r"l_out-(-?\d+)")


def point_names(num_layers: int) -> list[str]:
    """Every canonical hook point of a model, in forward order."""
    return ["embed", *(f"blocks.{i}.{p}" for i in range(num_layers) for p in BLOCK_POINTS), "final_norm"]


def _layer(text: str, num_layers: int, name: str) -> int:
    try:
        layer = int(text)
    except ValueError:
        raise LogprobeError("at", f"{name!r}: layer {text!r} is not an integer", _valid(num_layers)) from None
    if not -num_layers <= layer < num_layers:
        raise LogprobeError("at", f"{name!r}: layer {layer} is out of range for a model of {num_layers} blocks",
                            f"use 0..{num_layers - 1} (or -{num_layers}..-1 from the end); {_valid(num_layers)}")
    return layer % num_layers


def _layers(sel: str, num_layers: int, name: str) -> list[int]:
    if sel == "*":
        return list(range(num_layers))
    if ":" in sel:
        a, _, b = sel.partition(":")
        start = 0 if a == "" else _layer(a, num_layers, name)
        stop = num_layers if b == "" else (num_layers if b.strip() == str(num_layers) else _layer(b, num_layers, name))
        if start >= stop:
            raise LogprobeError("at", f"{name!r} selects no layer",
                                f"use start < stop within 0..{num_layers}; {_valid(num_layers)}")
        return list(range(start, stop))
    return [_layer(sel, num_layers, name)]


def resolve_points(name: str, num_layers: int) -> list[str]:
    """A name, selector or alias -> canonical point names (forward order, no duplicates)."""
    if not isinstance(name, str) or not name:
        raise LogprobeError("at", f"must be a hook-point name, got {name!r}", _valid(num_layers))
    name = name.strip()
    if name in TOP_POINTS:
        return [name]
    if name in _TOP_ALIASES:
        return [_TOP_ALIASES[name]]
    if m := _HIDDEN.fullmatch(name):
        i = int(m.group(1))
        if not -(num_layers + 1) <= i <= num_layers:
            raise LogprobeError("at", f"{name!r}: hidden_states has indices 0..{num_layers}", _valid(num_layers))
        i %= num_layers + 1
        if i == num_layers:  # transformers applies the final norm to its last hidden state
            return ["final_norm"]
        return ["embed"] if i == 0 else [f"blocks.{i - 1}.resid_post"]
    if m := _LOUT.fullmatch(name):
        return [f"blocks.{_layer(m.group(1), num_layers, name)}.resid_post"]
    if m := _BLOCK.fullmatch(name):
        point = _TL_ALIASES.get(m.group(2), m.group(2))
        if point not in BLOCK_POINTS and point not in MOE_POINTS:
            raise LogprobeError("at", f"{name!r}: unknown point {m.group(2)!r} of a block", _valid(num_layers))
        return [f"blocks.{i}.{point}" for i in _layers(m.group(1), num_layers, name)]
    raise LogprobeError("at", f"unknown hook point {name!r}", _valid(num_layers))


def point_layer(point: str) -> int | None:
    """The block index of a canonical point (None for embed / final_norm)."""
    m = _BLOCK.fullmatch(point)
    return int(m.group(1)) if m else None


def _valid(num_layers: int) -> str:
    return (f"valid points: embed, blocks.{{0..{num_layers - 1}}}.{{{', '.join(BLOCK_POINTS)}}}, final_norm; "
            "blocks.{l}.router on mixture-of-experts models; selectors blocks.A:B.point, blocks.*.point, "
            "negative layers; aliases blocks.N.hook_resid_post, hidden_states.N, l_out-N")

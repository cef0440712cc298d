"""Which tokens are scored, and from which position: the prompt/continuation contract.

Alignment. A sequence of tokens t_0 .. t_{n-1} is fed to the model; row i of the output
(the hidden state after reading t_0..t_i) predicts token t_{i+1}:

    position i :   0      1      2      3      4
    input      :  The  capital   of   France   is    Paris
    predicts   : capital  of   France   is   Paris
                                             ^^^^^ row 4 (the last prompt row) scores " Paris"

So the first continuation token is scored by the *last prompt row*, and a continuation of k
tokens is scored by rows  len(prompt)-1 .. len(prompt)+k-2.  The final continuation token is
never fed (nothing after it is asked for).

Boundary rule (as lm-evaluation-harness). Trailing whitespace of the prompt moves to the
continuation, then prompt+continuation are encoded *jointly* and split after the prompt's own
tokens, so a BPE that glues a space to the next word scores " Paris", not "Paris":

    prompt "The capital of France is "   continuation "Paris"
 -> prompt "The capital of France is"    continuation " Paris"
    whole = encode("The capital of France is Paris") = [The, capital, of, France, is, ĠParis]
    prompt tokens = encode("The capital of France is") = 5 tokens -> continuation = [ĠParis]

An empty prompt is replaced by the prefix token (BOS, or EOS when there is no BOS), so the
first continuation token is still predicted from something. When the model's tokenizer adds BOS
to a sequence, BOS precedes a non-empty prompt too.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import LogprobeError


def split_continuation(
    prompt: str,
    continuation: str,
    encode: Callable[[str], list[int]],
    prefix_id: int,
    add_bos: bool = False,
    bos_id: int | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt ids, continuation ids) by the boundary rule above."""
    n_spaces = len(prompt) - len(prompt.rstrip())
    if n_spaces:
        prompt, continuation = prompt[:-n_spaces], prompt[-n_spaces:] + continuation
    if continuation == "":
        raise LogprobeError("continuation", "is empty", "give a non-empty continuation to score")
    if prompt == "":
        ctx, cont = [prefix_id], encode(continuation)
    else:
        whole = encode(prompt + continuation)
        ctx = encode(prompt)
        # exactly lm-eval's split: if the joint encoding merged a token across the boundary,
        # that token counts as context and the continuation keeps what follows it
        cont = whole[len(ctx):]
        if add_bos and bos_id is not None:
            ctx = [bos_id] + ctx
    if not cont:
        raise LogprobeError("continuation", f"{continuation!r} tokenizes to nothing after the prompt",
                            "give a continuation that adds at least one token")
    return ctx, cont

"""What ``Scorer.warmup`` / ``logprobe warmup`` / ``serve --warmup`` run before the first real
request, so that every kernel a scoring job meets is compiled (and any autotuned one tuned, its
choice written to the tuning cache) ahead: a few rounds of random token ids that take the engine's
paths, each round one engine call.

* ``full``: 8 sequences filling the budget, with top-k, entropy and a temperature beside plain
  ones (the head's variants; the largest pass shapes);
* ``small``: two short sequences (17 and 48 tokens: Triton specialises on sizes divisible by 16);
* ``shared``: four sequences behind one 80-token prompt (the prefix tree);
* ``long``: one sequence of 1.25 budgets (chunks that see the earlier ones through the KV cache).

On CPU nothing compiles: the rounds are cut to ``CPU_ROWS`` rows (the flow, not the kernels).

    >>> rounds = warmup_rounds(vocab=300, budget=512, device_type="cpu")
    >>> [(name, len(reqs), sum(len(r.tokens) for r in reqs)) for name, reqs in rounds]
    [('full', 8, 256), ('small', 2, 65), ('shared', 4, 400), ('long', 1, 320)]
    >>> full = rounds[0][1]
    >>> [(r.top_k, r.entropy, r.temperature) for r in full[:4]]
    [(0, False, 1.0), (5, False, 1.0), (0, True, 1.0), (0, False, 0.7)]
"""

from __future__ import annotations

import random

from .request import ScoreRequest

CPU_ROWS = 256  # rows of the CPU's rounds: nothing to compile there
FIRST_ID = 3  # ids below are often special tokens (padding, BOS, EOS)


def _seq(rng: random.Random, vocab: int, n: int, **options) -> ScoreRequest:
    """``n`` random ids, the second half scored."""
    tokens = [rng.randrange(FIRST_ID, vocab) for _ in range(n)]
    return ScoreRequest(tokens, max(1, n // 2), **options)


def warmup_rounds(vocab: int, budget: int, device_type: str, seed: int = 0) -> list[tuple[str, list[ScoreRequest]]]:
    """The rounds (name, requests) for a model of ``vocab`` ids under a ``budget``-row pass."""
    rng = random.Random(seed)
    rows = budget if device_type == "cuda" else min(budget, CPU_ROWS)
    each = max(4, rows // 8)
    options = [{}, {"top_k": 5}, {"entropy": True}, {"temperature": 0.7}]
    full = [_seq(rng, vocab, each, **options[i % 4] if i < 4 else {}) for i in range(8)]
    small = [_seq(rng, vocab, 17), _seq(rng, vocab, 48)]
    prompt = [rng.randrange(FIRST_ID, vocab) for _ in range(80)]
    shared = [ScoreRequest(prompt + [rng.randrange(FIRST_ID, vocab) for _ in range(20)], len(prompt))
              for _ in range(4)]
    long = [_seq(rng, vocab, rows + rows // 4)]
    return [("full", full), ("small", small), ("shared", shared), ("long", long)]


def warmup_tokens(rounds: list[tuple[str, list[ScoreRequest]]]) -> int:
    """Input tokens of the rounds (what a report counts)."""
    return sum(r.num_inputs for _, reqs in rounds for r in reqs)

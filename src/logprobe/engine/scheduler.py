"""Packing requests into batches under a token budget. Pure functions."""

from __future__ import annotations


def plan_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group request indices into batches whose summed lengths fit ``max_batch_tokens``.

    Longest first (first-fit decreasing into the current batch): long requests meet the budget
    alone, short ones fill the rest. A request longer than the budget gets a batch of its own.
    Ties keep input order, so the plan is a deterministic function of the lengths.

    >>> plan_batches([3, 9, 4, 2, 5], 10)
    [[1], [4, 2], [0, 3]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > max_batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches

"""What one engine step of the server takes from the queue (``Batcher._take``): requests chosen
round-robin over the queued jobs up to the batch budget, in tokens the engine will compute
(``StepCost``: a context shared in the step or held by the prefix cache counts once); pipelined,
half of the queue's work and the requests sharing a context with it (``step_budget``,
``companions``). Pure functions of the queue, pinned by literal tables in ``tests/test_batcher.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.request import ScoreRequest


def plan_step(queue: list[tuple[list[ScoreRequest], int]], budget: int, pipeline: bool = False,
              cached: Callable[[list[int], int], int] | None = None) -> list[tuple[int, int]]:
    """One step's requests: ``queue`` holds each job's requests and its first unscored one, in this
    step's turn order; returns ``(j, k)``, job ``j``'s ``k``-th unscored request, in the order
    taken (``round_robin`` up to ``budget``; ``pipeline`` with two or more jobs: up to
    ``step_budget`` of the queue, then ``companions`` up to ``budget``; ``cached``: the prefix
    cache's ``peek``).

    Four one-request jobs of 11 inputs, two samples of each of two 10-token prompts: by input
    tokens a budget of 16 would take one; by computed tokens (11, then 1 for a request whose
    prompt is in the step) it takes both samples of the first prompt, and the second prompt (11
    more) no longer fits. A budget of 32 takes all four (11 + 11 + 1 + 1 = 24); pipelined, the
    step takes half of those 24 (12): the first prompt's samples, the second's left to the next
    step, which computes while these answers travel.
    >>> a = [ScoreRequest([7] * 10 + [5, k], 10) for k in (1, 2)]
    >>> b = [ScoreRequest([8] * 10 + [5, k], 10) for k in (1, 2)]
    >>> queue = [([a[0]], 0), ([b[0]], 0), ([a[1]], 0), ([b[1]], 0)]
    >>> plan_step(queue, 16)
    [(0, 0), (2, 0)]
    >>> plan_step(queue, 32)
    [(0, 0), (1, 0), (2, 0), (3, 0)]
    >>> plan_step(queue, 32, pipeline=True)
    [(0, 0), (2, 0)]
    """
    cost = StepCost(cached)
    remaining = [Remaining(requests, first, cost) for requests, first in queue]
    share = budget
    if pipeline and len(queue) > 1:
        share = step_budget(queued_cost(remaining, 2 * budget), budget)
        cost.clear()
    picks = round_robin(remaining, share, lambda j, k: cost.take(remaining[j].request(k)))
    if share < budget:
        picks += companions(remaining, picks, lambda j, k: cost.shares(remaining[j].request(k)),
                            budget - cost.spent)
    return picks


class StepCost:
    """What a request adds to one engine step, in tokens the engine computes: its input tokens,
    less its context (the tokens before ``score_begin``) when a request already taken into the
    step (``take``) had the same context (the engine's prefix tree computes it once), else less
    the part of the context the prefix cache holds (``cached(tokens, limit)``: ``PrefixCache.peek``).
    A step budget of input tokens would stop an RL step at about budget / (prompt + response)
    requests, computing a fraction of that when the samples of a group share their prompt.

    Worked example, budget 16, three samples of one 10-token prompt with 2-token responses
    (11 inputs each: the last token is only a target): input tokens take one request a step;
    here the first costs 11, the next two 1 each once the first is taken (13 in all), so the
    step takes all three.

    >>> from logprobe.engine.request import ScoreRequest
    >>> cost = StepCost()
    >>> group = [ScoreRequest(list(range(10)) + [5, k], 10) for k in (6, 7, 8)]
    >>> [cost(r) for r in group]  # nothing taken yet: each would compute the prompt
    [11, 11, 11]
    >>> [cost.take(r) for r in group]
    [11, 1, 1]
    """

    def __init__(self, cached: Callable[[list[int], int], int] | None = None) -> None:
        self.cached = cached
        self.seen: set[tuple[int, ...]] = set()
        self.spent = 0  # what the requests taken cost
        self._context: dict[int, tuple[tuple[int, ...], int]] = {}  # id(request) -> (context, cached part)

    def _read(self, r: ScoreRequest) -> tuple[tuple[int, ...], int]:
        if id(r) not in self._context:
            context = tuple(r.tokens[:r.score_begin])
            held = self.cached(r.tokens, len(context)) if self.cached is not None and context else 0
            self._context[id(r)] = context, held
        return self._context[id(r)]

    def __call__(self, r: ScoreRequest) -> int:
        context, held = self._read(r)
        if context in self.seen:
            return max(1, r.num_inputs - len(context))
        return max(1, r.num_inputs - held)

    def shares(self, r: ScoreRequest) -> bool:
        """Its context is computed by a request already taken."""
        return self._read(r)[0] in self.seen

    def clear(self) -> None:
        """Nothing taken any more; each request's context and cached part stay read (a step counts
        the queue's work first, then takes its share)."""
        self.seen.clear()
        self.spent = 0

    def take(self, r: ScoreRequest) -> int:
        """Count ``r`` into the step; returns what it costs."""
        c = self(r)
        self.seen.add(self._read(r)[0])
        self.spent += c
        return c


class Remaining(Sequence):
    """A job's unscored requests' step costs (``StepCost``, asked when read: a cost falls once a
    request of the same context is taken), without copying the requests (a job may hold many)."""

    def __init__(self, requests: list[ScoreRequest], first: int, cost: Callable[[ScoreRequest], int]) -> None:
        self.requests, self.first, self.cost = requests, first, cost

    def __len__(self) -> int:
        return len(self.requests) - self.first

    def request(self, k: int) -> ScoreRequest:
        return self.requests[self.first + k]

    def __getitem__(self, k):
        return self.cost(self.request(k))


def queued_cost(remaining: Sequence[Remaining], limit: int) -> int:
    """The queue's work in step tokens, every request taken in turn into the one ``StepCost`` the
    ``remaining`` share (``clear`` it after), counted up to ``limit`` (beyond it the sum does not
    matter to ``step_budget``)."""
    total = 0
    for rem in remaining:
        for k in range(len(rem)):
            total += rem.cost.take(rem.request(k))
            if total >= limit:
                return total
    return total


def step_budget(queued: int, budget: int) -> int:
    """The share of ``queued`` step tokens that one pipelined step takes (``budget``: the engine's
    batch budget): half of the queue, at least a quarter of the budget and at most all of it.
    A step that took the whole queue would hand every answer back at once and leave the engine
    idle while those clients send their next requests (a client with a fixed number of requests
    in flight, as RL rollout workers keep); the half left behind computes meanwhile, and the next
    step finds the answered clients' requests queued. A quarter of the budget keeps steps large
    enough to run at one batch's speed.

    >>> step_budget(100_000, 32_768)  # two steps' worth queued or more: a whole step
    32768
    >>> step_budget(40_000, 32_768)   # less: half of the queue
    20000
    >>> step_budget(10_000, 32_768)   # never below a quarter of the budget
    8192
    """
    return min(budget, max(budget // 4, -(-queued // 2)))


def companions(remaining: Sequence[Sequence[int]], picks: list[tuple[int, int]],
               shares: Callable[[int, int], bool], left: int) -> list[tuple[int, int]]:
    """The requests a pipelined step adds past its share (``step_budget``): each job's next ones
    (after ``picks``) whose context a request of the step already computes (``shares(j, k)``:
    each costs only its own tokens, where a later step would compute the context again), in job
    order, while their costs fit ``left``.

    Two jobs; the step took job 0's first request; job 0's next and job 1's first share its
    context (cost 1 each), job 1's second does not:
    >>> companions([[11, 1], [1, 11]], [(0, 0)], lambda j, k: (j, k) != (1, 1), 5)
    [(0, 1), (1, 0)]
    """
    nxt = [0] * len(remaining)
    for j, k in picks:
        nxt[j] = max(nxt[j], k + 1)
    out = []
    for j, sizes in enumerate(remaining):
        k = nxt[j]
        while k < len(sizes) and shares(j, k) and sizes[k] <= left:
            left -= sizes[k]
            out.append((j, k))
            k += 1
    return out


def round_robin(remaining: Sequence[Sequence[int]], budget: int,
                on_take: Callable[[int, int], object] | None = None) -> list[tuple[int, int]]:
    """One engine step's requests: ``remaining[j]`` holds the input-token counts of job ``j``'s
    unscored requests in order, jobs in this step's turn order. Rounds over the jobs take each
    one's next request while it fits what is left of ``budget``; a job whose next request does
    not fit is passed over in that round (it keeps its order), except that the step's first
    request is always taken, whatever its size. Returns ``(job, k)``: job ``j``'s ``k``-th
    remaining request, in the order taken; ``on_take(j, k)`` is called as each is taken (a size
    is read when its request is considered, so taking one may lower the next's: ``StepCost``).

    budget 16: A = [5, 5, 5], B = [3], C = [20]
      round 1: A0 (left 11), B0 (8), C0 does not fit;  round 2: A1 (3);  round 3: A2 does not fit
    >>> round_robin([[5, 5, 5], [3], [20]], 16)
    [(0, 0), (1, 0), (0, 1)]
    >>> round_robin([[50, 1], [2]], 16)  # the first request alone is over the budget: the step is full
    [(0, 0)]
    """
    taken: list[tuple[int, int]] = []
    nxt = [0] * len(remaining)
    left = budget
    progress = True
    while progress and left > 0:
        progress = False
        for j, sizes in enumerate(remaining):
            if nxt[j] >= len(sizes):
                continue
            size = sizes[nxt[j]]
            if taken and size > left:
                continue
            taken.append((j, nxt[j]))
            if on_take is not None:
                on_take(j, nxt[j])
            left -= size
            nxt[j] += 1
            progress = True
            if left <= 0:
                break
    return taken

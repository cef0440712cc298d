"""The server's continuous batcher, on a fake engine: shared steps, round-robin order, bounded queue."""

from __future__ import annotations

import asyncio
import threading

import pytest

from logprobe.engine.request import RequestResult, ScoreRequest
from logprobe.engine.runner import Engine
from logprobe.executor.engine import ParallelEngine
from logprobe.executor.interface import Executor
from logprobe.server.batcher import Batcher, QueueFull, ServerClosed, engine_call


def req(n_inputs: int, tag: int) -> ScoreRequest:
    # tokens carry a tag so the fake engine's calls can be read back
    return ScoreRequest([tag] * (n_inputs + 1), 1)


class FakeEngine:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[list[int]] = []
        self.gate = gate

    def __call__(self, requests: list[ScoreRequest], cancelled=None) -> list[RequestResult]:
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append([r.tokens[0] for r in requests])
        import torch

        return [RequestResult(torch.full((r.num_scored,), float(r.tokens[0])), torch.zeros(r.num_scored,
                              dtype=torch.long)) for r in requests]


def run_jobs(batcher: Batcher, jobs: list[list[ScoreRequest]]):
    async def main():
        batcher.start()
        try:
            return await asyncio.gather(*[batcher.submit(j) for j in jobs])
        finally:
            batcher.close()
    return asyncio.run(main())


def test_round_robin_gold():
    """Jobs queued together share steps, one request from each job in turn, up to the budget:
    A = a0..a3 (10 tokens each), B = b0, C = c0 c1; budget 40."""
    gate = threading.Event()
    engine = FakeEngine(gate)
    b = Batcher(engine, max_batch_tokens=40, max_queue_requests=10, max_queue_tokens=10_000)
    A = [req(10, 10 + i) for i in range(4)]
    B = [req(10, 20)]
    C = [req(10, 30 + i) for i in range(2)]

    async def main():
        b.start()
        tasks = [asyncio.ensure_future(b.submit(j)) for j in (A, B, C)]
        await asyncio.sleep(0.05)  # all three queued before the engine may run
        gate.set()
        out = await asyncio.gather(*tasks)
        b.close()
        return out

    out = asyncio.run(main())
    assert engine.calls == [[10, 20, 30, 11], [31, 12, 13]]
    # each job gets its own results back, in its own order
    assert [r.logprobs[0].item() for r in out[0]] == [10, 11, 12, 13]
    assert [r.logprobs[0].item() for r in out[2]] == [30, 31]


def test_without_batching_one_job_per_step():
    gate = threading.Event()
    engine = FakeEngine(gate)
    b = Batcher(engine, max_batch_tokens=40, max_queue_requests=10, max_queue_tokens=10_000, batching=False)

    async def main():
        b.start()
        tasks = [asyncio.ensure_future(b.submit([req(5, t)])) for t in (1, 2, 3)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*tasks)
        b.close()

    asyncio.run(main())
    assert engine.calls == [[1], [2], [3]]


def test_long_request_runs_alone_and_budget_respected():
    engine = FakeEngine()
    b = Batcher(engine, max_batch_tokens=16, max_queue_requests=10, max_queue_tokens=10_000)
    run_jobs(b, [[req(100, 1), req(8, 2), req(8, 3), req(9, 4)]])
    assert engine.calls == [[1], [2, 3], [4]]


def test_steps_count_shared_and_cached_contexts_once():
    """A step's budget counts the tokens the engine computes: the samples of one prompt (an RL
    group sent one request per sample) cost their prompt once; a prompt the prefix cache holds
    costs nothing. Budget 16, 10-token prompts, 2-token responses (11 inputs each): by input
    tokens each request would be a step of its own."""
    prompt = [7] * 10
    group = [ScoreRequest(prompt + [5, 6 + k], 10) for k in range(3)]
    engine = FakeEngine()
    run_jobs(Batcher(engine, max_batch_tokens=16, max_queue_requests=10, max_queue_tokens=10_000),
             [group[:1], group[1:2], group[2:]])
    assert [len(c) for c in engine.calls] == [3]  # 11 + 1 + 1
    other = [ScoreRequest([8] * 9 + [k, 5, 6], 10) for k in range(3)]  # three prompts, 8 tokens alike
    engine = FakeEngine()
    asked = []
    def cached(tokens, limit):  # noqa: E306 - the prefix cache holds their common 8 tokens
        asked.append(limit)
        return 8
    run_jobs(Batcher(engine, max_batch_tokens=6, max_queue_requests=10, max_queue_tokens=10_000, cached=cached),
             [[r] for r in other])
    assert asked == [10, 10, 10] and [len(c) for c in engine.calls] == [2, 1]  # 3 + 3, then 3


def test_queue_full_and_closed():
    gate = threading.Event()
    engine = FakeEngine(gate)
    b = Batcher(engine, max_batch_tokens=8, max_queue_requests=2, max_queue_tokens=50)

    async def main():
        b.start()
        first = asyncio.ensure_future(b.submit([req(40, 1)]))  # an empty queue takes any job
        second = asyncio.ensure_future(b.submit([req(5, 2)]))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):  # 2 jobs queued
            await b.submit([req(1, 3)])
        gate.set()
        await asyncio.gather(first, second)
        gate.clear()
        blocked = asyncio.ensure_future(b.submit([req(45, 4)]))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull) as e:  # 45 + 10 tokens > 50
            await b.submit([req(10, 5)])
        assert e.value.retry_after >= 1
        gate.set()
        await blocked
        b.close()
        with pytest.raises(ServerClosed):
            await b.submit([req(1, 6)])

    asyncio.run(main())


def test_engine_error_fails_only_its_step():
    calls = []

    def engine(requests, cancelled=None):
        calls.append(len(requests))
        if requests[0].tokens[0] == 1:
            raise RuntimeError("boom")
        return FakeEngine()(requests)

    b = Batcher(engine, max_batch_tokens=8, max_queue_requests=10, max_queue_tokens=1000)

    async def main():
        b.start()
        with pytest.raises(RuntimeError, match="boom"):
            await b.submit([req(8, 1)])
        out = await b.submit([req(3, 2)])  # still serving
        b.close()
        return out

    out = asyncio.run(main())
    assert out[0].logprobs[0].item() == 2
    assert b.queue_depth == (0, 0)


def test_server_config_and_cli_errors(capsys):
    from logprobe.cli.main import main
    from logprobe.errors import LogprobeError
    from logprobe.server import ServerConfig

    with pytest.raises(LogprobeError, match="max_queue_requests: must be a positive integer"):
        ServerConfig(max_queue_requests=0)
    with pytest.raises(LogprobeError, match="api_key: is empty"):
        ServerConfig(api_key="  ")
    # refused before any model is loaded: one line, exit code 2
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["logprobe: error: port: must be an integer in [0, 65535], got 70000"]
    for bad in (-1, float("inf"), float("nan"), "30", True):
        with pytest.raises(LogprobeError, match="shutdown_timeout: must be a number of seconds >= 0"):
            ServerConfig(shutdown_timeout=bad)
    assert main(["serve", "--shutdown-timeout", "-1"]) == 2
    assert "shutdown_timeout: must be a number of seconds >= 0, got -1.0" in capsys.readouterr().err


# -- issue 23: per-request failures, disconnects, timeouts, drain -----------------------------------


def test_a_failed_request_fails_its_own_job_only():
    """The engine reports a request as an exception: job B (which owns it) fails with
    JobFailed naming its index in B; jobs A and C (queued with it) get their results; B's other
    queued request is never computed; the token count returns to 0."""
    from logprobe.server.batcher import JobFailed

    seen = []
    gate = threading.Event()

    def engine(requests, cancelled=None):
        gate.wait(10)
        seen.append([r.tokens[0] for r in requests])
        out = FakeEngine()(requests)
        return [ValueError("too big") if r.tokens[0] == 21 else x for r, x in zip(requests, out)]

    b = Batcher(engine, max_batch_tokens=10, max_queue_requests=10, max_queue_tokens=1000, batching=True)

    async def main():
        b.start()
        tasks = [asyncio.ensure_future(b.submit(j)) for j in ([req(10, 10)], [req(10, 20), req(10, 21), req(10, 22)],
                                                             [req(10, 30)])]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        depth = b.queue_depth
        b.close()
        return out, depth

    out, depth = asyncio.run(main())
    assert isinstance(out[1], JobFailed) and out[1].index == 1 and str(out[1]) == "too big"
    assert [r.logprobs[0].item() for r in out[0]] == [10] and [r.logprobs[0].item() for r in out[2]] == [30]
    ran = [t for step in seen for t in step]
    assert sorted(ran) == [10, 20, 21, 30]  # 22, queued behind the failure, was never computed
    assert depth == (0, 0)


def test_cancelled_and_timed_out_jobs_are_never_computed():
    from logprobe.server.batcher import JobTimeout

    gate = threading.Event()
    engine = FakeEngine(gate)
    drops = []
    b = Batcher(engine, max_batch_tokens=8, max_queue_requests=10, max_queue_tokens=1000, on_drop=drops.append)

    async def main():
        b.start()
        first = asyncio.ensure_future(b.submit([req(8, 1)]))  # holds the engine
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(b.submit([req(5, 2), req(5, 3)]))
        late = asyncio.ensure_future(b.submit([req(5, 4)], timeout=0.1))
        patient = asyncio.ensure_future(b.submit([req(5, 5)], timeout=30))
        await asyncio.sleep(0.02)
        assert b.queue_depth == (4, 8 + 10 + 5 + 5)
        gone.cancel()  # the client disconnected
        with pytest.raises(JobTimeout, match="not started within 0.1 s"):
            await late
        assert b.queue_depth == (2, 8 + 5)
        gate.set()
        await asyncio.gather(first, patient)
        depth = b.queue_depth
        b.close()
        return depth

    assert asyncio.run(main()) == (0, 0)
    assert engine.calls == [[1], [5]]
    assert sorted(drops) == ["disconnected", "timeout"]


def test_drain_finishes_the_queue_or_fails_the_rest():
    """drain(t): no new jobs; queued ones finish when the engine can within t; past t the rest fail
    with ServerClosed (counted as 'shutdown')."""
    gate = threading.Event()
    engine = FakeEngine(gate)
    drops = []
    b = Batcher(engine, max_batch_tokens=8, max_queue_requests=10, max_queue_tokens=1000, on_drop=drops.append)

    async def main():
        b.start()
        jobs = [asyncio.ensure_future(b.submit([req(8, t)])) for t in (1, 2, 3)]
        await asyncio.sleep(0.05)
        drained = asyncio.ensure_future(asyncio.to_thread(b.drain, 0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(ServerClosed):  # no new jobs while draining
            await b.submit([req(1, 9)])
        gate.set()  # the engine runs: all three finish within the grace period
        assert await drained == 0
        out = await asyncio.gather(*jobs)
        b.close()
        return out

    assert [r[0].logprobs[0].item() for r in asyncio.run(main())] == [1, 2, 3]

    gate2 = threading.Event()
    b2 = Batcher(FakeEngine(gate2), max_batch_tokens=8, max_queue_requests=10, max_queue_tokens=1000,
                 on_drop=drops.append)

    async def stuck():
        b2.start()
        jobs = [asyncio.ensure_future(b2.submit([req(8, t)])) for t in (1, 2)]
        await asyncio.sleep(0.05)
        failed = await asyncio.to_thread(b2.drain, 0.2)  # the engine never moves: both fail
        out = await asyncio.gather(*jobs, return_exceptions=True)
        gate2.set()
        b2.close()
        return failed, out

    drops.clear()
    failed, out = asyncio.run(stuck())
    assert failed == 2 and all(isinstance(x, ServerClosed) for x in out) and drops == ["shutdown", "shutdown"]


@pytest.mark.parametrize("remaining, budget, want", [
    ([[10, 10, 10, 10], [10], [10, 10]], 40, [(0, 0), (1, 0), (2, 0), (0, 1)]),  # test_round_robin_gold's 1st step
    ([[10], [10, 10]], 40, [(0, 0), (1, 0), (1, 1)]),  # ... and its 2nd: turn order C, A -> C1, A2, A3
    ([[5, 5, 5], [3], [20]], 16, [(0, 0), (1, 0), (0, 1)]),  # C0 never fits; A2 no longer fits
    ([[50, 1], [2]], 16, [(0, 0)]),  # the first request over the budget fills the step alone
    ([[2, 50], [50], [3]], 16, [(0, 0), (2, 0)]),  # too large after the first: passed over
    ([[], [4, 4]], 8, [(1, 0), (1, 1)]),  # an empty job is skipped; budget spent exactly
    ([[1] * 5], 3, [(0, 0), (0, 1), (0, 2)]),
])
def test_round_robin_pure_gold(remaining, budget, want):
    from logprobe.server.steps import round_robin

    assert round_robin(remaining, budget) == want


class _Executor:
    """A stand-in executor: request 1 fails alone (out of memory even alone)."""

    in_process = True

    def __init__(self, per_request_errors: bool) -> None:
        self.per_request_errors = per_request_errors

    def run(self, requests, on_result=None, progress=None, *, on_error=None, stop=None, cancelled=None):
        if on_error is None:
            return ["a", "b", "c"]
        on_error(1, MemoryError("alone"))
        return ["a", None, "c"]


def test_engine_call_reads_the_executor_interface():
    """One engine call for both executors: per-request errors land in their slots; an executor
    of worker processes is run without on_error. Engine and ParallelEngine both state the
    interface (no isinstance on the engine class anywhere)."""
    out = engine_call(_Executor(per_request_errors=True))([None] * 3)
    assert out[0] == "a" and isinstance(out[1], MemoryError) and out[2] == "c"
    assert engine_call(_Executor(per_request_errors=False))([None] * 3) == ["a", "b", "c"]
    members = ("per_request_errors", "in_process", "config", "run", "close")
    for cls in (Engine, ParallelEngine):
        assert all(hasattr(cls, m) for m in members), cls
    assert (Engine.per_request_errors, Engine.in_process) == (True, True)
    assert (ParallelEngine.per_request_errors, ParallelEngine.in_process) == (False, False)
    assert isinstance(_Executor(True), Executor) is False  # no config: not an executor


# -- pipelined steps: half of the queue computes while the other half's answers travel -----------


@pytest.mark.parametrize("queued, budget, want", [
    (100_000, 32_768, 32_768), (65_536, 32_768, 32_768), (65_535, 32_768, 32_768), (40_001, 32_768, 20_001),
    (20_000, 32_768, 10_000), (10_000, 32_768, 8192), (0, 32_768, 8192), (3, 16, 4), (40, 40, 20),
])
def test_step_budget_gold(queued, budget, want):
    from logprobe.server.steps import step_budget

    assert step_budget(queued, budget) == want


def test_queued_cost_counts_shared_and_cached_contexts_once_and_stops_at_its_limit():
    from logprobe.server.steps import Remaining, StepCost, queued_cost

    prompt = [7] * 10
    group = [ScoreRequest(prompt + [5, 6 + k], 10) for k in range(3)]  # 11 inputs, 10 shared
    jobs = [group[:2], group[2:], [req(5, 9)]]

    def total(cost, limit=1000):
        return queued_cost([Remaining(j, 0, cost) for j in jobs], limit)

    assert total(StepCost()) == 11 + 1 + 1 + 5
    assert total(StepCost(), 12) == 12  # stops at the limit
    # the prefix cache holds 8 tokens of each context (the last job's whole 1-token context)
    assert total(StepCost(lambda tokens, limit: min(8, limit))) == 3 + 1 + 1 + 4


def pipelined_calls(jobs, budget):
    gate = threading.Event()
    engine = FakeEngine(gate)
    b = Batcher(engine, max_batch_tokens=budget, max_queue_requests=64, max_queue_tokens=10_000, pipeline=True)

    async def main():
        b.start()
        tasks = [asyncio.ensure_future(b.submit(j)) for j in jobs]
        await asyncio.sleep(0.05)  # all queued before the engine may run
        gate.set()
        out = await asyncio.gather(*tasks)
        b.close()
        return out

    return engine.calls, asyncio.run(main())


def test_pipelined_steps_take_half_of_the_queue():
    """Four one-request jobs of 10 tokens, budget 40: the first step takes half of the queue (20),
    the second half of what is left (10: a quarter of the budget; the turn has moved on by one, so
    it starts at the second job left), the last job runs alone. Without pipelining all four are one
    step (test_round_robin_gold's rule)."""
    calls, out = pipelined_calls([[req(10, t)] for t in (1, 2, 3, 4)], 40)
    assert calls == [[1, 2], [4], [3]]
    assert [r[0].logprobs[0].item() for r in out] == [1, 2, 3, 4]


def test_pipelined_steps_keep_a_prompts_samples_together():
    """An RL group sent one request per sample (10-token prompt, 2-token responses: 11 inputs, 1
    once the prompt is in the step) and a 5-token job between them; budget 40. The queue is 18
    tokens, so a step's share is 10 (a quarter of the budget): the first sample alone fills it, and
    the other samples, which a later step would make compute the prompt again, join as companions."""
    prompt = [7] * 10
    group = [[ScoreRequest(prompt + [5, 6 + k], 10)] for k in range(3)]
    calls, out = pipelined_calls([group[0], [req(5, 5)], group[1], group[2]], 40)
    assert calls == [[7, 7, 7], [5]]
    assert [len(r) for r in out] == [1] * 4


def test_pipelined_steps_leave_a_single_job_whole():
    """One job alone in the queue is one step as before: splitting it would only delay its answer."""
    calls, _ = pipelined_calls([[req(10, t) for t in (1, 2, 3, 4)]], 40)
    assert calls == [[1, 2, 3, 4]]


def test_pipeline_steps_config_and_flag():
    from logprobe.cli.main import build_parser
    from logprobe.errors import LogprobeError
    from logprobe.server import ServerConfig

    assert ServerConfig().pipeline_steps is False
    with pytest.raises(LogprobeError, match="pipeline_steps: must be True or False"):
        ServerConfig(pipeline_steps="no")
    args = build_parser().parse_args(["serve", "--pipeline-steps", "--switch-interval", "0.001"])
    assert args.pipeline_steps is True and args.switch_interval == 0.001
    args = build_parser().parse_args(["serve"])
    assert args.pipeline_steps is False and args.switch_interval == ServerConfig().switch_interval

"""One engine call's host/device synchronisations (what would stall the host on CUDA), counted on
the CPU as the ops that read a tensor's value back to Python (``.item()``, ``int()``, ``bool()``)
or size their output by its values (``nonzero``), and the host-side checks that replace them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from logprobe import Scorer
from logprobe.engine.request import ScoreRequest
from logprobe.errors import LogprobeError
from logprobe.layers.logprob_head import HeadParams, logprob_head

SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}


class Syncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [{}, {"prefix_cache": True}, {"deterministic": True},
                                {"deterministic": True, "prefix_cache": True}])
def test_engine_call_reads_nothing_back(tiny_dirs, kw):
    """A call without top-k reads no tensor value on the host: planning, packing, the forward
    pass and the head run on lists and tensors only (the results' one copy back excepted)."""
    s = Scorer(str(tiny_dirs["llama"][0]), device="cpu", dtype="float32", progress=False, **kw)
    prompt = list(range(10, 30))
    s.engine.run([ScoreRequest(prompt + [5, 6, 7], len(prompt))])
    with Syncs() as c:  # resumed from the cached prompt where the cache is on
        res = s.engine.run([ScoreRequest(prompt + [8, 9, 4, 3], len(prompt), temperature=0.7)])[0]
    assert c.ops == []
    assert len(res.logprobs) == 4


@pytest.mark.parametrize("tokens, temperature, field", [
    ([5, 6, 99999], 1.0, "requests[0].tokens"), ([5, 6, -1], 1.0, "requests[0].tokens"),
    ([5, 6, 7], 0.0, "requests[0].temperature"), ([5, 6, 7], float("nan"), "requests[0].temperature")])
def test_engine_checks_targets_on_host(tiny_dirs, tokens, temperature, field):
    s = Scorer(str(tiny_dirs["llama"][0]), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match=field.replace("[", r"\[").replace("]", r"\]")):
        s.engine.run([ScoreRequest(tokens, 2, temperature=temperature)])


def test_head_still_checks_unless_told():
    h, p = torch.randn(3, 8), HeadParams(weight=torch.randn(20, 8))
    with pytest.raises(LogprobeError, match="targets"):
        logprob_head(h, p, torch.tensor([1, 2, 20]))
    with pytest.raises(LogprobeError, match="temperature"):
        logprob_head(h, p, torch.tensor([1, 2, 3]), torch.tensor([1.0, 0.0, 1.0]))
    y = torch.tensor([1, 2, 3])
    with Syncs() as c:
        a = logprob_head(h, p, y, 0.5, vocab_chunk=7, checked=True)
    assert c.ops == []
    b = logprob_head(h, p, y, 0.5, vocab_chunk=7)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.ranks, b.ranks)
    z = (h.double() @ p.weight.double().T) / 0.5
    assert torch.equal(a.ranks, (z > z.gather(1, y[:, None])).sum(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"prefix_cache": True}])
def test_cuda_call_syncs_only_for_results(tiny_dirs, kw):
    """On CUDA, PyTorch's sync debug mode names every synchronising call: between the plan and the
    results' copy a call without top-k has none (the results' event is waited on outside it)."""
    import warnings

    s = Scorer(str(tiny_dirs["llama"][0]), device="cuda", dtype="bfloat16", progress=False, **kw)
    prompt = list(range(10, 30))
    s.engine.run([ScoreRequest(prompt + [5, 6, 7], len(prompt))])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            s.engine.run([ScoreRequest(prompt + [8, 9, 4, 3], len(prompt), temperature=0.7)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message).lower()]
    assert [x for x in syncs if "engine/host.py" not in x] == [], syncs  # host.py: the results' wait

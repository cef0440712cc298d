"""``kernels.topk.topk_rows`` (a router's top-k experts) against its definition ``topk_reference``
and ``torch.topk``: under Triton's interpreter on CPU (fresh process) and on CUDA."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

from logprobe.kernels.topk import topk_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
NAN, INF = float("nan"), float("inf")


def test_reference_gold():
    """Largest first, equal values by column, NaN before every number, -0.0 kept."""
    x = torch.tensor([[0.1, 0.7, 0.2, 0.7], [-INF, -INF, 1.0, NAN], [-0.0, -1.0, -INF, -2.0]])
    v, i = topk_reference(x, 3)
    assert i.tolist() == [[1, 3, 2], [3, 2, 0], [0, 1, 3]]
    assert v[0].tolist() == [x[0, 1].item(), x[0, 3].item(), x[0, 2].item()]
    assert torch.isnan(v[1, 0]) and v[1, 1:].tolist() == [1.0, -INF]
    assert v[2].tolist() == [-0.0, -1.0, -2.0] and torch.signbit(v[2, 0])


CASES = """[((37, 128), 8, torch.float32), ((5, 8, 32), 2, torch.float32), ((9, 256), 8, torch.bfloat16),
            ((4, 60), 60, torch.float16), ((3, 1000), 5, torch.float32)]"""


def check(device: str) -> dict:
    """Per case: the kernel equals the definition (values and columns) and, on float32 rows
    without ties, ``torch.topk``; the gold rows of ``test_reference_gold``."""
    from logprobe.kernels.topk import topk_rows

    g = torch.Generator().manual_seed(0)
    out = {"def": [], "torch": []}
    for shape, k, dt in eval(CASES):
        x = torch.softmax(torch.randn(*shape, generator=g) * 3, -1).to(device, dt)
        v, i = topk_rows(x, k)
        rv, ri = topk_reference(x, k)
        out["def"].append(bool(torch.equal(v, rv) and torch.equal(i, ri)))
        if dt == torch.float32:
            tv, ti = torch.topk(x, k, dim=-1)
            out["torch"].append(bool(torch.equal(v, tv) and torch.equal(i, ti)))
    x = torch.tensor([[0.1, 0.7, 0.2, 0.7], [-INF, -INF, 1.0, NAN], [-0.0, -1.0, -INF, -2.0]], device=device)
    v, i = topk_rows(x, 3)
    out["gold"] = i.tolist() == [[1, 3, 2], [3, 2, 0], [0, 1, 3]] and bool(torch.isnan(v[1, 0])) and bool(
        torch.signbit(v[2, 0])) and v[2].tolist() == [-0.0, -1.0, -2.0]
    return out


@pytest.mark.slow  # Triton's interpreter in a fresh process
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton; no CUDA needed)")
def test_kernel_interpreted():
    r = run_interpreted(textwrap.dedent("""
        import json
        from test_topk_kernel import check
        print(json.dumps(check("cpu")))
    """))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"def": [True] * 5, "torch": [True] * 3, "gold": True}


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
def test_kernel_cuda():
    assert check("cuda") == {"def": [True] * 5, "torch": [True] * 3, "gold": True}
    from logprobe.kernels.topk import topk_rows

    x = torch.softmax(torch.randn(60000, 128, device="cuda"), -1)  # a pass of Qwen3-30B-A3B's router
    assert all(torch.equal(a, b) for a, b in zip(topk_rows(x, 8), torch.topk(x, 8, dim=-1)))
    assert all(torch.equal(a, b) for a, b in zip(topk_rows(x[:777], 8), (t[:777] for t in topk_rows(x, 8))))

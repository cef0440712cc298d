"""``kernels.sliced_matmul``: deterministic mode's row-parallel product (S inner slices added by the
fixed pairwise tree in registers). Against its PyTorch reference, and the property that makes TP
sizes agree: the S-slice kernel on all of K equals, bitwise, the S/2-slice kernel on each half
added (TP = 2) and the S/4-slice kernel on each quarter added as (q0 + q1) + (q2 + q3) (TP = 4);
rows are batch-invariant. On CPU under Triton's interpreter, and on CUDA in bf16."""

import importlib.util

import pytest
import torch
from helpers import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None

CHECK = """
import torch
from logprobe.kernels.sliced_matmul import sliced_linear, sliced_linear_reference
dev, dt = {dev!r}, getattr(torch, {dt!r})
g = torch.Generator().manual_seed(0)
for (M, K, N) in [(37, 256, 48), (130, 512, 70)]:
    x = torch.randn(M, K, generator=g).to(dev, dt); w = (torch.randn(N, K, generator=g) / K**0.5).to(dev, dt)
    for S in (1, 2, 4, 8):
        d = float((sliced_linear(x, w, S) - sliced_linear_reference(x, w, S)).abs().max())
        assert d < {tol}, (M, K, N, S, d)
    full = sliced_linear(x, w, 8)
    part = lambda a, b, s: sliced_linear(x[:, a:b].contiguous(), w[:, a:b].contiguous(), s)
    h, q = K // 2, K // 4
    assert torch.equal(full, part(0, h, 4) + part(h, K, 4)), "TP=2"
    assert torch.equal(full, (part(0, q, 2) + part(q, h, 2)) + (part(h, 3 * q, 2) + part(3 * q, K, 2))), "TP=4"
    assert torch.equal(sliced_linear(x[:5].contiguous(), w, 8), full[:5]), "rows"
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_sliced_matmul_under_the_interpreter():
    r = run_interpreted(CHECK.format(dev="cpu", dt="float32", tol=1e-4))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and Triton")
def test_sliced_matmul_on_cuda():
    exec(CHECK.format(dev="cuda", dt="bfloat16", tol=2e-2), {})


def test_reference_errors():
    from logprobe.errors import LogprobeError
    from logprobe.kernels.sliced_matmul import sliced_linear_reference

    with pytest.raises(LogprobeError, match="power of two"):
        sliced_linear_reference(torch.zeros(2, 12), torch.zeros(3, 12), 3)
    with pytest.raises(LogprobeError, match="do not divide"):
        sliced_linear_reference(torch.zeros(2, 12), torch.zeros(3, 12), 8)

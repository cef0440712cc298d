import os

import pytest
import torch

from logprobe.kernels import short_conv
from logprobe.layers.gated_delta import causal_conv1d

pytestmark = pytest.mark.skipif(not short_conv.triton_available(), reason="needs triton")
interp = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not interp and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 4, 9], [0, 2, 2, 11]])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(cu, with_state, with_bias, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    T, C, K = 9 if cu is None else cu[-1], 12, 4
    N = 1 if cu is None else len(cu) - 1
    x = torch.randn(T, C, generator=g).to(dtype).to(dev)
    w = torch.randn(C, K, generator=g).to(dtype).to(dev)
    b = torch.randn(C, generator=g).to(dtype).to(dev) if with_bias else None
    s = torch.randn(N, C, K - 1, generator=g).to(dtype).to(dev) if with_state else None
    cut = None if cu is None else torch.tensor(cu)
    for act in (None, "silu"):
        y, f = short_conv.causal_conv1d_triton(x, w, cut, s, b, act, block_t=4, block_c=8)
        ry, rf = causal_conv1d(x, w, cut, s, b, act)
        assert torch.equal(f, rf)
        if act is None:
            assert torch.equal(y, ry)  # taps and bias: same order, same roundings
        else:
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(y.float(), ry.float(), rtol=tol, atol=tol)

import os

import pytest
import torch

from logprobe.kernels import short_conv
from logprobe.layers.gated_delta import causal_conv1d

triton = pytest.importorskip("triton")

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


def _ptx(**constexprs) -> str:
    """The conv kernel's PTX for an H100 (sm_90), built on this machine: no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "s_ptr": "*bf16", "seq_ptr": "*i64",
           "start_ptr": "*i64", "y_ptr": "*bf16", "T": "i32", "C": "i32"}
    sig.update({k: "constexpr" for k in ("K", "HAS_BIAS", "SILU", "LIBDEVICE_EXP", "BT", "BC")})
    consts = dict(K=4, HAS_BIAS=True, LIBDEVICE_EXP=short_conv.libdevice is not None, BT=32, BC=128, **constexprs)
    src = ASTSource(short_conv._conv_kernel, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=short_conv.CUDA_OPTIONS).asm["ptx"]


@pytest.mark.skipif(interp, reason="compiles the CUDA build: not under the interpreter")
def test_cuda_build_rounds_each_product():
    """The CUDA build as the wrapper launches it: no FMA in the taps (a fused multiply-add would
    round once where the reference rounds twice), the SiLU's division correctly rounded (div.rn,
    not Triton's approximate one), bfloat16 stored rounded to nearest."""
    try:
        taps = _ptx(SILU=False)
    except Exception as e:  # a Triton without an NVIDIA backend here
        pytest.skip(f"cannot build for sm_90 here: {type(e).__name__}")
    assert "fma" not in taps and "mul.rn.f32" in taps and "add.rn.f32" in taps
    assert "cvt.rn.bf16" in taps
    silu = _ptx(SILU=True)
    assert "div.rn.f32" in silu and "div.full" not in silu and "div.approx" not in silu

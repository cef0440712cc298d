"""The Triton W4A16 dequant-GEMM against its PyTorch reference (``w4a16_reference``).

* CPU, Triton's interpreter (``TRITON_INTERPRET=1`` in a fresh process): float32 and float16,
  tiny odd shapes, symmetric and asymmetric, group-aligned tiles and a partial last group.
* CUDA: bfloat16/float16 at model shapes, and ``CTLinear`` dispatching to the kernel.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def make_w4(N, K, group, asym, seed=0, device="cpu"):
    """Random int4 codes packed as compressed-tensors does (independently of the loader's unpacker)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (N, K), generator=g)  # signed int4
    u = torch.nn.functional.pad(codes + 8, (0, (-K) % 8)).view(N, -1, 8)  # [N, words, 8] unsigned
    words = sum((u[..., i].to(torch.int64) << (4 * i)) for i in range(8))  # [N, words]
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    G = -(-K // group)
    scale = (torch.rand(N, G, generator=g) * 0.02 + 0.005).to(torch.float16)
    zero = torch.randint(-3, 4, (N, G), generator=g).to(torch.int8) if asym else None
    # the definition, elementwise from the codes: (q - z) * s
    gi = torch.arange(K) // group
    w = (codes.float() - (zero.float()[:, gi] if asym else 0)) * scale.float()[:, gi]
    return qweight.to(device), scale.to(device), None if zero is None else zero.to(device), w.to(device)


def test_reference_expands_the_packing():
    from logprobe.kernels.w4a16 import dequantize_w4

    for asym in (False, True):
        qw, s, z, w = make_w4(24, 200, 64, asym, seed=2)
        assert torch.equal(dequantize_w4(qw, s, z, 64, 200), w)


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(x) for x in version("triton").split(".")[:2])


@pytest.mark.skipif(not HAS_TRITON or _triton_version() < (3, 9), reason="needs Triton >= 3.9 (interpreter)")
def test_interpreter_matches_reference():
    code = textwrap.dedent("""
        import json, torch
        from test_w4a16 import make_w4
        from logprobe.kernels.w4a16 import W4A16Config, dequantize_w4, w4_expand, w4a16_matmul, w4a16_reference
        res = {}
        expand = {}
        for N, K, group, asym in [(40, 200, 64, False), (33, 160, 32, True), (17, 96, 96, True)]:
            qw, s, z, _ = make_w4(N, K, group, asym, seed=N)
            for dtype in (torch.float32, torch.float16):
                expand[f"{N}-{dtype}"] = torch.equal(w4_expand(qw, s, z, group, K, dtype),
                                                     dequantize_w4(qw, s, z, group, K).to(dtype))
        cfg = W4A16Config(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)
        for dtype in ("float32", "float16"):
            for M, N, K, group, asym in [(5, 40, 200, 64, False), (19, 48, 160, 32, True), (3, 17, 96, 96, True)]:
                qw, s, z, _ = make_w4(N, K, group, asym, seed=M)
                x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
                y = w4a16_matmul(x, qw, s, z, group, cfg)
                ref = w4a16_reference(x.float(), qw, s, z, group)
                res[f"{dtype}-{M}-{group}-{asym}"] = [float((y.float() - ref).abs().max()), float(ref.abs().max())]
        print(json.dumps({"matmul": res, "expand": expand}))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["expand"] == {k: True for k in out["expand"]} and len(out["expand"]) == 6, out["expand"]
    res = out["matmul"]
    assert len(res) == 6
    for name, (err, scale) in res.items():
        tol = 1e-5 if name.startswith("float32") else 2e-3  # float16: x and w rounded to 11 bits
        assert err <= tol * max(1.0, scale), (name, err, scale)


gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("M, N, K, group, asym", [(1, 4096, 4096, 128, False), (300, 1024, 4096, 128, True),
                                                  (2048, 14336, 4096, 128, False), (77, 576, 1536, 64, True)])
def test_cuda_matches_reference(dtype, M, N, K, group, asym):
    from logprobe.kernels.w4a16 import w4a16_matmul, w4a16_reference

    qw, s, z, _ = make_w4(N, K, group, asym, seed=M, device="cuda")
    x = torch.randn(M, K, device="cuda").to(getattr(torch, dtype))
    y = w4a16_matmul(x, qw, s, z, group)
    ref = w4a16_reference(x, qw, s, z, group)  # the same rounded weights, cuBLAS products
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * ref.float().abs().max().item(), err


@gpu
@pytest.mark.parametrize("M", [1, 255, 256, 3000])
def test_cuda_linear_dispatch_and_expand(M):
    from logprobe.kernels.w4a16 import dequantize_w4, w4_expand, w4a16_linear, w4a16_reference

    qw, s, z, _ = make_w4(1024, 2048, 128, True, seed=M, device="cuda")
    assert torch.equal(w4_expand(qw, s, z, 128, 2048, torch.bfloat16),
                       dequantize_w4(qw, s, z, 128, 2048).to(torch.bfloat16))
    x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
    y = w4a16_linear(x, qw, s, z, 128)
    ref = w4a16_reference(x, qw, s, z, 128)
    assert (y.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()


@gpu
def test_ctlinear_uses_the_kernel_on_cuda():
    from logprobe.layers.quant_linear import CTLinear

    qw, s, z, w = make_w4(256, 512, 128, True, seed=3, device="cuda")
    layer = CTLinear(qw, s, z, 4, 128, 512)
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    ref = torch.nn.functional.linear(x, w.to(torch.bfloat16))
    assert (y.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()

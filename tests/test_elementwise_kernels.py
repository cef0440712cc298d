"""Triton SiLU-multiply and rotary (kernels/elementwise.py) against their PyTorch references, on
strided inputs as the model passes them (halves / heads of fused projection outputs). On CPU they
run under Triton's interpreter (fresh process; tiny shapes); on CUDA in bfloat16 and float32, and
the whole native model with the kernels on vs off."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def check_all(device: str, dtypes, T: int, inter: int, heads: int, head_dim: int) -> dict:
    """max |Δ| of each kernel to its reference and to float64 (relative where |value| > 1 for
    SiLU-multiply, whose outputs reach ~50), per dtype, on strided views."""
    from logprobe.kernels.elementwise import rotary, rotary_reference, silu_mul, silu_mul_reference
    from logprobe.layers.rotary import RotaryEmbedding

    out = {}
    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        dtype = getattr(torch, dt)
        gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(device, dtype)  # fused gate/up output
        gate, up = gu.chunk(2, dim=-1)  # [T, I] views, row stride 2I
        y = silu_mul(gate, up)
        exact = torch.nn.functional.silu(gate.double()) * up.double()
        ref = silu_mul_reference(gate, up).double()
        out[f"silu-{dt}"] = {"ref": float(((y.double() - ref) / ref.abs().clamp_min(1)).abs().max()),
                             "f64": float(((y.double() - exact) / exact.abs().clamp_min(1)).abs().max())}
        qkv = torch.randn(T, (heads + 2) * head_dim, generator=g).to(device, dtype)
        q = qkv[:, : heads * head_dim].reshape(T, heads, head_dim)  # [T, H, D] view, row stride (H+2)D
        pos = torch.arange(T, device=device) * 37 + 5  # large angles too
        cis = RotaryEmbedding(head_dim, 10000.0).to(device)(pos)
        r = rotary(q, cis)
        qc = torch.view_as_complex(q.double().reshape(T, heads, head_dim // 2, 2))
        exact = torch.view_as_real(qc * cis.to(torch.complex128)[:, None, :]).reshape(T, heads, head_dim)
        out[f"rotary-{dt}"] = {"ref": float((r.double() - rotary_reference(q, cis).double()).abs().max()),
                               "f64": float((r.double() - exact).abs().max())}
        out[f"pair-{dt}"] = pair_equals_two_calls(qkv, heads, head_dim, cis)
    return out


def pair_equals_two_calls(qkv: torch.Tensor, heads: int, head_dim: int, cis: torch.Tensor) -> dict:
    """``rotary_pair`` on q and k views of a fused q/k/v output (k with fewer heads, as GQA's) and
    on k alone with 3 heads (a block size of its own): 0 bits differ from two ``rotary`` calls."""
    from logprobe.kernels.elementwise import rotary, rotary_pair

    T = qkv.shape[0]
    q = qkv[:, : heads * head_dim].reshape(T, heads, head_dim)  # [T, H, D]
    k = qkv[:, heads * head_dim:(heads + 1) * head_dim].reshape(T, 1, head_dim)  # [T, 1, D]
    k3 = torch.cat([k, k * 0.5, -k], 1)  # [T, 3, D] contiguous
    bits = 0
    for kk in (k, k3):
        yq, yk = rotary_pair(q, kk, cis)
        bits += int((yq != rotary(q, cis)).sum()) + int((yk != rotary(kk, cis)).sum())
    return {"ref": float(bits), "f64": 0.0}


def _assert_ok(res: dict, tol: dict) -> None:
    for name, d in res.items():
        ref, f64 = tol[name.split("-")[1]]
        assert d["ref"] <= ref and d["f64"] <= f64, (name, d)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_interpreter_elementwise_kernels():
    code = textwrap.dedent("""
        import json
        from test_elementwise_kernels import check_all
        print(json.dumps(check_all("cpu", ["float32", "float16"], 9, 40, 3, 12)))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # float32: the reference to a few ulps; float16: one rounding of the output (2^-11 relative)
    _assert_ok(res, {"float32": (2e-6, 1e-5), "float16": (8e-3, 1e-3)})
    assert res["pair-float32"]["ref"] == 0 and res["pair-float16"]["ref"] == 0  # bit for bit
    assert len(res) == 6


def test_wrappers_reject_bad_input():
    from logprobe.errors import LogprobeError
    from logprobe.kernels.elementwise import rotary, rotary_pair, silu_mul

    with pytest.raises(LogprobeError, match="gate"):
        silu_mul(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(LogprobeError, match="cis"):
        rotary(torch.randn(3, 2, 8), torch.randn(3, 4))
    with pytest.raises(LogprobeError, match="even D"):
        rotary(torch.randn(3, 2, 7), torch.randn(3, 3))
    cis = torch.ones(3, 4, dtype=torch.complex64)
    with pytest.raises(LogprobeError, match=r"\[3, Hk, 8\]"):
        rotary_pair(torch.randn(3, 2, 8), torch.randn(3, 2, 6), cis)
    with pytest.raises(LogprobeError, match="k: must be"):
        rotary_pair(torch.randn(3, 2, 8), torch.randn(3, 2, 7), cis)


def test_cpu_paths_ignore_the_triton_switch():
    """On CPU the layers run PyTorch whatever the switch says: same bits either way."""
    from logprobe.layers.activation import silu_mul
    from logprobe.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_pair

    g, u = torch.randn(5, 16), torch.randn(5, 16)
    assert torch.equal(silu_mul(g, u, True), silu_mul(g, u, False))
    assert torch.allclose(silu_mul(g, u, False), torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-7)
    x, cis = torch.randn(5, 2, 8), RotaryEmbedding(8, 10000.0)(torch.arange(5))
    assert torch.equal(apply_rotary(x, cis, True), apply_rotary(x, cis, False))
    k = torch.randn(5, 1, 8)
    for a, b in zip(apply_rotary_pair(x, k, cis, True), (apply_rotary(x, cis, False), apply_rotary(k, cis, False))):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_elementwise_kernels():
    res = check_all("cuda", ["float32", "bfloat16"], 3000, 1000, 32, 128)
    print(res)
    # bfloat16: one output rounding is 2^-8 relative; rotary outputs reach |x| ~ 4
    _assert_ok(res, {"float32": (2e-6, 1e-5), "bfloat16": (3e-2, 2e-2)})
    assert res["pair-float32"]["ref"] == 0 and res["pair-bfloat16"]["ref"] == 0  # bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_model_with_and_without_elementwise_kernels():
    """The native model's log-probs with the Triton RMSNorm/rotary/SiLU-multiply equal the
    PyTorch ops' within bfloat16 noise, and float32 within 1e-4."""
    from logprobe.layers.attention import AttentionMeta
    from logprobe.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.15)):
        model = LlamaModel(cfg).cuda().to(dtype).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.05)
        model.fuse_projections()
        ids = torch.randint(0, 1000, (300,), device="cuda")
        pos = torch.cat([torch.arange(100), torch.arange(200)]).cuda()
        meta = AttentionMeta.packed([100, 200])
        with torch.no_grad():
            on = model(ids, pos, meta).float()
            model.use_triton_elementwise(False)
            off = model(ids, pos, meta).float()
        assert float((on - off).abs().max()) < tol * float(off.abs().max()), dtype

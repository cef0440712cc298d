"""The fused gated RMSNorm of linear-attention mixers (``kernels.rmsnorm.gated_rmsnorm``, Qwen3.5 /
Qwen3-Next ``RowGatedRMSNorm`` on CUDA) against its references.

* Bitwise against the rounding sequence of the separate-kernel path (``invariant_rmsnorm``, then the
  float32 SiLU gate, rounded once) in float32, float16 and bfloat16, with the gate a strided slice of
  a wider projection; within a stated bound of the PyTorch reference ``gated_rms_norm`` and of float64.
* Batch invariance: a row's bits do not depend on how many rows come with it or where it sits.
* A tiny Qwen3.5 through the engine with the kernel in every linear-attention layer (z read in place
  from the fused projection): log-probs within float32 rounding of the PyTorch norm's and of float64
  transformers.

CPU: Triton's interpreter in a fresh process (``helpers.run_interpreted``), where SiLU's exp is
NumPy's, so the bitwise checks use NumPy's SiLU; on CUDA (``-m gpu``) PyTorch's own SiLU.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_interpreted

from logprobe.kernels import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
EPS = 1e-6


def _silu(z: torch.Tensor) -> torch.Tensor:
    """float32 SiLU as the kernel computes it here: NumPy's exp under the interpreter, PyTorch's
    (CUDA's expf) on a GPU."""
    import numpy as np

    if z.is_cuda:
        return torch.nn.functional.silu(z.float())
    zn = z.float().numpy()
    return torch.from_numpy(zn / (np.float32(1) + np.exp(-zn)))


def _expected(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The separate-kernel path (``gated_rmsnorm_reference``); on CPU its roundings with each cast
    done by PyTorch: the statistics from ``invariant_rmsnorm`` in float32 (the interpreter has no
    bfloat16 arithmetic), ``.to(x.dtype)``, the weight in promote(w, x), the gate in float32, one
    final rounding."""
    from logprobe.kernels.rmsnorm import gated_rmsnorm_reference, invariant_rmsnorm

    if x.is_cuda:  # the separate kernels themselves
        return gated_rmsnorm_reference(x, z, w, EPS)
    ones = torch.ones(x.shape[-1], device=x.device)
    xn = invariant_rmsnorm(x.float(), ones, EPS).to(x.dtype)  # x / rms(x), rounded as the kernel rounds it
    normed = w * xn  # PyTorch's product: in promote(w, x), rounded to nearest even
    return (normed * _silu(z)).to(x.dtype)


def _inputs(device: str, dtype: torch.dtype, T: int, Hv: int, D: int, w_dtype=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, Hv, D, generator=g) * 3).to(device, dtype)
    wide = (torch.randn(T, Hv * D + 7, generator=g) * 4).to(device, dtype)  # [T, Hv D + 7]: z a slice of it
    z = wide[:, 3:3 + Hv * D].view(T, Hv, D)  # [T, Hv, D], row stride Hv D + 7
    w = torch.randn(D, generator=g).to(device, w_dtype or dtype)
    return x, z, w


def check_kernel(device: str, T: int, Hv: int, D: int) -> dict:
    """Per case: bitwise equal to ``_expected``; max |Δ| to the PyTorch reference and to float64; a
    row's bits alone and among others."""
    from logprobe.kernels.rmsnorm import gated_rmsnorm
    from logprobe.layers.gated_delta import gated_rms_norm

    out = {}
    cases = [("float32", None), ("float16", None), ("bfloat16", None), ("bfloat16", torch.float32)]
    for name, w_dtype in cases:
        dtype = getattr(torch, name)
        x, z, w = _inputs(device, dtype, T, Hv, D, w_dtype)
        assert not z.is_contiguous()
        y = gated_rmsnorm(x, z, w, EPS)
        assert y.dtype == dtype and y.shape == x.shape
        f64 = gated_rms_norm(x.double(), z.double(), w.double(), EPS)
        ref = gated_rms_norm(x, z, w, EPS)
        alone = [gated_rmsnorm(x[t:t + 1], z[t:t + 1], w, EPS) for t in (0, T // 2, T - 1)]
        mid = gated_rmsnorm(x[1:T - 2].clone(), z[1:T - 2], w, EPS)  # rows at other places in their programs
        key = name + ("-w32" if w_dtype else "")
        exp = _expected(x, z, w)
        out[key] = {
            "bitwise": bool(torch.equal(y, exp)),
            "n_diff": int((y != exp).sum()), "err_expected": float((y.double() - exp.double()).abs().max()),
            "err_ref": float((y.double() - ref.double()).abs().max()),
            "err_f64": float((y.double() - f64).abs().max()),
            "scale": float(f64.abs().max()),
            "invariant": all(torch.equal(a, y[t:t + 1]) for a, t in zip(alone, (0, T // 2, T - 1)))
            and bool(torch.equal(mid, y[1:T - 2])),
        }
    # the contiguous gate gives the same bits as its strided copy
    x, z, w = _inputs(device, torch.bfloat16, T, Hv, D, seed=1)
    out["contiguous_z"] = bool(torch.equal(gated_rmsnorm(x, z, w, EPS), gated_rmsnorm(x, z.contiguous(), w, EPS)))
    return out


# float32: a few ulp of the reference's rsqrt/mean and SiLU; half types: a rounding flip of the
# normed value or of the result (one ulp at |y| up to the scale)
REL_BOUND = {"float32": 1e-6, "float16": 2 ** -9, "bfloat16": 2 ** -6, "bfloat16-w32": 2 ** -6}


def _assert_kernel(res: dict) -> None:
    assert res.pop("contiguous_z")
    for key, d in res.items():
        assert d["bitwise"] and d["invariant"], (key, d)
        assert d["err_ref"] <= REL_BOUND[key] * d["scale"] * 2, (key, d)
        assert d["err_f64"] <= REL_BOUND[key] * d["scale"] * 2, (key, d)


def _interpreted(code: str) -> str:
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def check_layer(device: str) -> bool:
    """``RowGatedRMSNorm`` picks the kernel in default and deterministic modes where it runs (the
    CUDA selection patched in on CPU), the PyTorch reference otherwise and for float64."""
    from logprobe.layers.gated_delta import gated_rms_norm
    from logprobe.layers.numerics import Numerics
    from logprobe.models import qwen3_next

    if device == "cpu":
        qwen3_next.triton_norm_runs = lambda x: True
    norm = qwen3_next.RowGatedRMSNorm(16, EPS).to(device)
    x, z, w = _inputs(device, torch.bfloat16, 5, 3, 16)
    norm.weight.data = w
    fused = _expected(x, z, w)
    for numerics, want in ((Numerics(), fused), (Numerics(deterministic=True), fused),
                           (Numerics(triton=False), gated_rms_norm(x, z, w, EPS))):
        norm.set_numerics(numerics)
        if not torch.equal(norm(x, z), want):
            return False
    norm.weight.data = w.double()
    return torch.equal(norm(x.double(), z.double()), gated_rms_norm(x.double(), z.double(), w.double(), EPS))


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@needs_triton
def test_kernel_and_layer_interpreted():
    # D = 24: a 32-wide block with masked columns; 16 rows a program, so rows cross programs
    code = ("import json\nfrom test_gated_rmsnorm import check_kernel, check_layer\n"
            "print(json.dumps({'layer': check_layer('cpu'), **check_kernel('cpu', 9, 5, 24)}))")
    res = json.loads(_interpreted(code))
    assert res.pop("layer")
    _assert_kernel(res)


def test_refuses_what_it_does_not_compute():
    from logprobe.errors import LogprobeError
    from logprobe.kernels.rmsnorm import gated_rmsnorm, gated_rmsnorm_supports

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert not gated_rmsnorm_supports(x, x, torch.ones(4))
    assert not gated_rmsnorm_supports(x.float(), x.float()[:, :2], torch.ones(4))
    with pytest.raises(LogprobeError):
        gated_rmsnorm(x.float(), x.float(), torch.ones(5), EPS)  # width
    if not torch.cuda.is_available():
        with pytest.raises(LogprobeError, match="device"):
            gated_rmsnorm(x.float(), x.float(), torch.ones(4), EPS)  # CPU without the interpreter


def check_model(path: str) -> str:
    """The tiny Qwen3.5 at ``path`` with ``RowGatedRMSNorm`` on the Triton kernel (the CUDA
    selection patched in): its log-probs against the PyTorch norm's and float64 transformers'
    (saved at ``path/want.pt``), every linear-attention layer through the kernel."""
    from test_hybrid_engine import mix

    from logprobe import Scorer
    from logprobe.kernels import rmsnorm
    from logprobe.loading import load_model
    from logprobe.models import qwen3_next

    loaded = load_model(path, "cpu", "float32")
    reqs, want = mix(1)[-3:-1], torch.load(f"{path}/want.pt")
    ref = Scorer(loaded).engine.run(reqs)
    calls = []
    kernel = rmsnorm.gated_rmsnorm
    qwen3_next.gated_rmsnorm = lambda x, z, w, eps: calls.append(z.is_contiguous()) or kernel(x, z, w, eps)
    qwen3_next.triton_norm_runs = lambda x: True
    got = Scorer(loaded).engine.run(reqs)
    assert len(calls) >= 3 and not any(calls), calls  # three layers, z read in place from the fused projection
    worst = 0.0
    for a, b, w in zip(ref, got, want):
        assert (b.logprobs.double() - w).abs().max() < 1e-4  # float32's floor vs float64 here
        worst = max(worst, float((a.logprobs - b.logprobs).abs().max()))
    assert worst < 1e-5, worst
    return f"ok {worst:.2e}"


@pytest.mark.slow
@needs_triton
def test_tiny_qwen35_interpreted(tmp_path):
    import inspect

    from test_hybrid_engine import mix, save_tiny_qwen35
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    mp = pytest.MonkeyPatch()
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):  # fla-core's do not run on CPU
        mp.setattr(mod, name, inspect.unwrap(getattr(mod, name)))
    try:
        save_tiny_qwen35(tmp_path, mix(1)[-3:-1])
    finally:
        mp.undo()
    out = _interpreted(f"from test_gated_rmsnorm import check_model\nprint(check_model({str(tmp_path)!r}))")
    assert out.startswith("ok"), out


@pytest.mark.gpu
@cuda
def test_kernel_and_layer_on_cuda():
    _assert_kernel(check_kernel("cuda", 300, 32, 128))
    assert check_layer("cuda")

"""The Triton q/k L2 norm and head copy (``kernels.qk_norm.heads_triton``, what hands fla-core its
inputs on CUDA) against the PyTorch form ``heads_reference`` and a float64 truth.

Inputs are what the rule gets: strided ``[T, H, D]`` views of a conv output ``y [T, C]``.

* float32: within 2.4e-7 (two float32 ulp at 1) of the PyTorch form, 1e-6 of the float64 truth;
* bfloat16 / float16: every element within one ulp of the dtype of the PyTorch form's (the float32
  results differ by a few ulp, so a rounding may land on the other side of a half);
* the copy (``normalize=False``): bit for bit;
* batch invariance: a row's bits whatever T and wherever the row sits;
* ``fla_inputs`` with the kernel equals it without, to the same bounds, all three contiguous;
* a whole tiny Qwen3.5 through the engine on the CUDA path as far as the CPU goes (the Triton conv
  on the fused projection's strided columns, then the kernel's q, k, v into the reference rule):
  log-probs within 1e-4 of the float64 transformers ones and 3e-5 of the reference path, and
  deterministic mode alone vs packed bitwise (slow tier).

CPU: Triton's interpreter in a fresh process (``helpers.run_interpreted``); CUDA (``-m gpu``): the same
checks on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_interpreted
from test_short_conv_model import hf_torch_kernels  # noqa: F401 (a fixture)

from logprobe.kernels import triton_available
from logprobe.kernels.qk_norm import heads_reference

HK, HV, DK, DV = 2, 3, 12, 8  # Dk not a power of two: masked lanes


def _views(y: torch.Tensor):
    T = y.shape[0]
    q = y[:, :HK * DK].view(T, HK, DK)  # [T, C] -> strided [T, Hk, Dk]
    k = y[:, HK * DK:2 * HK * DK].view(T, HK, DK)
    v = y[:, 2 * HK * DK:].view(T, HV, DV)
    return q, k, v


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One ulp of x's dtype at each element of x (as float32)."""
    mant = torch.finfo(x.dtype).eps  # 2^-(mantissa bits)
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(torch.finfo(x.dtype).tiny)))) * mant


def check_heads(device: str) -> None:
    from logprobe.kernels.gated_delta import fla_inputs
    from logprobe.kernels.qk_norm import heads_triton

    gen = torch.Generator().manual_seed(0)
    T = 53  # several token tiles, the last partial
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = (torch.randn(T, 2 * HK * DK + HV * DV + 3, generator=gen) * 2)[:, :-3].to(dtype).to(device)
        q, k, v = _views(y)
        assert not q.is_contiguous()
        for x in (q, k):
            got, ref = heads_triton(x, dtype, True), heads_reference(x, dtype, True)
            assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
            truth = x.double() / (x.double().square().sum(-1, keepdim=True) + 1e-6).sqrt()
            if dtype == torch.float32:
                assert (got - ref).abs().max() <= 2.4e-7 and (got - truth).abs().max() < 1e-6
            else:
                assert ((got.float() - ref.float()).abs() <= _ulp(ref)).all(), dtype
                assert ((got.double() - truth).abs() <= _ulp(ref)).all(), dtype  # rounded once
            for n in (1, 16, 17, 40):  # batch invariance: fewer rows, and the rows shifted
                assert torch.equal(heads_triton(x[:n], dtype, True), got[:n])
                assert torch.equal(heads_triton(x[n:], dtype, True), got[n:])
        assert torch.equal(heads_triton(v, dtype, False), v.contiguous())
        got, ref = fla_inputs(q, k, v, True, triton=True), fla_inputs(q, k, v, True, triton=False)
        tol = 2.4e-7 if dtype == torch.float32 else _ulp(ref[0])  # per element
        assert all(t.is_contiguous() and t.dtype == dtype for t in got + ref)
        assert ((got[0].float() - ref[0].float()).abs() <= tol).all() and torch.equal(got[2], ref[2])
    y64 = torch.randn(T, 2 * HK * DK + HV * DV, generator=gen, dtype=torch.float64).to(device)
    q, k, v = _views(y64)
    got = fla_inputs(q, k, v, True, triton=True)
    assert all(t.dtype == torch.float32 for t in got)  # fla computes in float32, as the PyTorch form
    assert (got[1] - fla_inputs(q, k, v, True, triton=False)[1]).abs().max() <= 2.4e-7
    assert torch.equal(got[2], v.float())
    assert heads_triton(q[:0], torch.float32, True).shape == (0, HK, DK)


needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@needs_triton
def test_heads_interpreted():
    r = run_interpreted("from test_qk_norm import check_heads\ncheck_heads('cpu')\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def check_model(path: str) -> None:
    """The tiny Qwen3.5 at ``path`` (``test_short_conv_model``'s, with ``want.pt``) through the engine
    with the Triton conv and the rule fed by ``fla_inputs(..., triton=True)``."""
    from test_hybrid_engine import mix, packed_like_alone
    from test_short_conv_model import _conv

    from logprobe import Scorer
    from logprobe.kernels.gated_delta import fla_inputs
    from logprobe.layers.gated_delta import gated_delta_rule_chunked
    from logprobe.loading import load_model
    from logprobe.models import qwen3_next

    def rule(q, k, v, g, beta, cu_seqlens=None, initial_state=None):
        q, k, v = fla_inputs(q, k, v, True, triton=True)  # what fla would get on CUDA
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        return gated_delta_rule_chunked(q, k, v, g, beta, cu_seqlens, initial_state, qk_l2norm=False)

    loaded = load_model(path, "cpu", "float32")
    reqs, want = mix(1), torch.load(f"{path}/want.pt")
    ref = Scorer(loaded).engine.run(reqs)
    conv = _conv(64, 64)
    qwen3_next.gated_delta_kernels = lambda device, deterministic, triton=True, dtype=None: (rule, conv)
    for a, b, w in zip(ref, Scorer(loaded).engine.run(reqs), want):
        assert (b.logprobs.double() - w).abs().max() < 1e-4  # float32's floor (the reference: ~7e-5)
        assert (a.logprobs - b.logprobs).abs().max() < 3e-5
    packed_like_alone(loaded, reqs, (64, 1 << 20))


@pytest.mark.slow
@needs_triton
def test_tiny_qwen35_interpreted(tmp_path, hf_torch_kernels):  # noqa: F811
    from test_hybrid_engine import mix, save_tiny_qwen35

    save_tiny_qwen35(tmp_path, mix(1))
    r = run_interpreted(f"from test_qk_norm import check_model\ncheck_model({str(tmp_path)!r})\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_reference_is_the_float32_norm_rounded():
    x = torch.tensor([[[3.0, 4.0]], [[0.0, 0.0]]])  # [T=2, H=1, D=2]; a zero row stays zero
    assert heads_reference(x, torch.bfloat16, True).float().tolist() == [[[0.6015625, 0.80078125]], [[0.0, 0.0]]]
    assert torch.equal(heads_reference(x, torch.float32, False), x)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
def test_heads_on_cuda():
    check_heads("cuda")

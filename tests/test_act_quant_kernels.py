"""The 8-bit activation-quantized kernels (``kernels/act_quant.py``) against their PyTorch definitions.

* CPU, Triton's interpreter (a fresh process with ``TRITON_INTERPRET=1``): the quantizer's codes
  and scales are the reference's bit for bit (a sweep over the whole e4m3 range, ties, -0,
  subnormals; int8; per token, per group, static); the scaled GEMM is within 2e-7 (relative to
  the largest output) of the float64 product of the same codes and scales, per-channel, per
  block and with a K tail, FP8 and INT8; a row's result is the same bits in any batch.
* CUDA (skipped without one): the same on the GPU at model shapes, and ``ActQuantLinear`` with
  ``kernels = True`` against its float32 reference path, deterministic batch invariance included.
* ``silu_mul_quantize`` (SiLU(gate) * up and its per-token codes in one pass): a hand-checked gold
  row, then the reference's codes and scales bit for bit under the interpreter (e4m3 and int8;
  float32, bfloat16, float16; strided halves, a zero row, exp overflow, width 300); on CUDA the
  two-kernel path's bits (``quantize_rows(silu_mul(...))``) and ``down_proj.gated`` = ``down_proj(silu_mul)``.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

from logprobe.config import Numerics
from logprobe.kernels import triton_available
from logprobe.kernels.act_quant import (
    KINDS,
    quantize_rows_reference,
    scaled_matmul_reference,
    silu_mul_quantize_reference,
)

HAS_CUDA = torch.cuda.is_available()


def deterministic(row_tile: int | None) -> Numerics:
    """Deterministic mode's numerics with ``row_tile`` (None: the default mode), as the engine hands them."""
    return Numerics(deterministic=row_tile is not None, row_tile=row_tile, column_blocks=row_tile is not None)


def test_reference_worked_example():
    """The docstring's example: s = 7/448 = 1/64; 336 is a tie between 320 and 352 and goes to 320."""
    codes, s = quantize_rows_reference(torch.tensor([[2.0, -7.0, 5.25, 0.0]]), "float")
    assert codes.float().tolist() == [[128.0, -448.0, 320.0, 0.0]] and s.tolist() == [[1 / 64]]
    codes, s = quantize_rows_reference(torch.tensor([[2.0, -127.5, 0.5, 1.5]]), "int")
    assert codes.tolist() == [[2, -128, 0, 2]] and s.tolist() == [[1.0]]  # half to even: 0.5 -> 0, 1.5 -> 2


def test_matmul_reference_expands_scales_over_their_groups():
    a = torch.tensor([[1, 2, 3, 4]], dtype=torch.int8)
    b = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.int8)
    sa = torch.tensor([[0.5]])  # one scale for the row
    sb = torch.tensor([[1.0, 10.0], [2.0, 3.0]])  # per row, per block of 2 columns
    y = scaled_matmul_reference(a, sa, 4, b, sb, 2, torch.tensor([0.25, 0.0]), torch.float64)
    # row 0 of b: 0.5 * (1*1 + 2*1) * 1 + 0.5 * (3 + 4) * 10 = 1.5 + 35; row 1: 0.5 * 2 * 2 + 0.5 * 4 * 3
    assert y.tolist() == [[36.75, 8.0]]


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter)")
def test_interpreter_matches_reference():
    code = textwrap.dedent("""
        import json, torch
        from logprobe.kernels.act_quant import *
        g = torch.Generator().manual_seed(0)
        out = {"codes": {}, "mm": {}}
        sweep = torch.cat([torch.linspace(-460, 460, 30001), torch.tensor([
            2.0, -7.0, 5.25, 0.0, -0.0, -1e-9, 1e-9, 2**-10, 3 * 2**-10, -5 * 2**-10, 2**-6 * 1.0625, 464.0, -1e30])])
        c, s = quantize_rows(sweep.view(1, -1), "float", None, torch.tensor([1.0]))
        cr, sr = quantize_rows_reference(sweep.view(1, -1), "float", None, torch.tensor([1.0]))
        out["codes"]["sweep"] = torch.equal(c.view(torch.uint8), cr.view(torch.uint8))
        for kind in ("float", "int"):
            for group in (None, 32):
                x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7).view(7, 1)
                x[3] = 0
                c, s = quantize_rows(x, kind, group)
                cr, sr = quantize_rows_reference(x, kind, group)
                out["codes"][f"{kind}-{group}"] = torch.equal(c.view(torch.uint8), cr.view(torch.uint8)) and \\
                    torch.equal(s, sr)
            c, s = quantize_rows(x, kind, None, torch.tensor([0.05]))
            cr, sr = quantize_rows_reference(x, kind, None, torch.tensor([0.05]))
            out["codes"][f"{kind}-static"] = torch.equal(c.view(torch.uint8), cr.view(torch.uint8)) and torch.equal(s, sr)
        cfg = ActQuantConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1)
        for kind in ("float", "int"):
            for M, N, K, ga, gb in [(5, 40, 100, None, 100), (19, 33, 128, 32, 32), (3, 17, 64, None, 32)]:
                x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
                wc, ws = quantize_rows_reference(w, kind, gb)
                xc, xs = quantize_rows(x, kind, ga)
                bias = torch.randn(N, generator=g)
                y = scaled_matmul(xc, xs, ga or K, wc, ws, gb, bias, torch.float32, cfg)
                ref = scaled_matmul_reference(xc, xs, ga or K, wc, ws, gb, bias, torch.float64)
                # 16 other rows (one row tile) first: each row keeps its place in its tile, because the
                # interpreter's tl.dot is a NumPy product whose BLAS may round a tile's edge rows differently
                both = scaled_matmul(torch.cat([xc.flip(0).repeat(16, 1)[:16], xc]),
                                     torch.cat([xs.flip(0).repeat(16, 1)[:16], xs]), ga or K, wc, ws, gb,
                                     bias, torch.float32, cfg)
                out["mm"][f"{kind}-{M}-{K}-{ga}-{gb}"] = [float((y.double() - ref).abs().max() / ref.abs().max()),
                                                         torch.equal(both[16:], y)]
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["codes"] == {k: True for k in out["codes"]} and len(out["codes"]) == 7, out["codes"]
    assert len(out["mm"]) == 6
    for name, (err, invariant) in out["mm"].items():
        assert err <= 2e-7 and invariant, (name, err, invariant)


gpu = pytest.mark.skipif(not (HAS_CUDA and triton_available()), reason="needs a CUDA GPU and Triton")


@gpu
@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize("M, N, K, ga, gb", [(1, 4096, 4096, None, 4096), (300, 6144, 4096, None, 4096),
                                             (2048, 4096, 14336, 128, 128), (77, 1024, 2048, None, 128)])
def test_cuda_matches_reference(kind, M, N, K, ga, gb):
    from logprobe.kernels.act_quant import quantize_rows, scaled_matmul

    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02
    wc, ws = quantize_rows_reference(w, kind, gb)
    xc, xs = quantize_rows(x, kind, ga)
    xcr, xsr = quantize_rows_reference(x, kind, ga)
    assert torch.equal(xc.view(torch.uint8), xcr.view(torch.uint8)) and torch.equal(xs, xsr)
    y = scaled_matmul(xc, xs, ga or K, wc, ws, gb, None, torch.float32)
    ref = scaled_matmul_reference(xc, xs, ga or K, wc, ws, gb, None, torch.float64)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 1e-6
    both = scaled_matmul(torch.cat([xc, xc]), torch.cat([xs, xs]), ga or K, wc, ws, gb, None, torch.float32)
    assert torch.equal(both[M:], y) and torch.equal(both[:M], y)


@gpu
@pytest.mark.parametrize("kind, block_cols, act_group", [("float", 2048, None), ("float", 128, 128), ("int", 2048, None)])
def test_cuda_layer_kernels_match_its_reference_path(kind, block_cols, act_group):
    from logprobe.layers.act_quant_linear import ActQuantLinear

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 2048, device="cuda", generator=g) * 0.02
    codes, scale = quantize_rows_reference(w, kind, block_cols)  # [N, K], [N, K / block_cols]
    layer = ActQuantLinear(codes, scale, block_cols, kind, act_group=act_group,
                           bias=torch.randn(1536, device="cuda", generator=g))
    x = torch.randn(3, 100, 2048, device="cuda", generator=g).to(torch.bfloat16)
    layer.kernels = False  # an instance switch over the class default (on)
    ref = layer(x).float()  # float32 reference path
    layer.kernels = True
    assert layer.use_kernels(x)
    y = layer(x).float()
    assert y.shape == ref.shape
    assert float((y - ref).abs().max() / ref.abs().max()) <= 1e-2  # both cast to bfloat16 at the end
    layer.numerics = deterministic(2048)  # fixed tiles, never torch._scaled_mm
    y = layer(x).float()
    assert float((y - ref).abs().max() / ref.abs().max()) <= 1e-2
    alone = layer(x[1:2]).float()
    assert torch.equal(alone, y[1:2])  # a row's bits do not depend on its batch


def test_product_path_gold_table():
    """Which product multiplies the codes: (kind, out dtype, per-row scales, batch-invariant,
    fp8_tensor_cores, torch._scaled_mm row-wise there) -> path (``kernels.act_quant.product_path``)."""
    from logprobe.kernels.act_quant import product_path

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    table = [
        (("int", bf, True, False, None, True), "int8"),
        (("int", f32, False, True, True, True), "int8"),
        (("float", f32, True, False, None, True), "fp16"),  # float32 model: the exact product
        (("float", f32, True, False, True, True), "fp8-mma"),  # forced on: the kernel (scaled_mm is bf16 only)
        (("float", bf, True, False, None, True), "scaled_mm"),
        (("float", bf, True, False, None, False), "fp8-mma"),  # no row-wise scaled_mm on this GPU, or K / N not multiples of 16
        (("float", bf, True, True, None, True), "fp8-mma"),  # deterministic mode: fixed tiles
        (("float", bf, False, False, None, True), "fp8-mma"),  # 128-column blocks
        (("float", f16, True, False, None, True), "fp8-mma"),
        (("float", bf, True, False, False, True), "fp16"),  # forced off
    ]
    assert [product_path(*args) for args, _ in table] == [want for _, want in table]


@gpu
@pytest.mark.parametrize("M, N, K, ga, gb, invariant", [(300, 6144, 4096, None, 4096, False),
                                                        (4096, 4096, 14336, None, 14336, False),
                                                        (300, 6144, 4096, None, 4096, True),
                                                        (2048, 4096, 14336, 128, 128, False)])
def test_cuda_fp8_tensor_core_paths_within_bf16_rounding(M, N, K, ga, gb, invariant):
    """bf16 outputs take the FP8 tensor cores (``torch._scaled_mm`` or the kernel's FP8 MMA): their
    truncated partial sums stay under 5e-4 of the float64 product (a bf16 output's own rounding is
    up to 2e-3), and the fixed-tile kernel is batch-invariant."""
    from logprobe.kernels.act_quant import ActQuantConfig, quantize_rows, scaled_matmul

    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02
    wc, ws = quantize_rows_reference(w, "float", gb)
    xc, xs = quantize_rows(x, "float", ga)
    ref = scaled_matmul_reference(xc, xs, ga or K, wc, ws, gb, None, torch.float64)
    y = scaled_matmul(xc, xs, ga or K, wc, ws, gb, None, torch.bfloat16, deterministic=invariant)
    assert not torch.isnan(y).any()
    assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 5e-3  # bf16 output rounding included
    exact32 = scaled_matmul(xc, xs, ga or K, wc, ws, gb, None, torch.float32)
    mma32 = scaled_matmul(xc, xs, ga or K, wc, ws, gb, None, torch.float32, ActQuantConfig(fp8_tensor_cores=True))
    assert float((mma32.double() - ref).abs().max() / ref.abs().max()) <= 5e-4  # the MMA's truncation alone
    assert float((exact32.double() - ref).abs().max() / ref.abs().max()) <= 5e-6  # float32 sums over K = 14336
    if invariant:
        both = scaled_matmul(torch.cat([xc, xc]), torch.cat([xs, xs]), ga or K, wc, ws, gb, None, torch.bfloat16,
                             deterministic=True)
        assert torch.equal(both[M:], y) and torch.equal(both[:M], y)


def test_kernel_kinds_cover_the_layer_kinds():
    from logprobe.layers.act_quant_linear import ActQuantLinear

    assert set(KINDS) == {"float", "int"} and ActQuantLinear.kernels is True  # on: measured exact and 6x the float32 path


# -- SiLU(gate) * up quantized in one pass ------------------------------------------------------------------

# gate 20: SiLU = 20 / (1 + e^-20) rounds to 20 in float32; gate -200: e^200 overflows, SiLU = -200 / inf = -0
GOLD_GATE = [20.0, 20.0, 20.0, -200.0, 0.0, 20.0]
GOLD = {  # kind: (up, codes, scale)
    # y = [40, -140, 105, -0, 0, 10]: s = 140 / 448 = 5/16, y / s = [128, -448, 336, -0, 0, 32], 336 a tie -> 320
    "float": ([2.0, -7.0, 5.25, 3.0, 9.0, 0.5], [128.0, -448.0, 320.0, -0.0, 0.0, 32.0], 0.3125),
    # y = [40, -255, 105, -0, 0, 10]: s = 255 / 127.5 = 2, y / s = [20, -127.5, 52.5, 0, 0, 5], half to even
    "int": ([2.0, -12.75, 5.25, 3.0, 9.0, 0.5], [20.0, -128.0, 52.0, 0.0, 0.0, 5.0], 2.0),
}


def silu_quant_cases(device: str, dtypes, T: int, inter: int):
    """(name, gate, up) as the model passes them: the halves of a fused gate/up output [T, 2I]
    (row stride 2I), with a zero row, a row of large negative gates (exp overflow), and a row of
    gate 20 (SiLU = 20 exactly), whose products 20 * up round to the dtype with many exact ties."""
    g = torch.Generator().manual_seed(1)
    for dt in dtypes:
        dtype = getattr(torch, dt)
        gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
        gu[1, :inter] = 0
        gu[2, : inter // 2] = -200
        gu[3, :inter] = 20
        gate, up = gu.to(device).chunk(2, dim=-1)  # [T, I] views
        yield dt, gate, up


def check_silu_quant(device: str, dtypes, T: int, inter: int) -> dict:
    """Per (dtype, kind): codes and scales equal to the reference's; and to the two-kernel path's
    (Triton SiLU-multiply, then quantize_rows) where that path rounds right (not bfloat16 under the
    interpreter, whose own float32 -> bfloat16 cast truncates)."""
    from logprobe.kernels import interpreting
    from logprobe.kernels.act_quant import quantize_rows, silu_mul_quantize
    from logprobe.kernels.elementwise import silu_mul

    def same(a, b):
        return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

    out = {}
    for dt, gate, up in silu_quant_cases(device, dtypes, T, inter):
        for kind in ("float", "int"):
            got = silu_mul_quantize(gate, up, kind)
            ref = silu_mul_quantize_reference(gate, up, kind)
            two = None if interpreting() and dt == "bfloat16" else same(got, quantize_rows(silu_mul(gate, up), kind))
            out[f"{dt}-{kind}"] = {"ref": same(got, ref), "two": two, "shape": [list(got[0].shape), list(got[1].shape)],
                                   "codes_differ": int((got[0].float() != ref[0].float()).sum())}
    for kind, (up, *_) in GOLD.items():
        got = silu_mul_quantize(torch.tensor([GOLD_GATE], device=device), torch.tensor([up], device=device), kind)
        out[f"gold-{kind}"] = [got[0].float().tolist(), got[0].float().signbit().tolist(), got[1].tolist()]
    return out


def test_silu_mul_quantize_reference_gold_row():
    """The reference on the literal rows (the module docstring's example is the e4m3 one, x 20)."""
    for kind, (up, codes, scale) in GOLD.items():
        for dtype in (torch.float32, torch.bfloat16):
            c, s = silu_mul_quantize_reference(torch.tensor([GOLD_GATE], dtype=dtype), torch.tensor([up], dtype=dtype),
                                               kind)
            assert c.float().tolist() == [codes] and s.tolist() == [[scale]], (kind, dtype)
            assert c.float().signbit().tolist() == [[v < 0 or str(v) == "-0.0" for v in codes]]


def _assert_silu_quant(res: dict, dtypes, interpreted: bool) -> None:
    for kind, (_, codes, scale) in GOLD.items():
        got, sign, s = res.pop(f"gold-{kind}")
        assert got == [codes] and s == [[scale]] and sign == [[str(v).startswith("-") for v in codes]], (kind, got, s)
    assert len(res) == 2 * len(dtypes)
    for name, r in res.items():
        assert r["shape"][1][1] == 1 and r["shape"][0] == [r["shape"][1][0], r["shape"][0][1]], (name, r)
        skip_two = interpreted and name.startswith("bfloat16")
        assert r["two"] is (None if skip_two else True), (name, r)  # the unfused kernels' bits
        if interpreted:  # NumPy's float32 exp and PyTorch's agree where it matters for these inputs
            assert r["ref"], (name, r)


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter)")
def test_interpreter_silu_mul_quantize_matches_reference():
    code = textwrap.dedent("""
        import json
        from test_act_quant_kernels import check_silu_quant
        print(json.dumps(check_silu_quant("cpu", ["float32", "bfloat16", "float16"], 6, 300)))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_silu_quant(json.loads(r.stdout.strip().splitlines()[-1]), ["float32", "bfloat16", "float16"], True)


def test_silu_mul_quantize_rejects_bad_input():
    from logprobe.errors import LogprobeError
    from logprobe.kernels.act_quant import silu_mul_quantize

    with pytest.raises(LogprobeError, match="gate"):
        silu_mul_quantize(torch.randn(3, 4), torch.randn(3, 5), "float")
    with pytest.raises(LogprobeError, match="unit last stride"):
        silu_mul_quantize(torch.randn(4, 3).T, torch.randn(4, 3).T, "float")


@gpu
def test_cuda_silu_mul_quantize_matches_the_two_kernels():
    """On the GPU: the two-kernel path's codes and scales bit for bit at llama-8b's width; against
    the PyTorch reference, whose float32 exp differs from the GPU's in the last bits, almost all."""
    res = check_silu_quant("cuda", ["float32", "bfloat16"], 500, 14336)
    for name, r in res.items():
        if not name.startswith("gold"):
            assert r["codes_differ"] <= 1e-3 * 500 * 14336, (name, r)  # a last-bit SiLU difference at a tie
            r["ref"] = True
    _assert_silu_quant(res, ["float32", "bfloat16"], False)


@gpu
@pytest.mark.parametrize("kind, out_features", [("float", 4096), ("int", 4096), ("float", 1000)])
def test_cuda_gated_equals_down_proj_of_silu_mul(kind, out_features):
    """``down_proj.gated(gate, up, True)`` = ``down_proj(silu_mul(gate, up, True))`` bit for bit, by
    default (``torch._scaled_mm`` where it fits) and in deterministic mode (the fixed-tile kernel)."""
    from logprobe.layers.act_quant_linear import ActQuantLinear
    from logprobe.layers.activation import silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    inter = 14336
    w = torch.randn(out_features, inter, device="cuda", generator=g) * 0.02
    codes, scale = quantize_rows_reference(w, kind, inter)  # per channel
    layer = ActQuantLinear(codes, scale, inter, kind)
    gu = torch.randn(777, 2 * inter, device="cuda", generator=g).to(torch.bfloat16) * 3
    gate, up = gu.chunk(2, dim=-1)  # strided halves, as the model passes them
    for row_tile in (None, 128):
        layer.numerics = deterministic(row_tile)
        assert layer._gates_in_one_pass(gate, up, True)
        fused = layer.gated(gate, up, True)
        assert torch.equal(fused, layer(silu_mul(gate, up, True))), row_tile
        assert torch.equal(layer.gated(gate, up, False), layer(silu_mul(gate, up, False)))  # PyTorch SiLU: unfused
    layer.numerics = deterministic(128)
    assert torch.equal(layer.gated(gate[5:6], up[5:6], True), fused[5:6])  # batch-invariant


@gpu
def test_cuda_fused_layer_equals_its_parts_in_deterministic_mode():
    """q/k/v fused (``fuse_parts``): in deterministic mode (the fixed-tile kernel, one program per
    128 output columns) each column is the part's own, bit for bit."""
    from logprobe.layers.act_quant_linear import ActQuantLinear
    from logprobe.layers.linear import fuse_linears

    g = torch.Generator(device="cuda").manual_seed(0)
    parts = []
    for n in (4096, 1024, 1024):
        codes, scale = quantize_rows_reference(torch.randn(n, 4096, device="cuda", generator=g) * 0.02, "float", 4096)
        parts.append(ActQuantLinear(codes, scale, 4096, "float"))
        parts[-1].numerics = deterministic(128)
    x = torch.randn(300, 4096, device="cuda", generator=g).to(torch.bfloat16)
    alone = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_linears(parts)
    assert isinstance(fused, ActQuantLinear) and fused.out_features == 6144
    assert torch.equal(fused(x), alone) and torch.equal(torch.cat([p(x) for p in parts], dim=-1), alone)


@gpu
def test_cuda_native_llama_fused_equals_unfused():
    """A tiny native Llama in bfloat16 whose linears are FP8 per-channel ``ActQuantLinear``s, as an
    FP8_DYNAMIC checkpoint loads: fused (q/k/v, gate/up, ``down_proj.gated``) and unfused give the
    same hidden states, bit for bit in deterministic mode (fixed-tile kernel: a column is its part's)."""
    from logprobe.layers.act_quant_linear import ActQuantLinear
    from logprobe.layers.activation import silu_mul
    from logprobe.layers.attention import AttentionMeta
    from logprobe.layers.linear import Linear
    from logprobe.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    model = LlamaModel(cfg).cuda().to(torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    for layer in model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                old = getattr(owner, name)
                codes, scale = quantize_rows_reference(old.weight.float(), "float", old.in_features)
                new = ActQuantLinear(codes, scale, old.in_features, "float")
                new.adopt(old)
                setattr(owner, name, new)
    ids = torch.randint(0, 1000, (300,), device="cuda")
    pos = torch.cat([torch.arange(100), torch.arange(200)]).cuda()
    meta = AttentionMeta.packed([100, 200])

    def run(row_tile):
        for m in model.modules():
            if isinstance(m, Linear):
                m.numerics = deterministic(row_tile)
        with torch.no_grad():
            return model(ids, pos, meta).float()

    downs = [layer.mlp.down_proj for layer in model.layers]
    for d in downs:  # the unfused path: the SiLU-multiply kernel, then down_proj's quantizer and GEMM
        d.gated = lambda gate, up, triton, d=d: d(silu_mul(gate, up, triton))
    separate = {tile: run(tile) for tile in (None, 128)}
    for d in downs:
        del d.gated
    model.fuse_projections()
    assert all(isinstance(layer.self_attn.qkv_proj, ActQuantLinear) for layer in model.layers)
    assert torch.equal(run(128), separate[128])
    assert float((run(None) - separate[None]).abs().max()) <= 0.05 * float(separate[None].abs().max())

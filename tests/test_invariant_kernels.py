"""Batch-invariant kernels of deterministic mode on CUDA: the Triton matmul and RMSNorm against
their PyTorch references, and a row's bits independent of the rows beside it; the fused head's
deterministic split. On CPU they run under Triton's interpreter (fresh process; tiny shapes)."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def check_all(device: str, dtypes, M1: int, M2: int, K: int, N: int, H: int, config=None) -> dict:
    """max |Δ| to the references and whether the first M1 rows are bitwise the same when computed
    among M2 rows, per kernel and dtype."""
    import torch.nn.functional as F

    from logprobe.kernels.matmul import invariant_linear
    from logprobe.kernels.rmsnorm import invariant_rmsnorm

    out = {}
    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        dtype = getattr(torch, dt)
        x = torch.randn(M2, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
        b = torch.randn(N, generator=g).to(device, dtype)
        kw = {"config": config} if config is not None else {}
        y2 = invariant_linear(x, w, b, **kw)
        y1 = invariant_linear(x[:M1].clone(), w, b, **kw)
        ref = F.linear(x.double(), w.double(), b.double())
        out[f"matmul-{dt}"] = {"err": float((y2.double() - ref).abs().max()), "same": bool(torch.equal(y1, y2[:M1]))}
        for width, tag in ((H, ""), (12 if device == "cpu" else 128, "heads")):  # heads: many rows a program
            h = (torch.randn(M2, width, generator=g) * 3).to(device, dtype)
            gain = torch.randn(width, generator=g).to(device, dtype)
            r2 = invariant_rmsnorm(h, gain, 1e-5)
            r1 = invariant_rmsnorm(h[3:3 + M1].clone(), gain, 1e-5)  # rows at other places in their programs
            hf = h.float()
            want = gain * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            out[f"rmsnorm{tag}-{dt}"] = {"err": float((r2.double() - want.double()).abs().max()),
                                         "same": bool(torch.equal(r1, r2[3:3 + M1]))}
        # per-head rows read in place: heads of 12 / 128 columns, a slice of a wider projection output
        width, heads = (12, 3) if device == "cpu" else (128, 4)
        fused = (torch.randn(M2, 3 * heads * width, generator=g) * 3).to(device, dtype)
        q = fused[:, heads * width:2 * heads * width].reshape(M2, heads, width)  # strides (3 heads width, width, 1)
        gain = torch.randn(width, generator=g).to(device, dtype)
        got, whole = invariant_rmsnorm(q, gain, 1e-5), invariant_rmsnorm(q.contiguous().view(-1, width), gain, 1e-5)
        out[f"rmsnormstrided-{dt}"] = {"err": float((got.double() - whole.view(M2, heads, width).double()).abs().max()),
                                       "same": bool(got.shape == q.shape and got.is_contiguous()
                                                    and torch.equal(got.view(-1, width), whole))}
        # computed in float32, rounded once (Gemma's and Qwen3.5's offset gain, gpt-oss's): against
        # PyTorch's float32 chain; and against the kernel on a float32 copy of x, rounded after
        gain = 1.0 + torch.randn(H, generator=g).to(device) / 4
        h = (torch.randn(M2, H, generator=g) * 3).to(device, dtype)
        r2 = invariant_rmsnorm(h, gain, 1e-5, round_normed=False)
        r1 = invariant_rmsnorm(h[3:3 + M1].clone(), gain, 1e-5, round_normed=False)
        hf = h.float()
        want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * gain).to(dtype)
        copied = invariant_rmsnorm(hf, gain, 1e-5).to(dtype)
        out[f"rmsnormf32-{dt}"] = {"err": float((r2.double() - want.double()).abs().max()), "dtype": str(r2.dtype),
                                   "same": bool(torch.equal(r1, r2[3:3 + M1]) and r2.dtype == dtype),
                                   "as_copied": bool(torch.equal(r2, copied))}
    return out


def _assert_ok(res: dict, tol: dict) -> None:
    for name, d in res.items():
        assert d["same"], name
        assert d["err"] < tol[name.split("-")[1]], (name, d)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_interpreter_invariant_kernels():
    code = textwrap.dedent("""
        import json
        from test_invariant_kernels import check_all
        from logprobe.kernels.matmul import MatmulConfig
        cfg = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
        print(json.dumps(check_all("cpu", ["float32", "float16"], 13, 45, 40, 37, 48, cfg)))
    """)
    r = run_interpreted(code)
    if r.returncode != 0 and "only 0-dimensional arrays" in r.stderr:
        pytest.skip("this Triton's interpreter cannot run the kernel (seen with 3.6)")
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_ok(json.loads(r.stdout.strip().splitlines()[-1]), {"float32": 1e-5, "float16": 2e-2})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_invariant_kernels():
    res = check_all("cuda", ["float32", "bfloat16"], 100, 3000, 1024, 768, 2048)
    print(res)
    _assert_ok(res, {"float32": 1e-4, "bfloat16": 0.1})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_deterministic_head_rows_do_not_depend_on_n():
    from logprobe.layers.logprob_head import HeadParams, logprob_head

    g = torch.Generator().manual_seed(1)
    H, V = 512, 50000
    w = (torch.randn(V, H, generator=g) / H**0.5).cuda().bfloat16()
    h = torch.randn(5000, H, generator=g).cuda().bfloat16()
    y = torch.randint(0, V, (5000,), generator=g).cuda()
    big = logprob_head(h, HeadParams(w), y, 0.8, top_k=5, entropy=True, deterministic=True)
    small = logprob_head(h[:7].clone(), HeadParams(w), y[:7].clone(), 0.8, top_k=5, entropy=True, deterministic=True)
    for name in ("logprobs", "logsumexp", "ranks", "entropy", "topk_logprobs"):
        assert torch.equal(getattr(big, name)[:7], getattr(small, name)), name
    ref = logprob_head(h.float(), HeadParams(w.float()), y, 0.8, backend="torch")
    assert float((big.logprobs - ref.logprobs).abs().max()) < 1e-4


# ---- the matmul's other ways to run a tile: persistent programs, TMA descriptors -------------------------------

def check_matmul(device: str, dt: str, M1: int, M2: int, K: int, N: int, config, offset: int = 0) -> dict:
    """max |Δ| of ``invariant_linear`` to the float64 product, whether it took the TMA path, and
    bitwise: the first M1 rows alone vs among M2 rows (batch invariance); the last N - N//2 columns
    from ``weight[N//2:]`` alone vs in the full product (tensor-parallel invariance). ``offset``
    elements in front of x's storage: a base no TMA descriptor can address (the path must not change)."""
    import torch.nn.functional as F

    from logprobe.kernels.matmul import invariant_linear, uses_tma

    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dt)
    x = torch.randn(offset + M2 * K, generator=g).to(device, dtype)[offset:].view(M2, K)  # [M2, K]
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype)
    y = invariant_linear(x, w, b, config=config)
    ref = F.linear(x.double(), w.double(), b.double())
    rows = torch.equal(invariant_linear(x[:M1].clone(), w, b, config=config), y[:M1])
    h = N // 2
    cols = torch.equal(invariant_linear(x, w[h:], b[h:], config=config), y[:, h:])
    return {"err": float((y.double() - ref).abs().max()), "rows": rows, "cols": cols, "tma": uses_tma(x, config)}


def matmul_variants(small: bool) -> dict:
    """Configs of each path; small: the interpreter's 16x16x16 tiles (K loops of several steps)."""
    from logprobe.kernels.matmul import MatmulConfig

    tiles = dict(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1) if small else \
        dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return {
        "ptr-persistent": MatmulConfig(**tiles, tma=False, persistent=True, flatten=True),
        "tma": MatmulConfig(**tiles, tma=True, persistent=False, flatten=False),
        "tma-persistent": MatmulConfig(**tiles, tma=True, persistent=True, flatten=True),
        "tma-persistent-ptrstore": MatmulConfig(**tiles, tma=True, tma_store=False, persistent=True, flatten=True),
    }


def _assert_matmul_ok(res: dict, tol: dict, want_tma: bool) -> None:
    for name, d in res.items():
        assert d["rows"] and d["cols"], (name, d)
        assert d["err"] < tol[name.split("/")[1]], (name, d)
        if name.startswith("tma") and name.split("/")[1] != "float32":  # float32 always reads through pointers
            assert d["tma"] == want_tma, (name, d)
        else:
            assert not d["tma"], (name, d)


def test_uses_tma_only_where_asked_and_possible():
    from logprobe.kernels.matmul import MatmulConfig, uses_tma

    half = torch.zeros(3, 64, dtype=torch.float16)
    assert not uses_tma(half, MatmulConfig(tma=False))  # not asked
    assert not uses_tma(half, MatmulConfig())  # the default asks, but CPU outside the interpreter
    assert not uses_tma(torch.zeros(3, 64), MatmulConfig(tma=True))  # float32


def test_matmul_leaves_sms_to_collectives_where_they_overlap():
    from logprobe.config import COLLECTIVE_SMS, EngineConfig, numerics_for
    from logprobe.errors import LogprobeError
    from logprobe.kernels.matmul import DEFAULT_CONFIG, MatmulConfig, config_leaving

    det = EngineConfig(deterministic=True)
    assert numerics_for(det, "cuda", tp_size=2, tp_blocks=8, overlapped=True).collective_sms == COLLECTIVE_SMS == 16
    assert numerics_for(det, "cuda", tp_size=1).collective_sms == 0  # nothing runs beside it
    assert numerics_for(det, "cuda", tp_size=2, tp_blocks=8).collective_sms == 0  # heads split: never at once
    assert numerics_for(det, "cpu", tp_size=2, tp_blocks=8, overlapped=True).collective_sms == 0  # gloo: no SMs
    assert config_leaving(0) is DEFAULT_CONFIG and config_leaving(16) == MatmulConfig(free_sms=16)
    with pytest.raises(LogprobeError, match="free_sms"):
        MatmulConfig(free_sms=-1)


@pytest.mark.slow  # Triton's interpreter in a fresh process: the slow tier keeps the fast one within 4 minutes
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_interpreter_matmul_persistent_and_tma():
    # N = 40: y's rows 16-byte aligned (TMA store); N = 37: pointer store; K = 40: a K tail;
    # K = 36 (72 bytes a row): no TMA possible, pointers for every config; offset 1: x re-aligned;
    # 8x8 from 1 of 3 rows: blocks larger than the whole matrix
    code = textwrap.dedent("""
        import json
        from test_invariant_kernels import check_matmul, matmul_variants
        out = {}
        for name, cfg in matmul_variants(small=True).items():
            for dt in ["float16", "float32"]:
                for N, K, off, M1, M2 in [(40, 40, 0, 13, 45), (37, 40, 1, 13, 45), (40, 36, 0, 13, 45), (8, 8, 0, 1, 3)]:
                    out[f"{name}/{dt}/{N}x{K}+{off}"] = check_matmul("cpu", dt, M1, M2, K, N, cfg, off)
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    _assert_matmul_ok({k: v for k, v in res.items() if not k.endswith("x36+0")}, {"float32": 1e-5, "float16": 2e-2}, True)
    assert not any(v["tma"] for k, v in res.items() if k.endswith("x36+0")), res


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_matmul_persistent_and_tma():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    res = {}
    for name, cfg in matmul_variants(small=False).items():
        # float32 reads through pointers in every config: one of them checks it (each compile is slow)
        for dt in ["bfloat16", "float32"] if name == "tma-persistent" else ["bfloat16"]:
            # N = 768 / 772: TMA / pointer store; K = 1000: a K tail; offset 3: x re-aligned for TMA;
            # 24x16 from 1 of 5 rows: blocks larger than the whole matrix (decoding-sized calls)
            for N, K, off, M1, M2 in [(768, 1024, 0, 100, 3000), (772, 1000, 3, 100, 3000), (24, 16, 0, 1, 5)]:
                res[f"{name}/{dt}/{N}x{K}+{off}"] = check_matmul("cuda", dt, M1, M2, K, N, cfg, off)
    print(res)
    _assert_matmul_ok(res, {"float32": 1e-4, "bfloat16": 0.1}, hopper)


def _grids_bitwise(device: str, small: bool) -> dict:
    """Each dtype: the persistent grid against one program per tile, and against a persistent grid
    leaving SMs free for collectives (fewer programs, each looping over more tiles), bitwise."""
    from dataclasses import replace

    from logprobe.kernels.matmul import invariant_linear

    variants = matmul_variants(small)
    persistent, tiles = variants["tma-persistent"], replace(variants["tma-persistent"], persistent=False, flatten=False)
    g = torch.Generator().manual_seed(1)
    out = {}
    for dt, (M, K, N) in [("float16", (45, 40, 40)), ("float32", (45, 40, 37))] if small else \
            [("bfloat16", (3000, 1024, 768)), ("float32", (1000, 1000, 772))]:
        x = torch.randn(M, K, generator=g).to(device, getattr(torch, dt))
        w = (torch.randn(N, K, generator=g) / K**0.5).to(device, x.dtype)
        y = invariant_linear(x, w, None, persistent)
        out[dt] = torch.equal(y, invariant_linear(x, w, None, tiles))
        # the interpreter's 3 programs -> 2; a GPU's SMs -> 16 fewer (``config.COLLECTIVE_SMS``)
        out[f"{dt}/free"] = torch.equal(y, invariant_linear(x, w, None, replace(persistent, free_sms=1 if small else 16)))
    return out


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_interpreter_grids_give_the_same_bits():
    code = textwrap.dedent("""
        import json
        from test_invariant_kernels import _grids_bitwise
        print(json.dumps(_grids_bitwise("cpu", small=True)))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"float16": True, "float32": True, "float16/free": True,
                                                             "float32/free": True}


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and Triton")
def test_cuda_grids_give_the_same_bits():
    assert _grids_bitwise("cuda", small=False) == {"bfloat16": True, "float32": True, "bfloat16/free": True,
                                                   "float32/free": True}


def test_engine_leaves_sms_under_data_parallel_attention_only():
    """The engine derives its numerics with ``overlapped`` from its model's context: on CUDA the
    matmul leaves SMs to the collectives under data-parallel attention, never split by heads."""
    from types import SimpleNamespace

    from logprobe.config import COLLECTIVE_SMS, EngineConfig
    from logprobe.engine.runner import Engine
    from logprobe.parallel.context import ParallelContext

    def sms(ctx) -> int:
        fake = SimpleNamespace(_numerics=None, config=EngineConfig(deterministic=True), device=torch.device("cuda"),
                               _splittable=True, model=SimpleNamespace(ctx=ctx))
        return Engine.numerics.fget(fake).collective_sms

    assert sms(ParallelContext(0, 2, blocks=8, experts=2, attention="data")) == COLLECTIVE_SMS
    assert sms(ParallelContext(0, 2, blocks=8, experts=2, attention="tensor")) == 0
    assert sms(ParallelContext(blocks=8, attention="data")) == 0  # one rank: nothing to overlap
    assert sms(None) == 0  # the transformers backend: no context

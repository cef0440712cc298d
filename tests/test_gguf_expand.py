"""The Triton GGUF expansion (``kernels.gguf_expand``) is bitwise its PyTorch reference,
``dequantize_blocks(...).to(dtype)``, for every format.

* CPU, Triton's interpreter (``TRITON_INTERPRET=1`` in a fresh process): float32, bfloat16 and
  float16 outputs, row and block counts that are not multiples of the kernels' tiles. The
  interpreter never contracts a * b + c into an FMA, so it cannot check ``enable_fp_fusion=False``.
* CUDA: the same at larger shapes (this is where a fused multiply-add would show), and
  ``GGUFLinear.forward`` equal to F.linear on the reference expansion.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

from logprobe.kernels.gguf_quants import QUANT_NAMES, dequantize_blocks

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
QS_BYTES = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16, "Q4_K": 140, "Q6_K": 208}


def make_blocks(qtype: str, rows: int, nb: int, seed: int = 0, device="cpu"):
    """Random packed buffers in ``split_blocks``' layout: arbitrary code bytes, finite f16 scales
    of both signs (Q4_1's minimum and Q4_K's dmin too), about the sizes real files have."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (rows, nb, QS_BYTES[qtype]), generator=g, dtype=torch.uint8)
    if qtype == "Q8_0":
        qs = qs.view(torch.int8)
    d = ((torch.rand(rows, nb, generator=g) - 0.5) * (2e-3 if qtype in ("Q4_K", "Q6_K") else 2e-2)).half()
    m = ((torch.rand(rows, nb, generator=g) - 0.5) * 2e-2).half() if qtype in ("Q4_1", "Q4_K") else None
    return d.to(device), qs.to(device), None if m is None else m.to(device)


def test_reference_shapes():
    for qtype in QUANT_NAMES:
        d, qs, m = make_blocks(qtype, 3, 2)
        w = dequantize_blocks(qtype, d, qs, m)
        assert w.shape == (3, 2 * (256 if qtype in ("Q4_K", "Q6_K") else 32)) and torch.isfinite(w).all()


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_wrapper_refuses_bad_buffers():
    from logprobe.errors import LogprobeError
    from logprobe.kernels.gguf_expand import gguf_expand

    d, qs, m = make_blocks("Q4_K", 2, 1)
    for args in [("Q5_K", d, qs, m, torch.float32), ("Q4_K", d, qs, None, torch.float32),
                 ("Q4_K", d, qs[..., :128], m, torch.float32), ("Q4_K", d, qs, m, torch.float64)]:
        with pytest.raises(LogprobeError):
            gguf_expand(*args)


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(x) for x in version("triton").split(".")[:2])


@pytest.mark.skipif(not HAS_TRITON or _triton_version() < (3, 9), reason="needs Triton >= 3.9 (interpreter)")
def test_interpreter_bitwise():
    code = textwrap.dedent("""
        import json, torch
        from test_gguf_expand import make_blocks
        from logprobe.kernels.gguf_expand import gguf_expand
        from logprobe.kernels.gguf_quants import QUANT_NAMES, dequantize_blocks
        res = {}
        # rows not a multiple of the row tile (16 / 8), blocks not a multiple of the block tile (8)
        shapes = {"Q8_0": (19, 11), "Q4_0": (21, 9), "Q4_1": (17, 13), "Q4_K": (11, 3), "Q6_K": (9, 2)}
        for qtype in QUANT_NAMES:
            rows, nb = shapes[qtype]
            d, qs, m = make_blocks(qtype, rows, nb, seed=rows)
            ref = dequantize_blocks(qtype, d, qs, m)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                w = gguf_expand(qtype, d, qs, m, dtype)
                res[f"{qtype}-{dtype}"] = w.dtype == dtype and torch.equal(w, ref.to(dtype))
        # exact bfloat16 ties (1 + 2**-8 and 1 + 3 * 2**-8: round half to even, down then up), signs,
        # and float16 overflow to inf (60000 * 127)
        d = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 60000.0]]).half()
        qs = torch.ones(1, 4, 32, dtype=torch.int8)
        qs[0, 3] = 127
        ref = dequantize_blocks("Q8_0", d, qs)
        for dtype in (torch.bfloat16, torch.float16):
            res[f"edge-{dtype}"] = torch.equal(gguf_expand("Q8_0", d, qs, None, dtype), ref.to(dtype))
        # the layer's CUDA hook (called directly: forward only takes it for CUDA inputs)
        from logprobe.layers.quant_linear import GGUFLinear
        d, qs, m = make_blocks("Q4_K", 5, 1, seed=3)
        layer = GGUFLinear("Q4_K", d, qs, m, bias=torch.randn(5).to(torch.bfloat16))
        x = torch.randn(3, 256).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, dequantize_blocks("Q4_K", d, qs, m).to(x.dtype), layer.bias)
        res["layer"] = torch.equal(layer._cuda_forward(x), ref)
        # a packed (tied) embedding: the head's vocabulary chunks and lookups, in one pass
        from logprobe.layers.quant_linear import PackedEmbedding
        emb = PackedEmbedding(layer, torch.bfloat16)
        full = dequantize_blocks("Q4_K", d, qs, m)
        ids = torch.tensor([4, 0, 4, 2])
        res["embedding rows"] = torch.equal(emb.weight[1:4], full[1:4].to(torch.bfloat16)) and torch.equal(
            emb(ids), full[ids].to(torch.bfloat16)) and emb.weight[2:2].shape == (0, 256)
        print(json.dumps(res))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == 19 and res == {k: True for k in res}, res


@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_cuda_bitwise_and_linear():
    from logprobe.kernels.gguf_expand import gguf_expand
    from logprobe.layers.quant_linear import GGUFLinear

    dev = torch.device("cuda")
    for qtype in QUANT_NAMES:
        for rows, nb in [(37, 3), (300, 16)]:
            nbq = nb if qtype in ("Q4_K", "Q6_K") else nb * 8
            d, qs, m = make_blocks(qtype, rows, nbq, seed=rows, device=dev)
            ref = dequantize_blocks(qtype, d, qs, m)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                w = gguf_expand(qtype, d, qs, m, dtype)
                assert torch.equal(w, ref.to(dtype)), (qtype, rows, dtype, (w.float() - ref).abs().max())
        layer = GGUFLinear(qtype, d, qs, m, bias=torch.randn(rows, device=dev).to(torch.bfloat16))
        x = torch.randn(5, layer.in_features, device=dev, dtype=torch.bfloat16)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, ref.to(x.dtype), layer.bias)), qtype
        ids = torch.tensor([7, 0, 7, rows - 1], device=dev)  # the head's chunks and embedding lookups
        assert torch.equal(layer.rows_in(slice(3, 20), torch.bfloat16), ref[3:20].to(torch.bfloat16)), qtype
        assert torch.equal(layer.rows_in(ids, torch.bfloat16), ref[ids].to(torch.bfloat16)), qtype


def test_expand_all_equals_the_chunks_and_stays_off_cpu():
    """The resident copy of a packed LM head (``PackedRows.resident``) is built in row blocks: the
    same bits as one expansion; on CPU there is none (the chunked head runs, as it did)."""
    from logprobe.layers.quant_linear import GGUFLinear, PackedEmbedding, dense_head_fits, expand_all

    d, qs, m = make_blocks("Q4_K", 7, 2, seed=5)
    layer = GGUFLinear("Q4_K", d, qs, m)
    want = dequantize_blocks("Q4_K", d, qs, m).to(torch.bfloat16)
    assert torch.equal(expand_all(layer, torch.bfloat16, step=3), want)  # blocks of 3, 3 and 1 rows
    assert PackedEmbedding(layer, torch.bfloat16).weight.resident() is None
    assert dense_head_fits(10, 100) and not dense_head_fits(11, 100)  # a tenth of the free memory


@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_cuda_packed_head_runs_the_fused_kernel_on_its_resident_copy():
    from logprobe.layers.logprob_head import HeadParams, logprob_head
    from logprobe.layers.quant_linear import GGUFLinear, PackedEmbedding

    dev = torch.device("cuda")
    d, qs, m = make_blocks("Q6_K", 3000, 2, seed=9, device=dev)  # V = 3000, H = 512
    layer = GGUFLinear("Q6_K", d, qs, m)
    params = HeadParams(PackedEmbedding(layer, torch.bfloat16).weight)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(300, 512, device=dev, generator=g).to(torch.bfloat16)
    y = torch.randint(0, 3000, (300,), device=dev, generator=g)
    fused = logprob_head(h, params, y, 0.7, top_k=5, entropy=True)
    assert torch.equal(layer.resident_rows, dequantize_blocks("Q6_K", d, qs, m).to(torch.bfloat16))
    chunked = logprob_head(h, params, y, 0.7, top_k=5, entropy=True, backend="torch")
    for name in ("logprobs", "entropy", "topk_logprobs"):
        assert float((getattr(fused, name) - getattr(chunked, name)).abs().max()) < 1e-4, name
    assert torch.equal(fused.ranks, chunked.ranks) or float((fused.ranks - chunked.ranks).abs().max()) <= 1

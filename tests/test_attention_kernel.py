"""The project's varlen attention kernel (kernels/attention.py): its programs' plan (gold tables),
the kernel under Triton's CPU interpreter against the float64 definition, and on CUDA against
the float64 definition beside FlashAttention-2's error on the same inputs, batch-invariant."""

from __future__ import annotations

import json
import math
import random
import textwrap

import pytest
import torch
from helpers import run_interpreted

from logprobe.kernels.attention import block_plan, tile_shape, varlen_reference

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON
                          or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU and Triton")


def test_block_plan_gold_table():
    """Rows of 4: segment 0 has 10 own rows (keys 10), segment 1 two rows over 6 context keys
    (keys 8), segment 2 five rows (keys 5). Blocks and the keys each reads: (0, 0) 4, (0, 4) 8,
    (0, 8) 10, (1, 0) 8, (2, 0) 4, (2, 4) 5: the most keys first, ties in order."""
    assert block_plan([0, 10, 12, 17], [0, 10, 18, 23], 4) == ([0, 0, 1, 2, 0, 2], [8, 4, 0, 4, 0, 0])
    assert block_plan([0, 0], [0, 3], 4) == ([], [])  # a segment with no rows has no block


def test_tile_shape_packs_heads_sharing_a_kv_head():
    assert [tile_shape(64, hq, hkv) for hq, hkv in ((32, 8), (32, 32), (64, 8), (28, 4))] == \
        [(16, 4), (64, 1), (8, 8), (64, 1)]
    assert tile_shape(128, 32, 8) == (32, 4) and tile_shape(256, 8, 8) is None and tile_shape(192, 16, 16) is None


def test_reference_is_sdpa_bottom_right():
    """The definition against PyTorch's SDPA on one segment of 3 rows over 5 keys (2 of context)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask, scale=0.3).transpose(0, 1)
    assert torch.allclose(varlen_reference(q, k, v, [0, 3], [0, 5], 0.3), want, atol=1e-6)


@pytest.mark.slow  # Triton's interpreter in a fresh process (~5 s)
def test_kernel_interpreted_matches_float64():
    """Segments with and without context, rows past a tile, a one-row segment; heads packed four
    and eight to a tile, one to a tile (a group of 3 is not a power of two): within float32's
    rounding of the float64 definition. The head dims and tiles are shrunk for the interpreter."""
    code = textwrap.dedent("""
        import json, torch
        import logprobe.kernels.attention as A
        A.CONFIGS = {16: (8, 16, 4, 1), 32: (8, 16, 4, 1)}
        g = torch.Generator().manual_seed(0)
        lens = [(0, 5), (7, 3), (0, 20), (13, 17), (2, 1), (40, 9)]
        cu_q, cu_k = [0], [0]
        for c, n in lens:
            cu_q.append(cu_q[-1] + n); cu_k.append(cu_k[-1] + c + n)
        out = []
        for hq, hkv, d in ((8, 2, 16), (2, 2, 32), (6, 2, 16), (8, 1, 16)):
            q = torch.randn(cu_q[-1], hq, d, generator=g)
            k, v = (torch.randn(cu_k[-1], hkv, d, generator=g) for _ in range(2))
            rows, hg = A.tile_shape(d, hq, hkv)
            plan = tuple(torch.tensor(x, dtype=torch.int32) for x in A.block_plan(cu_q, cu_k, rows))
            o = A.varlen_triton(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                plan, d ** -0.5)
            ref = A.varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, d ** -0.5)
            out.append([hg, float((o.double() - ref).abs().max())])
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [hg for hg, _ in out] == [4, 1, 1, 8]
    assert all(err < 2e-6 for _, err in out), out


def _w1_like(seed: int, groups: int) -> tuple[list[int], list[int]]:
    """cu_q, cu_k of prompts each followed by 3 completions over it (W1's shape, smaller)."""
    rng = random.Random(seed)
    cu_q, cu_k = [0], [0]
    for _ in range(groups):
        p = rng.randint(20, 700)
        for c, n in [(0, p)] + [(p, int(math.exp(rng.uniform(0, math.log(900))))) for _ in range(3)]:
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + c + n)
    return cu_q, cu_k


@cuda
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (28, 4)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_cuda_as_exact_as_flash_attention(heads, d, dtype):
    """Against the float64 definition, the kernel's error is FlashAttention-2's (both round the
    probabilities to the input dtype before the product with the values): max within 1.5x, mean
    within 1.1x of FlashAttention's on the same inputs."""
    from logprobe.layers.attention_gpu import flash_varlen_attention, triton_varlen_attention

    hq, hkv = heads
    cu_q, cu_k = _w1_like(0, 3)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(cu_q[-1], hq, d, generator=g)
    k, v = (torch.randn(cu_k[-1], hkv, d, generator=g) for _ in range(2))
    ref = varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, d**-0.5)
    qc, kc, vc = (x.to("cuda", dtype) for x in (q, k, v))
    cu = tuple(torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    ours = triton_varlen_attention(qc, kc, vc, cu_q, cu_k, d**-0.5, cu, {})
    flash = flash_varlen_attention(qc, kc, vc, cu_q, cu_k, d**-0.5, cu=cu)
    e_ours, e_flash = ((o.double().cpu() - ref).abs() for o in (ours, flash))
    assert e_ours.max() <= 1.5 * e_flash.max(), (e_ours.max(), e_flash.max())
    assert e_ours.mean() <= 1.1 * e_flash.mean(), (e_ours.mean(), e_flash.mean())


@cuda
def test_kernel_cuda_rows_do_not_depend_on_the_batch():
    """A segment alone and packed after others, at another row offset: the same bits."""
    from logprobe.layers.attention_gpu import triton_varlen_attention

    cu_q, cu_k = _w1_like(2, 4)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(cu_q[-1], 32, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(cu_k[-1], 8, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    cu = tuple(torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    whole = triton_varlen_attention(q, k, v, cu_q, cu_k, 0.125, cu, {})
    for s in (1, 6, len(cu_q) - 2):  # completions over a prompt, and the last segment
        a, b, c, e = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        one = ([0, b - a], [0, e - c])
        cu1 = tuple(torch.tensor(x, dtype=torch.int32, device="cuda") for x in one)
        alone = triton_varlen_attention(q[a:b], k[c:e], v[c:e], *one, 0.125, cu1, {})
        assert torch.equal(alone, whole[a:b])

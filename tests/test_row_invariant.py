"""kernels.elementwise.row_invariant: a row's bits do not depend on how many rows come with it,
whatever the thread count (PyTorch's CPU loops split long tensors into one range per thread, and
a range that ends mid-SIMD-block rounds its tail differently: seen with 16 threads, where a hybrid
MoE model's chunked run differed from the same request alone, and Gemma's GeGLU, whose GELU
kernel splits its loop evenly over the threads rather than by the grain size)."""

import pytest
import torch
import torch.nn.functional as F

from logprobe.kernels import elementwise
from logprobe.kernels.elementwise import (
    CPU_GRAIN_SIZE,
    cpu_aligned_rows,
    cpu_loops_aligned,
    cpu_ranges_aligned,
    row_invariant,
)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 12, 16])
@pytest.mark.parametrize("width", [24, 64, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_any_batch(n_threads, width, dtype, threads):
    threads(n_threads)
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(2049, width, generator=gen) * 4).to(dtype)
    u = torch.randn(2049, width, generator=gen).to(dtype)
    silu_mul = lambda g, v: F.silu(g) * v  # noqa: E731
    geglu = lambda g, v: F.gelu(g, approximate="tanh") * v  # noqa: E731 (GELU splits its loop evenly)
    alone = torch.cat([row_invariant(torch.sigmoid, x[i:i + 1]) for i in range(len(x))])  # [2049, W]
    alone_pair = torch.cat([row_invariant(silu_mul, x[i:i + 1], u[i:i + 1]) for i in range(len(x))])
    alone_gelu = torch.cat([row_invariant(geglu, x[i:i + 1], u[i:i + 1]) for i in range(len(x))])
    for rows in (7, 300, 330, 1001, 1055, 2049):  # 1055 x 64 on 16 threads: 3 ranges of 22,507 elements
        assert torch.equal(row_invariant(torch.sigmoid, x[:rows]), alone[:rows]), rows
        assert torch.equal(row_invariant(silu_mul, x[:rows], u[:rows]), alone_pair[:rows]), rows
        assert torch.equal(row_invariant(geglu, x[:rows], u[:rows]), alone_gelu[:rows]), rows
    torch.testing.assert_close(alone, torch.sigmoid(x.double()).to(dtype), rtol=0, atol=1e-2)


def test_ranges_gold_table():
    # numel, threads -> aligned; tasks = min(threads, ceil(numel / 32768)), range = ceil(numel / tasks)
    gold = [(64 * 100, 16, True), (CPU_GRAIN_SIZE, 16, True), (64 * 1000, 16, True), (64 * 1001, 16, False),
            (64 * 1001, 2, False), (64 * 1002, 2, True), (64 * 5000, 3, False), (64 * 5001, 3, True),
            (64 * 10000, 1, True)]
    assert [cpu_ranges_aligned(n, t) for n, t, _ in gold] == [g for *_, g in gold]


def test_both_splits_gold_table():
    # GELU's split above 16,384 elements: tasks = threads, range = ceil(numel / threads); both must be
    # aligned (the grain's split alone is aligned in every case but 64 x 1001 on 2 threads)
    gold = [(64 * 256, 16, True), (64 * 257, 16, False), (64 * 1000, 16, False), (64 * 1024, 16, True),
            (128 * 330, 16, False), (128 * 336, 16, True), (128 * 330, 2, True), (64 * 1001, 2, False),
            (64 * 1500, 12, True), (64 * 1010, 12, False), (64 * 5000, 1, True)]
    assert [cpu_loops_aligned(n, t) for n, t, _ in gold] == [g for *_, g in gold]
    assert [cpu_aligned_rows(r, w, t) for r, w, t in ((330, 128, 16), (7, 64, 16), (1001, 64, 2))] == [336, 7, 1002]


def test_shapes_kept():
    x = torch.randn(3, 5, 24)
    y = row_invariant(torch.sigmoid, x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, torch.sigmoid(x), rtol=0, atol=1e-6)
    assert row_invariant(torch.sigmoid, torch.empty(0, 24)).shape == (0, 24)


@pytest.mark.parametrize("n_threads", [2, 16])
def test_tiles_fallback_equals_rows_alone(n_threads, threads, monkeypatch):
    """Where no padded row count is aligned, tiles of at most 16,384 elements (whole rows, or pieces of
    wider ones) on one thread each: the same bits as each row alone."""
    threads(n_threads)
    geglu = lambda g, v: F.gelu(g, approximate="tanh") * v  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for rows, width in ((700, 24), (40, 17000)):
        x, u = (torch.randn(rows, width, generator=gen) * 4 for _ in range(2))
        alone = torch.cat([row_invariant(geglu, x[i:i + 1], u[i:i + 1]) for i in range(rows)])
        with monkeypatch.context() as m:
            m.setattr(elementwise, "cpu_aligned_rows", lambda *args: None)
            tiled = row_invariant(geglu, x, u)
        assert torch.equal(tiled, alone), (rows, width)

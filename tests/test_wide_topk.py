"""Wide top-k (k up to 256) in both heads, exact against float64, ties included.

The tie rule: larger log-prob first; equal log-probs by smaller token id, so at a tie on the k-th
value the smaller ids are kept. Integer-valued hidden states and weights make every logit an
exact small integer (the float32 dot products are exact), so ties at the k-th value are many and
both heads must resolve them by id, not by where a chunk or a split happened to put them.

* The chunked PyTorch head: chunk widths smaller and larger than k, deterministic mode.
* The fused Triton head on CPU under ``TRITON_INTERPRET=1`` (a fresh process), tiny shapes:
  k = 7 (the register insertion path), 21, 64 and 256 (the sorted key merges), several
  vocabulary splits per row, against the same float64 order.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
from helpers import run_interpreted

from logprobe.errors import LogprobeError
from logprobe.kernels.logprob_head import MAX_TOP_K, merge_topk
from logprobe.layers.logprob_head import HeadParams, chunk_topk, logprob_head


def tied_case(N=12, H=16, V=600, seed=0, softcap=None):
    """Integer hidden states in [-2, 2] and weights in {-1, 0, 1}: logits are integers in [-32, 32]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (N, H), generator=g).float()
    p = HeadParams(weight=torch.randint(-1, 2, (V, H), generator=g).float(), softcap=softcap)
    y = torch.randint(0, V, (N,), generator=g)
    temp = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (N,), generator=g)]
    return h, p, y, temp


def float64_order(h, p: HeadParams, temp, k: int):
    """(top-k log-probs, ids) in the tie rule's order, from float64 logits."""
    z = h.double() @ p.weight.double().T
    if p.softcap is not None:
        z = torch.tanh(z / p.softcap) * p.softcap
    lp = torch.log_softmax(z / temp.double()[:, None], -1)
    vals, ids = lp.sort(dim=1, descending=True, stable=True)  # stable: equal values by smaller id
    return vals[:, :k], ids[:, :k], lp


def test_cases_have_ties_at_the_kth_value():
    h, p, _, temp = tied_case()
    for k in (64, 256):
        vals, _, lp = float64_order(h, p, temp, k)
        kth = vals[:, -1:]
        ties, slots_left = (lp == kth).sum(1), k - (lp > kth).sum(1)
        assert bool((ties > slots_left).all())  # every row must drop some tied ids


@pytest.mark.parametrize("k", [1, 20, 64, 256])
@pytest.mark.parametrize("vocab_chunk", [50, 128, 8192])
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_head_wide_topk_exact(k, vocab_chunk, deterministic):
    h, p, y, temp = tied_case(softcap=20.0 if k == 64 else None)
    out = logprob_head(h, p, y, temp, top_k=k, vocab_chunk=vocab_chunk, token_chunk=5, deterministic=deterministic,
                       backend="torch")
    vals, ids, _ = float64_order(h, p, temp, k)
    assert torch.equal(out.topk_ids, ids)
    assert (out.topk_logprobs.double() - vals).abs().max() < 1e-5


def test_topk_helpers():
    z = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0, 2.0]])
    assert chunk_topk(z, 2)[1].tolist() == [[0, 2]]
    assert chunk_topk(z, 5)[1].tolist() == [[0, 2, 3, 5, 1]]
    vals, ids = merge_topk(torch.tensor([[2.0, 3.0, 3.0, 2.0]]), torch.tensor([[10, 8, 3, 1]]), 3)
    assert ids.tolist() == [[3, 8, 1]] and vals.tolist() == [[3.0, 3.0, 2.0]]
    with pytest.raises(LogprobeError, match="NaN"):
        chunk_topk(torch.tensor([[1.0, float("nan"), 0.0]]), 2)
    assert MAX_TOP_K == 256


@pytest.mark.slow  # the interpreter over k = 256 takes ~35 s on two cores
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_fused_kernel_wide_topk_exact():
    code = textwrap.dedent("""
        import json, torch
        from test_wide_topk import tied_case, float64_order
        from logprobe.kernels.logprob_head import KernelConfig, fused_logprob_head
        from logprobe.layers.logprob_head import logprob_head
        # 32-column tiles (64 / 256 for k = 64 / 256), 3 splits per row: ties across tiles and splits
        cfg = KernelConfig(block_m=16, block_n=32, block_k=16, group_m=2, waves=3, topk_waves=3, wide_block_m=8,
                           insert_top_k=20)  # k > 20 on the sorted merges
        # the same cases with every k on the insertion path (KernelConfig.insert_top_k)
        ins = KernelConfig(block_m=16, block_n=32, block_k=16, group_m=2, waves=3, topk_waves=3, insert_top_k=256)
        res = {}
        for k, V, softcap, det, c in ((7, 300, None, False, cfg), (21, 300, 20.0, False, cfg),
                                      (64, 400, None, False, cfg), (64, 256, None, True, cfg),
                                      (256, 600, None, False, cfg), (21, 300, 20.0, False, ins),
                                      (64, 400, None, False, ins), (64, 256, None, True, ins)):
            h, p, y, temp = tied_case(N=10, V=V, seed=k, softcap=softcap)
            out = fused_logprob_head(h, p.weight, y, 1.0 / temp, softcap=softcap, top_k=k, entropy=True,
                                     config=c, deterministic=det)
            vals, ids, lp = float64_order(h, p, temp, k)
            torch_head = logprob_head(h, p, y, temp, top_k=k, entropy=True, backend="torch")
            res[f"k{k}-V{V}-det{int(det)}-insert{c.insert_top_k}"] = {
                "ids": torch.equal(out[4], ids), "same_as_torch_head": torch.equal(out[4], torch_head.topk_ids),
                "topk": (out[5].double() - vals).abs().max().item(),
                "logprobs": (out[0].double() - lp.gather(1, y[:, None])[:, 0]).abs().max().item()}
        print(json.dumps(res))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == 8
    for name, d in res.items():
        assert d["ids"] and d["same_as_torch_head"], (name, d)
        assert d["topk"] < 1e-5 and d["logprobs"] < 1e-5, (name, d)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("k", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_wide_topk_exact(k, deterministic):
    """On the GPU, through ``logprob_head``'s dispatch: exact ties (integer logits) in bf16 and the
    same ids as the PyTorch head, plus an LM-like case within float32 rounding of it."""
    h, p, y, temp = tied_case(N=300, H=64, V=5000, seed=k)
    dev = torch.device("cuda")
    pc = HeadParams(weight=p.weight.to(dev, torch.bfloat16), grid=1024)
    out = logprob_head(h.to(dev, torch.bfloat16), pc, y.to(dev), temp.to(dev), top_k=k, deterministic=deterministic)
    vals, ids, _ = float64_order(h, p, temp, k)
    assert torch.equal(out.topk_ids.cpu(), ids)
    assert (out.topk_logprobs.double().cpu() - vals).abs().max() < 1e-4
    g = torch.Generator().manual_seed(1)
    h2, w2 = torch.randn(200, 256, generator=g), torch.randn(32000, 256, generator=g) * 2 / 16
    y2 = torch.randint(0, 32000, (200,), generator=g)
    got = logprob_head(h2.to(dev, torch.bfloat16), HeadParams(w2.to(dev, torch.bfloat16)), y2.to(dev), top_k=k,
                       entropy=True, deterministic=deterministic)
    ref = logprob_head(h2.bfloat16().float(), HeadParams(w2.bfloat16().float()), y2, top_k=k, entropy=True,
                       backend="torch")
    assert (got.topk_logprobs.cpu() - ref.topk_logprobs).abs().max() < 1e-4
    assert (got.topk_ids.cpu() != ref.topk_ids).float().mean() < 0.01  # only float32 near-ties may swap


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("k", [32, 64, 128])
@pytest.mark.parametrize("insert_top_k", [20, 128])
def test_cuda_topk_both_paths_exact(k, insert_top_k):
    """The kernel at its full tile sizes with k on the insertion path (``insert_top_k`` >= k) or
    the sorted merges: the float64 order on exact ties, bf16 inputs."""
    from logprobe.kernels.logprob_head import KernelConfig, fused_logprob_head

    h, p, y, temp = tied_case(N=300, H=64, V=5000, seed=k)
    dev = torch.device("cuda")
    out = fused_logprob_head(h.to(dev, torch.bfloat16), p.weight.to(dev, torch.bfloat16), y.to(dev),
                             (1.0 / temp).to(dev), top_k=k, config=KernelConfig(insert_top_k=insert_top_k))
    vals, ids, _ = float64_order(h, p, temp, k)
    assert torch.equal(out[4].cpu(), ids)
    assert (out[5].double().cpu() - vals).abs().max() < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its error classes)")
def test_wide_topk_launch_failure_falls_back_exactly(monkeypatch):
    """Where the wide kernel cannot launch (its sorts need more registers or shared memory than a
    GPU has), ``logprob_head`` warns once and runs the PyTorch head: the same numbers as asking
    for it. k <= 20 (the register path) and ``backend="triton"`` raise instead."""
    from triton.runtime.errors import OutOfResources

    import logprobe.layers.logprob_head as lh

    def fail(*args, **kwargs):
        raise OutOfResources(1 << 20, 1 << 18, "shared memory")

    monkeypatch.setattr(lh, "_kernel_applies", lambda *a: True)
    monkeypatch.setattr(lh, "_check", lambda *a: None)
    monkeypatch.setattr(lh, "_kernel_partials", fail)
    monkeypatch.setattr(lh, "fused_target_logits", lambda h, w, rows, inv_t, **kw: (h @ w[rows].T).diagonal() * inv_t)
    monkeypatch.setattr(lh, "_warned", [])
    h, p, y, temp = tied_case()
    with pytest.warns(RuntimeWarning, match="wide top-k"):
        out = logprob_head(h, p, y, temp, top_k=64, entropy=True)
    want = logprob_head(h, p, y, temp, top_k=64, entropy=True, backend="torch")
    for name in ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name
    with pytest.raises(OutOfResources):
        logprob_head(h, p, y, temp, top_k=20)

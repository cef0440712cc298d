"""The gated output norm of the Qwen3.5 linear-attention mixers alone, at the Qwen3.5-35B-A3B
shape (Hv = 32 value heads of Dv = 128, the gate z a slice of the fused in-projection's output
[T, 8192 qkv | 4096 z | 32 b | 32 a]): three ways of computing ``w * (o / rms(o)).to(o.dtype) *
silu(z)`` on bf16, per token count T:

  torch     ``layers.gated_delta.gated_rms_norm``, PyTorch ops (their reductions are not
            batch-invariant on CUDA)
  separate  ``kernels.rmsnorm.gated_rmsnorm_reference``: the row-wise Triton RMSNorm, then PyTorch's
            float32 SiLU, product and cast (the model's CUDA path before the fused kernel)
  fused     ``kernels.rmsnorm.gated_rmsnorm``: one Triton pass reading o and the strided z once

Per T: milliseconds (median of ``triton.testing.do_bench``), the fused kernel's GB/s (o and z read,
y written, bf16), whether fused equals separate bit for bit (count of differing elements), max
|Δ| of each against float64, and a row's bits alone vs among T rows. The model runs it once per
linear-attention layer (12 of the 16-layer MoE cut, 24 of the 9B).

    python bench/gpu_gated_norm.py                      # under a minute on one H100
    python bench/gpu_gated_norm.py --tokens 4096,65536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ms, gpu_banner, log  # noqa: E402

from logprobe.kernels.rmsnorm import gated_rmsnorm, gated_rmsnorm_reference  # noqa: E402
from logprobe.layers.gated_delta import gated_rms_norm  # noqa: E402

QKV, HV, DV, BA = 8192, 32, 128, 64  # the fused projection's widths at the 35B-A3B shape
EPS = 1e-6


def inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    o = torch.randn(T, HV, DV, device="cuda", generator=g).to(torch.bfloat16)  # [T, Hv, Dv]
    proj = (torch.randn(T, QKV + HV * DV + BA, device="cuda", generator=g) * 2).to(torch.bfloat16)
    z = proj[:, QKV:QKV + HV * DV].view(T, HV, DV)  # [T, Hv, Dv], row stride of the whole projection
    w = (1 + 0.1 * torch.randn(DV, device="cuda", generator=g)).to(torch.bfloat16)
    return o, z, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768,65536", help="token counts T, comma-separated")
    ap.add_argument("--rep", type=int, default=100, help="milliseconds of do_bench repetitions per timing")
    args = ap.parse_args()
    gpu_banner()
    log(f"Hv {HV}, Dv {DV}, bf16; z a view of a [T, {QKV + HV * DV + BA}] projection")
    log("| T | torch ms | separate ms | fused ms | fused GB/s | × vs separate | fused = separate | "
        "max |Δ| f64 torch | separate | fused | alone = among T |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for T in (int(t) for t in args.tokens.split(",")):
        o, z, w = inputs(T)
        fns = {"torch": gated_rms_norm, "separate": gated_rmsnorm_reference, "fused": gated_rmsnorm}
        a = (o, z, w, EPS)
        ms = {k: bench_ms(lambda f=f, a=a: f(*a), rep=args.rep, warmup=10) for k, f in fns.items()}
        outs = {k: f(*a) for k, f in fns.items()}
        f64 = gated_rms_norm(o.double(), z.double(), w.double(), EPS)
        err = {k: float((y.double() - f64).abs().max()) for k, y in outs.items()}
        diff = int((outs["fused"] != outs["separate"]).sum())
        rows = [0, T // 2, T - 1]
        alone = all(torch.equal(gated_rmsnorm(o[r:r + 1], z[r:r + 1], w, EPS), outs["fused"][r:r + 1]) for r in rows)
        gbs = 3 * T * HV * DV * 2 / (ms["fused"] * 1e-3) / 1e9
        log(f"| {T:,} | {ms['torch']:.3f} | {ms['separate']:.3f} | {ms['fused']:.3f} | {gbs:,.0f} | "
            f"{ms['separate'] / ms['fused']:.2f}× | {'yes' if diff == 0 else f'**no: {diff:,} differ**'} | "
            f"{err['torch']:.2e} | {err['separate']:.2e} | {err['fused']:.2e} | {'yes' if alone else '**no**'} |")


if __name__ == "__main__":
    main()

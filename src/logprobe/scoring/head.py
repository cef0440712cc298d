"""The log-prob head: target log-probs (and entropy, rank, top-k) without a [T, V] tensor.

For each scored row ``i`` with hidden state ``h_i`` and target ``y_i``:

    z_i      = softcap(scale * (W h_i + b)) / temperature_i          # logits, never stored whole
    lse_i    = log sum_v exp(z_iv)                                    # online over vocab chunks
    logprob  = z_{i,y_i} - lse_i
    entropy  = lse_i - sum_v softmax(z_i)_v * z_iv
    rank     = #{v != y_i : z_iv > z_{i,y_i}}                         # 0 <=> greedy
    top-k    = the k largest z_iv - lse_i, merged chunk by chunk

Rows are processed ``token_chunk`` at a time and the vocabulary ``vocab_chunk`` columns at a
time, all in float32, so the extra memory is O(token_chunk * vocab_chunk) whatever T and V are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError


@dataclass(slots=True)
class HeadParams:
    """What maps final hidden states to logits: ``softcap(scale * (h @ weight.T + bias))``."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None  # [V]
    scale: float = 1.0
    softcap: float | None = None

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]


@dataclass(slots=True)
class HeadOutput:
    logprobs: torch.Tensor  # [N] float32
    logsumexp: torch.Tensor  # [N] float32, of the temperature-scaled logits
    ranks: torch.Tensor  # [N] int64
    entropy: torch.Tensor | None = None  # [N] float32
    topk_ids: torch.Tensor | None = None  # [N, k] int64
    topk_logprobs: torch.Tensor | None = None  # [N, k] float32


def _transform(z: torch.Tensor, b: torch.Tensor | None, p: HeadParams) -> torch.Tensor:
    """Raw dot products -> logits (bias, scale, softcap), in float32."""
    if b is not None:
        z = z + b
    if p.scale != 1.0:
        z = z * p.scale
    if p.softcap is not None:
        z = torch.tanh(z / p.softcap) * p.softcap
    return z


def _kernel_applies(hidden: torch.Tensor, p: HeadParams, top_k: int, pad_chunks: bool) -> bool:
    from ..kernels import triton_available
    from ..kernels.logprob_head import MAX_TOP_K

    if not hidden.is_cuda or top_k > MAX_TOP_K:
        return False

    w = p.weight
    return (triton_available() and w.device == hidden.device and w.dtype == hidden.dtype
            and hidden.stride(-1) == 1 and w.stride(-1) == 1)


def logprob_head(
    hidden: torch.Tensor,
    params: HeadParams,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    top_k: int = 0,
    entropy: bool = False,
    token_chunk: int = 512,
    vocab_chunk: int = 8192,
    pad_chunks: bool = False,
    backend: str = "auto",
) -> HeadOutput:
    """hidden [N, H], targets [N] -> HeadOutput. ``temperature`` is a float or a [N] tensor.

    ``pad_chunks`` (deterministic mode): every row's numbers independent of the other rows,
    bitwise: this loop zero-pads the last token chunk to ``token_chunk`` rows so every row goes
    through identically shaped products; the kernel splits the vocabulary at fixed columns and
    combines the splits in a fixed order.
    ``backend``: "auto" runs the fused Triton kernel (``logprobe.kernels.logprob_head``) on CUDA
    when it applies (Triton present, top_k <= 20, hidden and weight of one dtype with contiguous
    rows) and this chunked PyTorch loop otherwise; "torch" always runs this loop; "triton"
    requires the kernel."""
    N, H = hidden.shape
    V = params.vocab_size
    if params.weight.shape[1] != H:
        raise LogprobeError("hidden", f"width {H} does not match the LM head's {params.weight.shape[1]}")
    if targets.shape != (N,):
        raise LogprobeError("targets", f"shape {tuple(targets.shape)} does not match hidden rows {N}")
    if N and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise LogprobeError("targets", f"ids must be in [0, {V})")
    if top_k < 0 or top_k > V:
        raise LogprobeError("top_k", f"must be in [0, {V}], got {top_k}")
    device = hidden.device
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(N).contiguous()
    if N and not bool(torch.isfinite(temp).all() and (temp > 0).all()):
        raise LogprobeError("temperature", "must be finite and > 0")

    if backend not in ("auto", "torch", "triton"):
        raise LogprobeError("backend", f"must be auto, torch or triton, got {backend!r}")
    if backend == "triton" or (backend == "auto" and _kernel_applies(hidden, params, top_k, pad_chunks)):
        from ..kernels.logprob_head import fused_logprob_head

        return HeadOutput(*fused_logprob_head(
            hidden, params.weight, targets, 1.0 / temp, bias=params.bias, scale=params.scale,
            softcap=params.softcap, top_k=top_k, entropy=entropy, deterministic=pad_chunks))

    out_lp = torch.empty(N, dtype=torch.float32, device=device)
    out_lse = torch.empty(N, dtype=torch.float32, device=device)
    out_rank = torch.empty(N, dtype=torch.int64, device=device)
    out_ent = torch.empty(N, dtype=torch.float32, device=device) if entropy else None
    out_tid = torch.empty(N, top_k, dtype=torch.int64, device=device) if top_k else None
    out_tlp = torch.empty(N, top_k, dtype=torch.float32, device=device) if top_k else None
    bias = params.bias.float() if params.bias is not None else None

    for r0 in range(0, N, token_chunk):
        r1 = min(r0 + token_chunk, N)
        h = hidden[r0:r1].float()  # [t, H]
        if pad_chunks and r1 - r0 < token_chunk:
            h = torch.cat([h, h.new_zeros(token_chunk - (r1 - r0), H)])  # [token_chunk, H]
        y = targets[r0:r1]  # [t]
        inv_t = 1.0 / temp[r0:r1, None]  # [t, 1]
        # Target logit from its own row of W, so the vocabulary walk needs a single pass.
        wy = params.weight[y].float()  # [t, H]
        zy = (h[: r1 - r0] * wy).sum(-1, keepdim=True)  # [t, 1]
        zy = _transform(zy, bias[y, None] if bias is not None else None, params) * inv_t
        m = torch.full((r1 - r0, 1), -torch.inf, device=device)  # running max
        s = torch.zeros(r1 - r0, 1, device=device)  # running sum of exp(z - m)
        a = torch.zeros(r1 - r0, 1, device=device) if entropy else None  # running sum of exp(z - m) * z
        rank = torch.zeros(r1 - r0, dtype=torch.int64, device=device)
        best_z = best_id = None
        for v0 in range(0, V, vocab_chunk):
            v1 = min(v0 + vocab_chunk, V)
            w = params.weight[v0:v1].float()  # [v, H]
            z = _transform((h @ w.T)[: r1 - r0], bias[v0:v1] if bias is not None else None, params) * inv_t  # [t, v]
            m_new = torch.maximum(m, z.max(dim=1, keepdim=True).values)
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            e = torch.exp(z - m_new)  # [t, v]
            s = s * alpha + e.sum(dim=1, keepdim=True)
            if a is not None:
                a = a * alpha + (e * z).sum(dim=1, keepdim=True)
            m = m_new
            above = z > zy  # [t, v]
            in_chunk = (y >= v0) & (y < v1)
            if bool(in_chunk.any()):  # the target never outranks itself
                rows = in_chunk.nonzero().squeeze(1)
                above[rows, y[rows] - v0] = False
            rank += above.sum(dim=1)
            if top_k:
                k = min(top_k, v1 - v0)
                cz, ci = z.topk(k, dim=1)  # [t, k]
                ci = ci + v0
                if best_z is not None:
                    cz, sel = torch.cat([best_z, cz], 1).topk(top_k, dim=1)
                    ci = torch.cat([best_id, ci], 1).gather(1, sel)
                best_z, best_id = cz, ci
        lse = m + torch.log(s)  # [t, 1]
        out_lse[r0:r1] = lse[:, 0]
        out_lp[r0:r1] = (zy - lse)[:, 0]
        out_rank[r0:r1] = rank
        if out_ent is not None:
            out_ent[r0:r1] = (lse - a / s)[:, 0]
        if top_k:
            out_tid[r0:r1] = best_id
            out_tlp[r0:r1] = best_z - lse
    return HeadOutput(out_lp, out_lse, out_rank, out_ent, out_tid, out_tlp)


"""Quantization quality: a model Q against a reference R on the same token windows.

What llama.cpp's ``llama-perplexity --kl-divergence`` reports, computed exactly:

    PPL(Q), PPL(R), ln(PPL(Q)/PPL(R)) (paired, with its standard error), PPL(Q)/PPL(R)
    KL(R || Q) per token = sum_v p_R(v) (log p_R(v) - log p_Q(v))
    same top p = how often argmax_v p_Q = argmax_v p_R
    Δp = p_Q(target) - p_R(target)

``kl_head`` walks the vocabulary in chunks for both models at once, so no ``[T, V]`` tensor is
stored. With z the logits and lse their log-sum-exp,

    KL = sum_v p_R(v) (z_R(v) - z_Q(v)) - lse_R + lse_Q

and the first sum is accumulated online like the softmax denominator: a running
A = sum_v exp(z_R(v) - m_R) (z_R(v) - z_Q(v)), rescaled by exp(m_old - m_new) whenever the
running max m_R grows, so KL = A / S_R + (m_Q - m_R) + log(S_Q / S_R). Equal models give A = 0,
m_Q = m_R and S_Q = S_R bitwise, so KL = 0 exactly.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..engine.request import RequestResult
from ..engine.runner import Engine, Launched
from ..errors import LogprobeError
from ..layers.logprob_head import HeadParams, _transform
from .options import Windows
from .perplexity import perplexity_job
from .work import ScoringContext

KL_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


@dataclass(slots=True)
class KLRows:
    """Per scored row: both models' target log-probs, KL(R || Q), and whether the argmaxes agree."""

    logprobs_q: torch.Tensor  # [N] float32
    logprobs_r: torch.Tensor  # [N] float32
    kl: torch.Tensor  # [N] float32
    same_top: torch.Tensor  # [N] bool
    top_q: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [N, k] int64, log-probs [N, k]) with top_k
    top_r: tuple[torch.Tensor, torch.Tensor] | None = None


def _merge_top(vals: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, v0: int, k: int):
    """The running top ``k`` (values, ids) of the rows merged with vocabulary chunk ``z`` (ids from ``v0``)."""
    cv, ci = z.topk(min(k, z.shape[1]), dim=1)
    all_v, all_i = torch.cat([vals, cv], dim=1), torch.cat([ids, ci + v0], dim=1)
    top_v, pos = all_v.topk(k, dim=1)
    return top_v, all_i.gather(1, pos)


def _online_lse(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor):
    """One vocabulary chunk z [t, v] into a running max m and sum s = sum exp(z - m); returns the
    new m, s, the rescale factor of what was summed before, and exp(z - m_new)."""
    m_new = torch.maximum(m, z.max(dim=1, keepdim=True).values)
    alpha = torch.exp(m - m_new)
    e = torch.exp(z - m_new)  # [t, v]
    return m_new, s * alpha + e.sum(dim=1, keepdim=True), alpha, e


def kl_head(hidden_q: torch.Tensor, params_q: HeadParams, hidden_r: torch.Tensor, params_r: HeadParams,
            targets: torch.Tensor, *, token_chunk: int = 512, vocab_chunk: int = 8192, top_k: int = 0) -> KLRows:
    """hidden_q [N, Hq], hidden_r [N, Hr] (the same rows of the same token ids), targets [N] -> KLRows;
    ``top_k`` > 0: also each model's ``top_k`` most likely tokens per row, with their log-probs.

    Extra memory is O(token_chunk * vocab_chunk) whatever N and V are; all arithmetic in float32."""
    N = hidden_q.shape[0]
    V = params_q.vocab_size
    k = min(top_k, V)
    if params_r.vocab_size != V:
        raise LogprobeError("reference", f"vocabulary of {params_r.vocab_size} does not match the model's {V}",
                            "compare models that share a tokenizer and vocabulary")
    if hidden_r.shape[0] != N or targets.shape != (N,):
        raise LogprobeError("hidden", "both models must give one row per target")
    device = hidden_q.device
    out_q = torch.empty(N, dtype=torch.float32, device=device)
    out_r = torch.empty(N, dtype=torch.float32, device=device)
    out_kl = torch.empty(N, dtype=torch.float32, device=device)
    out_same = torch.empty(N, dtype=torch.bool, device=device)
    tops = [(torch.empty(N, k, dtype=torch.int64, device=device), torch.empty(N, k, device=device))
            for _ in range(2)] if k else None
    bias_q = params_q.bias.float() if params_q.bias is not None else None
    bias_r = params_r.bias.float() if params_r.bias is not None else None

    def logits(h, p, bias, v0, v1):
        return _transform(h @ p.weight[v0:v1].float().T, bias[v0:v1] if bias is not None else None, p)  # [t, v]

    def target_logit(h, p, bias, y):
        z = (h * p.weight[y].float()).sum(-1, keepdim=True)  # [t, 1]
        return _transform(z, bias[y, None] if bias is not None else None, p)

    for r0 in range(0, N, token_chunk):
        r1 = min(r0 + token_chunk, N)
        hq, hr, y = hidden_q[r0:r1].float(), hidden_r[r0:r1].float(), targets[r0:r1]  # [t, H], [t]
        t = r1 - r0
        m_q = torch.full((t, 1), -torch.inf, device=device)
        m_r = torch.full((t, 1), -torch.inf, device=device)
        s_q = torch.zeros(t, 1, device=device)
        s_r = torch.zeros(t, 1, device=device)
        acc = torch.zeros(t, 1, device=device)  # sum exp(z_R - m_R) (z_R - z_Q), rescaled with m_R
        top_q = torch.zeros(t, dtype=torch.int64, device=device)
        top_r = torch.zeros(t, dtype=torch.int64, device=device)
        kv = [torch.full((t, k), -torch.inf, device=device) for _ in range(2)]  # running top-k (Q, R)
        ki = [torch.zeros(t, k, dtype=torch.int64, device=device) for _ in range(2)]
        for v0 in range(0, V, vocab_chunk):
            v1 = min(v0 + vocab_chunk, V)
            zq = logits(hq, params_q, bias_q, v0, v1)
            zr = logits(hr, params_r, bias_r, v0, v1)
            # argmax: a chunk's best replaces the running one only when strictly larger (first index wins)
            cq, iq = zq.max(dim=1)
            cr, ir = zr.max(dim=1)
            top_q = torch.where(cq > m_q[:, 0], iq + v0, top_q)
            top_r = torch.where(cr > m_r[:, 0], ir + v0, top_r)
            if k:
                kv[0], ki[0] = _merge_top(kv[0], ki[0], zq, v0, k)
                kv[1], ki[1] = _merge_top(kv[1], ki[1], zr, v0, k)
            m_q, s_q, _, _ = _online_lse(m_q, s_q, zq)
            m_r, s_r, alpha, e_r = _online_lse(m_r, s_r, zr)
            acc = acc * alpha + (e_r * (zr - zq)).sum(dim=1, keepdim=True)
        lse_q = m_q + torch.log(s_q)  # [t, 1]
        lse_r = m_r + torch.log(s_r)
        out_q[r0:r1] = (target_logit(hq, params_q, bias_q, y) - lse_q)[:, 0]
        out_r[r0:r1] = (target_logit(hr, params_r, bias_r, y) - lse_r)[:, 0]
        # lse_Q - lse_R as (m_Q - m_R) + log(S_Q / S_R): no cancellation between two O(10) logs
        out_kl[r0:r1] = (acc / s_r + (m_q - m_r) + torch.log(s_q / s_r))[:, 0]
        out_same[r0:r1] = top_q == top_r
        if tops is not None:
            for (ids, lps), v, i, lse in zip(tops, kv, ki, (lse_q, lse_r), strict=True):
                ids[r0:r1], lps[r0:r1] = i, v - lse
    return KLRows(out_q, out_r, out_kl, out_same, *(tops or (None, None)))


@dataclass(slots=True)
class CompareResult:
    """Model Q against reference R on the same windows (natural logs; probabilities in [0, 1])."""

    num_tokens: int
    num_windows: int
    ppl_q: float
    ppl_q_stderr: float
    ppl_r: float
    ppl_r_stderr: float
    ln_ppl_ratio: float  # mean of (NLL_Q - NLL_R) per token = ln(PPL(Q) / PPL(R))
    ln_ppl_ratio_stderr: float
    ppl_ratio: float
    ppl_ratio_stderr: float
    ppl_diff: float  # PPL(Q) - PPL(R)
    ppl_diff_stderr: float
    nll_correlation: float  # Pearson correlation of per-token NLLs (llama.cpp's Cor(ln PPL(Q), ln PPL(base)))
    kl_mean: float
    kl_stderr: float
    kl_max: float
    kl_min: float
    kl_percentiles: dict[str, float]  # "99.9" -> value, ..., "50.0" is the median
    same_top: float  # fraction of tokens whose argmax agrees
    same_top_stderr: float
    dp_mean: float  # Δp = p_Q(target) - p_R(target)
    dp_stderr: float
    dp_rms: float
    dp_rms_stderr: float
    dp_max: float
    dp_min: float
    dp_percentiles: dict[str, float]
    policy: str = "sliding"
    context_length: int = 0
    stride: int | None = None
    token_kl: list[float] | None = None  # per scored token, in order (return_token_stats=True)
    token_logprobs_q: list[float] | None = None  # per scored token: log p_Q(target) (return_token_stats=True)
    token_logprobs_r: list[float] | None = None  # log p_R(target)
    token_top_q: list[list[tuple[int, float]]] | None = None  # per scored token: Q's top-k (id, log-prob) (top_k)
    token_top_r: list[list[tuple[int, float]]] | None = None  # R's

    def to_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        """A text report laid out like llama.cpp's KL-divergence summary."""
        pct = lambda x: f"{100 * x:8.3f} %"  # noqa: E731
        lines = [
            f"tokens {self.num_tokens} in {self.num_windows} windows (policy {self.policy}, "
            f"context {self.context_length}" + (f", stride {self.stride})" if self.stride else ")"),
            "",
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {self.ppl_q:10.6f} ± {self.ppl_q_stderr:.6f}",
            f"Mean PPL(R)                   : {self.ppl_r:10.6f} ± {self.ppl_r_stderr:.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(R)))   : {pct(self.nll_correlation)}",
            f"Mean ln(PPL(Q)/PPL(R))        : {self.ln_ppl_ratio:10.6f} ± {self.ln_ppl_ratio_stderr:.6f}",
            f"Mean PPL(Q)/PPL(R)            : {self.ppl_ratio:10.6f} ± {self.ppl_ratio_stderr:.6f}",
            f"Mean PPL(Q)-PPL(R)            : {self.ppl_diff:10.6f} ± {self.ppl_diff_stderr:.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {self.kl_mean:10.6f} ± {self.kl_stderr:.6f}",
            f"Maximum KLD: {self.kl_max:10.6f}",
        ]
        lines += [f"{p:>5}%  KLD: {v:10.6f}" if p != "50.0" else f"Median  KLD: {v:10.6f}"
                  for p, v in self.kl_percentiles.items()]
        lines += [
            f"Minimum KLD: {self.kl_min:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * self.dp_mean:8.3f} ± {100 * self.dp_stderr:.3f} %",
            f"Maximum Δp: {pct(self.dp_max)}",
        ]
        lines += [f"{p:>5}%  Δp: {pct(v)}" if p != "50.0" else f"Median  Δp: {pct(v)}"
                  for p, v in self.dp_percentiles.items()]
        lines += [
            f"Minimum Δp: {pct(self.dp_min)}",
            f"RMS Δp    : {100 * self.dp_rms:8.3f} ± {100 * self.dp_rms_stderr:.3f} %",
            f"Same top p: {100 * self.same_top:8.3f} ± {100 * self.same_top_stderr:.3f} %",
        ]
        return "\n".join(lines)


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    n = len(x)
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return mean, se


def _percentiles(x: np.ndarray, ps) -> dict[str, float]:
    return {f"{p:.1f}": float(v) for p, v in zip(ps, np.percentile(x, ps))}


def compare_stats(rows: KLRows, num_windows: int, policy: str = "sliding", context_length: int = 0,
                  stride: int | None = None, return_token_stats: bool = False) -> CompareResult:
    """Summary statistics of per-token rows (computed in float64)."""
    lq = rows.logprobs_q.double().cpu().numpy()
    lr = rows.logprobs_r.double().cpu().numpy()
    kl = rows.kl.double().cpu().numpy()
    same = rows.same_top.cpu().numpy().astype(np.float64)
    n = len(lq)
    if n == 0:
        raise LogprobeError("texts", "no token was scored", "give a longer text")
    nq, nr = -lq, -lr
    mq, sq = _mean_se(nq)
    mr, sr = _mean_se(nr)
    d, sd = _mean_se(nq - nr)
    ppl_q, ppl_r = math.exp(mq), math.exp(mr)
    cov = float(np.cov(nq, nr)[0, 1]) / n if n > 1 else 0.0
    diff_var = (ppl_q * sq) ** 2 + (ppl_r * sr) ** 2 - 2 * ppl_q * ppl_r * cov
    corr = float(np.corrcoef(nq, nr)[0, 1]) if n > 1 and nq.std() > 0 and nr.std() > 0 else 1.0
    dp = np.exp(lq) - np.exp(lr)
    dpm, dps = _mean_se(dp)
    ms, mss = _mean_se(dp**2)
    rms = math.sqrt(ms)
    km, ks = _mean_se(kl)
    p_same = float(same.mean())
    return CompareResult(
        num_tokens=n, num_windows=num_windows, ppl_q=ppl_q, ppl_q_stderr=ppl_q * sq, ppl_r=ppl_r,
        ppl_r_stderr=ppl_r * sr, ln_ppl_ratio=d, ln_ppl_ratio_stderr=sd, ppl_ratio=math.exp(d),
        ppl_ratio_stderr=math.exp(d) * sd, ppl_diff=ppl_q - ppl_r, ppl_diff_stderr=math.sqrt(max(diff_var, 0.0)),
        nll_correlation=corr, kl_mean=km, kl_stderr=ks, kl_max=float(kl.max()), kl_min=float(kl.min()),
        kl_percentiles=_percentiles(kl, KL_PERCENTILES), same_top=p_same,
        same_top_stderr=math.sqrt(p_same * (1 - p_same) / n), dp_mean=dpm, dp_stderr=dps,
        dp_rms=rms, dp_rms_stderr=mss / (2 * rms) if rms > 0 else 0.0, dp_max=float(dp.max()), dp_min=float(dp.min()),
        dp_percentiles=_percentiles(dp, DP_PERCENTILES), policy=policy, context_length=context_length,
        stride=stride, token_kl=kl.tolist() if return_token_stats else None,
        token_logprobs_q=rows.logprobs_q.tolist() if return_token_stats else None,
        token_logprobs_r=rows.logprobs_r.tolist() if return_token_stats else None,
        token_top_q=_top_lists(rows.top_q), token_top_r=_top_lists(rows.top_r))


def _top_lists(top) -> list[list[tuple[int, float]]] | None:
    if top is None:
        return None
    return [list(zip(i, v)) for i, v in zip(top[0].tolist(), top[1].tolist(), strict=True)]


def _hidden_engine(engine):
    """An engine over the same model and config whose per-request "results" are the final hidden
    states of the scored rows ([n, H], on the model's device) instead of log-probs."""
    class HiddenEngine(Engine):
        def score(self, requests, packed, hidden):
            rows = hidden[packed.score_rows]  # [N, H]
            out, offset = [], 0
            for i, n in packed.owners:
                out.append((i, RequestResult(rows[offset:offset + n], None)))
                offset += n
            return Launched(packed, [], None, ready=out)

    return HiddenEngine(engine.model, engine.config, engine.device)


def compare_requests(engine_q, engine_r, requests, *, token_budget: int, token_chunk: int = 512,
                     vocab_chunk: int = 8192, top_k: int = 0) -> KLRows:
    """Run both models on the same requests, a budget of input tokens at a time, and compare each
    scored row's full distributions (``kl_head``); per-row results are collected on the CPU."""
    hq_engine, hr_engine = _hidden_engine(engine_q), _hidden_engine(engine_r)
    params_q, params_r = engine_q.model.head_params(), engine_r.model.head_params()
    parts: list[KLRows] = []
    group: list = []
    size = 0

    def flush():
        hq = torch.cat([r.logprobs for r in hq_engine.run(group, progress=False)])  # [N, Hq]
        hr = torch.cat([r.logprobs for r in hr_engine.run(group, progress=False)]).to(hq.device)  # [N, Hr]
        targets = torch.tensor([t for r in group for t in r.tokens[r.score_begin:]], device=hq.device)
        rows = kl_head(hq, params_q, hr, params_r, targets, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                       top_k=top_k)
        parts.append(KLRows(*(x.cpu() for x in (rows.logprobs_q, rows.logprobs_r, rows.kl, rows.same_top)),
                            *(None if t is None else (t[0].cpu(), t[1].cpu()) for t in (rows.top_q, rows.top_r))))

    with torch.no_grad():
        for r in requests:
            if group and size + r.num_inputs > token_budget:
                flush()
                group, size = [], 0
            group.append(r)
            size += r.num_inputs
        if group:
            flush()
    tops = [None if top_k == 0 else tuple(torch.cat([getattr(p, f)[j] for p in parts]) for j in (0, 1))
            for f in ("top_q", "top_r")]
    return KLRows(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprobs_q", "logprobs_r", "kl", "same_top")),
                  *tops)


def compare_models(q: ScoringContext, engine_q: Engine, r: ScoringContext, engine_r: Engine, texts,
                   windows: Windows = Windows(), return_token_stats: bool = False, top_k: int = 0) -> CompareResult:
    """``Scorer.compare`` once ``reference`` is a Scorer: Q's perplexity windows, run on both
    models' engines (this process), compared row by row. ``top_k`` > 0: the result also holds each
    model's ``top_k`` most likely tokens at every scored token (``token_top_q``, ``token_top_r``)."""
    a, b = q.tokenizer.hf, r.tokenizer.hf
    if q.vocab_size != r.vocab_size or len(a) != len(b) or a.get_vocab() != b.get_vocab():
        raise LogprobeError("reference", f"{r.name} does not share the vocabulary of {q.name} "
                            f"({r.vocab_size} vs {q.vocab_size} logits, {len(b)} vs {len(a)} "
                            "tokens)", "compare models with the same tokenizer (e.g. two quantizations of one model)")
    job = perplexity_job(q, texts, windows)
    config = engine_q.config
    rows = compare_requests(engine_q, engine_r, job.requests, token_budget=config.max_batch_tokens,
                            token_chunk=config.head_token_chunk, vocab_chunk=config.head_vocab_chunk, top_k=top_k)
    w = windows.resolved(q.max_length)
    return compare_stats(rows, len(job.requests), w.policy, w.context_length,
                         w.stride if w.policy == "sliding" else None, return_token_stats)


def kl_plot_html(token_kl: Sequence[float], title: str, summary: str, smooth: int = 64,
                 label: str = "KL(R || Q)") -> str:
    """A self-contained HTML page (inline SVG, no scripts or downloads) plotting a per-token value
    (``label``: KL(R || Q) by default) along the text: each token as a thin grey line, a
    ``smooth``-token moving average in blue, the mean as a dashed line; ``summary`` (e.g.
    ``CompareResult.report()``) printed below."""
    n = len(token_kl)
    if n == 0:
        raise LogprobeError("token_kl", "is empty (no scored tokens to plot)", "compare a longer text")
    W, Hh, pad = 1000, 320, 40  # SVG user units: plot area [pad, W - pad] x [pad, Hh - pad]
    top = max(max(token_kl), 1e-12)
    x = lambda i: pad + (W - 2 * pad) * (i / max(1, n - 1))  # noqa: E731
    y = lambda v: Hh - pad - (Hh - 2 * pad) * (v / top)  # noqa: E731
    raw = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(token_kl))
    k = max(1, min(smooth, n))
    csum = [0.0]
    for v in token_kl:
        csum.append(csum[-1] + v)
    avg = [(csum[i + 1] - csum[max(0, i + 1 - k)]) / (i + 1 - max(0, i + 1 - k)) for i in range(n)]
    sm = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(avg))
    mean = csum[-1] / n
    worst = max(range(n), key=token_kl.__getitem__)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {Hh}" width="100%">'
           f'<rect x="{pad}" y="{pad}" width="{W - 2 * pad}" height="{Hh - 2 * pad}" fill="none" stroke="#888"/>'
           f'<polyline points="{raw}" fill="none" stroke="#bbb" stroke-width="0.6"/>'
           f'<polyline points="{sm}" fill="none" stroke="#1f5fbf" stroke-width="1.6"/>'
           f'<line x1="{pad}" x2="{W - pad}" y1="{y(mean):.1f}" y2="{y(mean):.1f}" stroke="#c33" '
           f'stroke-dasharray="6 4"/>'
           f'<circle cx="{x(worst):.1f}" cy="{y(token_kl[worst]):.1f}" r="3" fill="#c33"/>'
           f'<text x="{pad}" y="{pad - 8}" font-size="12">{html.escape(label)} per token (max {top:.4g} at token '
           f'{worst}; mean {mean:.4g} dashed; {k}-token moving average in blue)</text>'
           f'<text x="{pad}" y="{Hh - 12}" font-size="12">token 0</text>'
           f'<text x="{W - pad}" y="{Hh - 12}" font-size="12" text-anchor="end">token {n - 1}</text>'
           f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{top:.3g}</text>'
           f'<text x="{pad - 4}" y="{Hh - pad}" font-size="11" text-anchor="end">0</text></svg>')
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>"
            f"<body style=\"font-family:sans-serif;max-width:1100px;margin:2em auto\"><h2>{html.escape(title)}</h2>"
            f"{svg}<pre>{html.escape(summary)}</pre></body></html>\n")

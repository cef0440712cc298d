r"""Gated DeltaNet, the linear-attention mixer of Qwen3-Next and Qwen3.5, as pure PyTorch layers.

Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``) stack three of
these layers before each gated full-attention layer. This module is the float32 reference of the
mixer, written for packed batches (one flat token axis, sequences delimited by ``cu_seqlens`` as
in FlashAttention and fla) and for carried state, so a long sequence can be scored in pieces and a
shared prefix's state reused. A GPU path comes later and is tested against it.

The maths
---------
Per value head ``h`` (the head index is dropped below), with ``q_t, k_t`` in ``R^Dk`` and ``v_t`` in
``R^Dv``, the state ``S`` is a ``[Dk, Dv]`` matrix (a map from keys to values), zero at the start of
a sequence unless an initial state is given::

    q_t <- q_t / sqrt(|q_t|^2 + 1e-6) * Dk^-1/2      k_t <- k_t / sqrt(|k_t|^2 + 1e-6)
    S'  = exp(g_t) * S_{t-1}                           decay, g_t <= 0 (log space)
    u_t = beta_t * (v_t - S'^T k_t)                    the delta: what S' mispredicts for k_t
    S_t = S' + k_t u_t^T                               write strength beta_t in (0, 1)
    o_t = S_t^T q_t                                    the output reads the state *after* token t

with ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` and ``beta_t = sigmoid(b_t)`` (``decay_and_beta``).
Grouped value attention: value head ``h`` reads key/query head ``h // (Hv // Hk)`` (consecutive
value heads share a key head, ``repeat_interleave`` order, as transformers and fla do).

``gated_delta_rule_recurrent`` runs exactly these lines, one token at a time. The chunked form
(``gated_delta_rule_chunked``) computes the same thing a chunk of ``C = 64`` tokens at a time.
Within a chunk, with ``G_t = g_1 + ... + g_t`` (cumulated from the chunk's first token) and ``S_0``
the state entering the chunk, unrolling the recurrence gives

    S_t = exp(G_t) S_0 + sum_{j<=t} exp(G_t - G_j) k_j u_j^T
    u_t = beta_t (v_t - exp(G_t) S_0^T k_t - sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j)

so, in matrix form over the chunk's rows, ``(I + A) U = beta V - diag(beta exp(G)) K S_0`` with
``A_tj = beta_t exp(G_t - G_j) k_t . k_j`` strictly lower triangular. One unit-triangular solve per
chunk (the UT transform; WY representation of the product of the chunk's generalised Householder
updates) gives ``W_v = (I + A)^-1 beta V`` and ``W_k = (I + A)^-1 diag(beta exp(G)) K``, both
independent of ``S_0``; then, chunk after chunk,

    U     = W_v - W_k S_0
    O     = diag(exp(G)) Q S_0 + (M * Q K^T) U         M_tj = exp(G_t - G_j) for j <= t, else 0
    S_end = exp(G_C) S_0 + (diag(exp(G_C - G)) K)^T U

Decays are only ever exponentiated as differences ``G_t - G_j <= 0`` or as ``G_t <= 0``, so nothing
overflows however strong the decay.

Which output depends on which state, and splitting a sequence
-------------------------------------------------------------
Tokens are numbered from 0 and ``S_p`` is the state after the first ``p`` tokens, so ``o_t`` reads
``S_{t+1}``, which depends on the earlier tokens only through ``S_t``. The state after ``p`` tokens
(with the conv state, below) is therefore a complete summary of them: running tokens ``[0, p)``
and then ``[p, n)`` from the carried state computes *mathematically* the same outputs as running
``[0, n)``, for **any** ``p``. Worked example, a sequence of 150 tokens::

    whole run:        chunks [0, 64) [64, 128) [128, 150)                   o_0..o_149, S_150
    split at p = 64:  [0, 64) -> S_64;   then [64, 128) [128, 150) from S_64
    split at p = 100: [0, 64) [64, 100) -> S_100;   then [100, 150) from S_100

``o_99`` reads ``S_100``. In the whole run it comes out of chunk ``[64, 128)`` as ``exp(G) Q S_64``
plus that chunk's within-chunk sum over tokens 64..99; after the split at 100 it comes out of the
chunk ``[64, 100)``, the same formula on a shorter chunk (same value, other rounding), and the
piece after the split is chunked from its own start, ``[100, 150)`` in one chunk; after the split
at 64 every output is computed by the very same operations on the very same values as in the
whole run.

The contract: a split at **any** ``p`` continues exactly up to float rounding (the recurrent form
is even bit-identical at any ``p``, being token by token); a split at a **multiple of the chunk size,
counted from the sequence's own first token**, reproduces the whole run's chunk grid and hence
the same floating-point operations, so the chunked outputs and states are bit-identical (on one
device and kernel). A split elsewhere shifts the grid of everything after it (the piece after
``p`` is chunked from ``p``), so its results differ from the whole run by rounding only
(~1e-6 relative in float32): the whole run never forms the state at a mid-chunk position, so no
split there can replay its arithmetic. A scheduler that wants deterministic-mode results
independent of how a long request was cut, or of whether a shared prefix's state was reused, cuts
long requests and ends reusable prefixes at multiples of ``CHUNK_SIZE`` from the sequence start.

Chunk boundaries, packing and batch invariance
----------------------------------------------
Chunks are counted from each packed sequence's own first token (``cu_seqlens[i]``), never from the
start of the batch, and each sequence is computed on its own tensors (a sequence's last chunk is
padded with ``g = 0, beta = 0, k = 0`` tokens, which change nothing). So a sequence's outputs and
final state are the same function of its own tokens and initial state whatever else is packed
beside it, or where: the batch-invariance that deterministic mode needs. On CPU this holds bit
for bit (the tests check it); the elementwise transcendental ops over the packed token axis (SiLU,
softplus, sigmoid) go through ``activation.row_invariant``, since PyTorch's CPU loops round their
scalar tail differently from their SIMD body and the tail moves with the number of tokens.

The short convolution and the output norm
-----------------------------------------
Before the rule, the concatenated ``[q | k | v]`` projections go through a causal depthwise
convolution of width ``K = 4`` and SiLU (``causal_conv1d``): ``y_t = silu(sum_j w[:, j] x_{t-K+1+j})``.
Its state is the last ``K - 1`` inputs, ``[N, C, K - 1]`` (channels first, oldest first, zeros at a
sequence start), so it splits at any ``p`` bit-identically. After the rule, ``o`` is normalised per
head and gated: ``gated_rms_norm(o, z) = w * o / rms(o) * silu(z)`` (norm, then gate). Its weight
is applied as stored, ``w`` (initialised to ones), in both families: unlike the models' other
RMSNorms, which store ``w`` and apply ``1 + w``.

Numerics: every function computes in float32 whatever the activation dtype (float64 stays float64,
for tests); outputs come back in the activation dtype, recurrent states in float32. The decay is
rounded as the models round it (``decay_and_beta``: ``A_log`` and ``a`` in float32 even in a float64
model), so the layer matches transformers' to ~1e-14 in float64.

The projections' two layouts (``GatedDeltaNet``)
------------------------------------------------
Qwen3.5 stores ``in_proj_qkv`` (rows ``[q heads | k heads | v heads]``, the conv's channel order),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Qwen3-Next stores ``in_proj_qkvz`` and ``in_proj_ba``
grouped by key head (per key head: ``q, k, v of its Hv/Hk value heads, z of them``; and ``b, a``);
``split_qwen3_next_projections`` permutes those rows into the Qwen3.5 layout.

GPU path (not a dependency yet): ``fla-core`` (0.6.0, pure Triton) provides
``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False, ..., cu_seqlens=None, ...)`` with inputs
``[1, T, H, D]`` for packed sequences, ``cu_seqlens`` ``[N + 1]`` (long), states ``[N, HV, K, V]``, the
same GVA head mapping, chunk size 64 with chunks counted per sequence, and
``fused_recurrent_gated_delta_rule`` for the token-by-token form; ``fla.modules.causal_conv1d``
takes ``cu_seqlens`` and ``initial_state`` too, but its state keeps the last ``K`` inputs
``[N, C, K]`` (ours is its last ``K - 1`` columns). Such a path is to be tested against this reference.

    >>> T, Hk, Hv, Dk, Dv = 5, 1, 2, 4, 3
    >>> q, k = torch.randn(T, Hk, Dk), torch.randn(T, Hk, Dk)
    >>> v, g, beta = torch.randn(T, Hv, Dv), -torch.rand(T, Hv), torch.rand(T, Hv)
    >>> o, s = gated_delta_rule_chunked(q, k, v, g, beta, cu_seqlens=[0, 2, 5])  # two sequences
    >>> o.shape, s.shape
    (torch.Size([5, 2, 3]), torch.Size([2, 2, 4, 3]))
    >>> o2, _ = gated_delta_rule_chunked(q[2:], k[2:], v[2:], g[2:], beta[2:])  # the second, alone
    >>> torch.equal(o2, o[2:])
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gated_delta import (
    CHUNK_SIZE,
    CuSeqlens,
    compute_dtype,
    initial_states,
    l2_normalize,
    sequence_bounds,
)
from .activation import row_invariant

# --------------------------------------------------------------------------------------------
# Shared helpers live beside the batched kernels (kernels.gated_delta): compute_dtype,
# sequence_bounds, l2_normalize, initial_states, CHUNK_SIZE, L2_EPS.


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and write
    strength ``beta = sigmoid(b)``, rounded as the models compute them: ``A_log`` and ``a`` in
    float32 whatever the model's dtype (``.float()``: in float16, ``exp(A_log)`` could overflow),
    ``dt_bias`` in its own dtype, ``beta`` in ``b``'s dtype. ``a, b: [T, Hv]``; ``A_log, dt_bias: [Hv]``."""
    g = -A_log.float().exp() * row_invariant(F.softplus, a.float() + dt_bias)
    return g, row_invariant(torch.sigmoid, b)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None, qk_l2norm: bool, cd: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised, scaled ``q`` and normalised ``k`` in ``cd``, one per value head: [T, Hv, Dk]."""
    q, k = q.to(cd), k.to(cd)
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = num_v_heads // k.shape[1]
    if group * k.shape[1] != num_v_heads:
        raise ValueError(f"{num_v_heads} value heads are not a multiple of {k.shape[1]} key heads")
    # [T, Hk, Dk] -> [T, Hv, Dk]: value head h reads key head h // group
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def _head_major(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows ``a:b`` of a token-major tensor ``[T, H, ...]`` as a fresh ``[H, b - a, ...]``."""
    return x[a:b].transpose(0, 1).contiguous()


def _run_rule(step, q, k, v, g, beta, cu_seqlens, initial_state, scale, qk_l2norm):
    """Both forms: prepare, then ``step(q, k, v, g, beta, S)`` per sequence on head-major tensors
    ``[H, L, D]``, ``[H, L]`` and ``S [H, Dk, Dv]``, returning ``(o [H, L, Dv], S)``."""
    T, Hv, Dv = v.shape
    out_dtype, cd = v.dtype, compute_dtype(q, k, v, g, beta, initial_state)
    q, k = _prepare_qk(q, k, Hv, scale, qk_l2norm, cd)
    v, g, beta = v.to(cd), g.to(cd), beta.to(cd)
    bounds = sequence_bounds(cu_seqlens, T)
    states = initial_states(initial_state, len(bounds), (Hv, k.shape[-1], Dv), cd, v.device)
    out = torch.empty((T, Hv, Dv), dtype=cd, device=v.device)
    finals = []
    for i, (a, b) in enumerate(bounds):
        o, s = step(*(_head_major(x, a, b) for x in (q, k, v, g, beta)), states[i])
        out[a:b] = o.transpose(0, 1)  # [H, L, Dv] -> [L, H, Dv]
        finals.append(s)
    return out.to(out_dtype), torch.stack(finals)


# --------------------------------------------------------------------------------------------
# The gated delta rule


def _recurrent_sequence(q, k, v, g, beta, S):
    """One sequence, token by token. q, k: [H, L, Dk]; v: [H, L, Dv]; g, beta: [H, L]; S: [H, Dk, Dv]."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        S = S * g[:, t].exp()[:, None, None]
        predicted = (S * k[:, t, :, None]).sum(1)  # S'^T k_t: [H, Dv]
        u = beta[:, t, None] * (v[:, t] - predicted)  # [H, Dv]
        S = S + k[:, t, :, None] * u[:, None, :]  # + k_t u_t^T
        out[:, t] = (S * q[:, t, :, None]).sum(1)  # S_t^T q_t
    return out, S


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the rule token by token, per packed sequence.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv]; cu_seqlens: [N + 1] or None
    (one sequence); initial_state: [N, Hv, Dk, Dv] or None (zeros). ``scale`` defaults to
    ``Dk ** -0.5``; ``qk_l2norm`` L2-normalises q and k first (as both families do).
    Returns ``(o [T, Hv, Dv] in v's dtype, final states [N, Hv, Dk, Dv] in float32)``."""
    return _run_rule(_recurrent_sequence, q, k, v, g, beta, cu_seqlens, initial_state, scale, qk_l2norm)


def _chunk(x: torch.Tensor, length: int, size: int) -> torch.Tensor:
    """``[H, L, ...]`` zero-padded to ``n * size`` tokens and viewed as ``[H, n, size, ...]``."""
    pad = length - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], dim=1)
    return x.view(x.shape[0], length // size, size, *x.shape[2:])


def _within_chunk(q, k, v, g, beta, size):
    """The per-chunk quantities, independent of the entering state. Inputs head-major [H, L, ...];
    returns tensors over chunks [H, n, C, ...]: W_v, W_k, the masked decayed scores M * Q K^T, the
    decayed queries exp(G) Q, the keys decayed to the chunk end, and the chunk's total decay."""
    length = -(-v.shape[1] // size) * size
    q, k, v, g, beta = (_chunk(x, length, size) for x in (q, k, v, g, beta))  # [H, n, C, ...]
    G = g.cumsum(-1)  # [H, n, C], from each chunk's first token
    causal = torch.ones(size, size, dtype=torch.bool, device=v.device).tril()
    diff = G[..., :, None] - G[..., None, :]  # [H, n, C, C]: G_t - G_j
    decay = diff.masked_fill(~causal, float("-inf")).exp()  # exp(G_t - G_j) for j <= t, else 0
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # A: strictly lower
    w_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        system, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # M * Q K^T, diagonal included
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    return w_v, w_k, scores, q_decayed, k_to_end, G[..., -1].exp()


def _chunked_sequence(q, k, v, g, beta, S, size=CHUNK_SIZE):
    """One sequence, a chunk at a time, chunks counted from its first token. Shapes as
    ``_recurrent_sequence``."""
    H, L, Dv = v.shape
    w_v, w_k, scores, q_decayed, k_to_end, chunk_decay = _within_chunk(q, k, v, g, beta, size)
    out = v.new_empty((H, w_v.shape[1], size, Dv))
    for c in range(w_v.shape[1]):
        u = w_v[:, c] - w_k[:, c] @ S  # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ S + scores[:, c] @ u
        S = S * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.view(H, -1 if L else 0, Dv)[:, :L], S  # [H, n, C, Dv] -> [H, L, Dv]


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule a chunk at a time (the UT-transform form, see the module docstring); same
    arguments and results as ``gated_delta_rule_recurrent``. Chunks start at each sequence's first
    token, so a sequence's results do not depend on what is packed beside it."""

    def step(*args):
        return _chunked_sequence(*args, size=chunk_size)

    return _run_rule(step, q, k, v, g, beta, cu_seqlens, initial_state, scale, qk_l2norm)


# --------------------------------------------------------------------------------------------
# The short causal convolution


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    initial_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution per packed sequence: ``y_t = act(b + sum_j w[:, j] x_{t-K+1+j})``.

    x: [T, C]; weight: [C, K] (a checkpoint's ``conv1d.weight [C, 1, K]`` squeezed); initial_state:
    [N, C, K - 1], the inputs before each sequence, oldest first (None: zeros). Returns
    ``(y [T, C] in x's dtype, final states [N, C, K - 1] in x's dtype: each sequence's last K - 1
    inputs, reaching into its initial state when it is shorter than that)``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x.shape
    K = weight.shape[-1]
    cd = compute_dtype(x, weight)
    bounds = sequence_bounds(cu_seqlens, T)
    states = initial_states(initial_state, len(bounds), (C, K - 1), x.dtype, x.device)
    w = weight.reshape(C, K).to(cd)
    y = torch.empty((T, C), dtype=cd, device=x.device)
    finals = []
    for i, (a, b) in enumerate(bounds):
        window = torch.cat([states[i].transpose(0, 1), x[a:b]]).to(cd)  # [K - 1 + L, C]
        acc = window[0 : b - a] * w[:, 0]
        for j in range(1, K):  # taps in a fixed order, oldest input first
            acc = acc + window[j : j + b - a] * w[:, j]
        if bias is not None:
            acc = acc + bias.to(cd)
        y[a:b] = acc
        finals.append(window[window.shape[0] - (K - 1) :].transpose(0, 1).to(x.dtype))  # [C, K - 1]
    if activation is not None:
        y = row_invariant(F.silu, y)
    return y.to(x.dtype), torch.stack(finals)


# --------------------------------------------------------------------------------------------
# The gated output norm


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps) * silu(z)`` over the last axis: normalise, then gate.
    The weight multiplies as stored (``w``, not ``1 + w``). As the models do it: the norm in float32,
    cast to x's dtype before the weight, the gate in float32, the result in x's dtype."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * row_invariant(F.silu, z.to(cd))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``gated_rms_norm`` with its weight (checkpoint name ``norm.weight``, shape [head_v_dim])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


# --------------------------------------------------------------------------------------------
# The mixer


@dataclass
class GatedDeltaState:
    """What a sequence carries from one piece to the next: ``conv [N, C, K - 1]`` (the conv's last
    inputs) and ``recurrent [N, Hv, Dk, Dv]`` (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def split_qwen3_next_projections(
    in_proj_qkvz: torch.Tensor, in_proj_ba: torch.Tensor, num_k_heads: int, head_k_dim: int,
    num_v_heads: int, head_v_dim: int,
) -> dict[str, torch.Tensor]:
    """Qwen3-Next's key-head-grouped ``in_proj_qkvz`` / ``in_proj_ba`` weights as the Qwen3.5
    layout's ``in_proj_qkv`` (rows ``[q | k | v]``, the conv's channel order), ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a``."""
    r, hidden = num_v_heads // num_k_heads, in_proj_qkvz.shape[-1]
    # [Hk * (2 Dk + 2 r Dv), hidden] -> [Hk, 2 Dk + 2 r Dv, hidden]
    qkvz = in_proj_qkvz.view(num_k_heads, 2 * head_k_dim + 2 * r * head_v_dim, hidden)
    q, k, v, z = qkvz.split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1)
    ba = in_proj_ba.view(num_k_heads, 2 * r, hidden)  # [Hk * 2r, hidden] -> [Hk, 2r, hidden]
    b, a = ba.split([r, r], dim=1)
    rows = lambda t: t.reshape(-1, hidden)  # noqa: E731  [Hk, n, hidden] -> [Hk * n, hidden]
    return {
        "in_proj_qkv": torch.cat([rows(q), rows(k), rows(v)]),
        "in_proj_z": rows(z),
        "in_proj_b": rows(b),
        "in_proj_a": rows(a),
    }


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer over packed tokens, Qwen3.5's weight layout (plain ``nn.Linear``
    projections; ``split_qwen3_next_projections`` maps Qwen3-Next's). ``conv_weight`` is the
    checkpoint's ``conv1d.weight`` squeezed to [C, K]."""

    def __init__(
        self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
        conv_kernel_size: int = 4, eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(conv_dim, conv_kernel_size), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cu_seqlens: CuSeqlens = None, state: GatedDeltaState | None = None,
        recurrent: bool = False,
    ) -> tuple[torch.Tensor, GatedDeltaState]:
        """x: [T, hidden] packed; state: each sequence's carried state (None: a fresh start).
        ``recurrent`` runs the token-by-token reference instead of the chunked form."""
        T = x.shape[0]
        mixed, conv_state = causal_conv1d(
            self.in_proj_qkv(x), self.conv_weight, cu_seqlens, None if state is None else state.conv
        )
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)  # [T, Hk * Dk] -> [T, Hk, Dk]
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)  # [T, Hv * Dv] -> [T, Hv, Dv]
        g, beta = decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        rule = gated_delta_rule_recurrent if recurrent else gated_delta_rule_chunked
        o, s = rule(q, k, v, g, beta, cu_seqlens, None if state is None else state.recurrent)
        z = self.in_proj_z(x).view(T, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        o = self.norm(o, z).reshape(T, self.value_dim)  # [T, Hv, Dv] -> [T, Hv * Dv]
        return self.out_proj(o), GatedDeltaState(conv_state, s)

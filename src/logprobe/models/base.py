"""``ScoringModel``: what every native family's top module shares with the engine, whatever its
blocks: the forward pass (embed, rotary table, blocks, final norm, with the hook points ``embed``
and ``final_norm``), hook checks (router points are capture-only), the numerics hand-over, and the
head's parameters. A family's model subclasses it and sets ``embed_tokens``, ``layers`` (each called
as ``layer(h, cis, meta, hooks)``), ``rotary``, ``norm``, ``lm_head`` (None when tied),
``vocab_range``, ``vocab_grid``, ``ctx`` and ``config.vocab_size`` in its ``__init__``; a family
whose embedding or rotary differs overrides ``forward``.

Under data-parallel attention (``ParallelContext.attention == "data"``: mixtures of experts with
whole experts per rank) every rank embeds every row, keeps its share of the batch's sequences
(``parallel.rows``) for the blocks, and gathers the final rows back for the head."""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from ..config import Numerics
from ..errors import LogprobeError
from ..layers.attention import AttentionMeta
from ..layers.embedding import VocabParallelEmbedding
from ..layers.hooks import Hooks
from ..layers.linear import Linear, fuse_linears
from ..layers.logprob_head import HeadParams
from ..layers.numerics import NumericsUser
from ..layers.steps import interleave
from ..parallel.context import ParallelContext
from ..parallel.rows import COST_SCALE, RowSplit, assign_rows, cut_costs, micro_cuts, micro_splits
from ..parallel.shard import vocab_chunk_width, vocab_shard


class FusedQKV:
    """q, k, v projections (``q_proj``, ``k_proj``, ``v_proj`` and the head counts set by the
    attention module) run as one matmul once ``fuse()`` has joined them (the loader calls it).
    ``qkv_proj`` exists only once fused (a submodule: a class-level default would shadow it)."""

    def fuse(self) -> None:
        self.qkv_proj: Linear = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Hq * D], k and v [T, Hkv * D]."""
        fused = getattr(self, "qkv_proj", None)
        if fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return fused(x).split([nq, nkv, nkv], dim=-1)


class SplitSteps:
    """A pre-norm block (``input_layernorm`` -> ``self_attn`` -> residual -> ``post_attention_layernorm``
    -> ``mlp`` -> residual) on this rank's rows of a batch split by sequences (``meta.rows``), as a
    generator (``layers.steps``): it yields where its MoE block's transfers run, so that another
    micro-batch's work is launched beside them. The same kernels as ``forward``'s split path.
    ``mix``: the block's token mixer (``self_attn``; a hybrid's linear attention on its blocks)."""

    def mix(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return self.self_attn(x, cis, meta)

    def steps(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta):
        h = h + self.mix(self.input_layernorm(h), cis, meta)  # resid_mid
        x = self.post_attention_layernorm(h)
        mlp_steps = getattr(self.mlp, "steps", None)
        out = (yield from mlp_steps(x, meta.rows)) if mlp_steps is not None else self.mlp(x, None, meta.rows)
        return h + out  # resid_post


def block_chain(layers, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta):
    """Every block on h [n, H] in turn, as one generator (each block's ``steps`` where it has them,
    else its plain call) -> the last block's output [n, H]."""
    for layer in layers:
        steps = getattr(layer, "steps", None)
        h = (yield from steps(h, cis, meta)) if steps is not None else layer(h, cis, meta)
    return h


# parameters a rank does not run once per own row under data-parallel attention: the routed
# experts (split by expert), lookups (embeddings) and the head (vocabulary-split, every row)
_NOT_PER_ROW = re.compile(r"(^|\.)experts\.|embed|(^|\.)lm_head\.|(^|\.)visual\.")


def attention_pair_weight(model: nn.Module) -> int:
    """One (query, key) pair's attention FLOPs over every softmax-attention block, against one
    row's dense FLOPs on its rank (2 a weight of each parameter a row runs through on its own rank:
    not the routed experts, the embeddings, the head), in ``parallel.rows.COST_SCALE`` units: the
    pair weight by which data-parallel attention balances its ranks' rows (``row_split``). A block
    of ``num_heads`` heads of width D costs 4 * heads * D a pair (q·k and p·v); latent attention
    2 * heads * (nope + rope + v). 0 for a model without attention blocks.

    Qwen3-30B-A3B cut to 16 blocks: 16 * 4 * 32 * 128 = 262,144 FLOPs a pair against 2 * 16 *
    19.1M (q, k, v, o, router, norms) = 612M a row: 4.28e-4, so 28 in units of 65,536 (a sequence
    of 2,000 tokens: its rows read 1,000 keys on average, 0.43 of a row's dense work). Measured
    on one H200 (2026-11-28 profile, W1), a pair took 1.49 times its FLOP share: FLOPs under-weigh
    attention, so the cut moves toward balance without overshooting.
    """
    pair = 0
    for layer in getattr(model, "layers", ()):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "num_heads"):
            continue
        if hasattr(attn, "v_dim"):  # latent attention (models.deepseek)
            pair += 2 * attn.num_heads * (attn.nope + attn.rope + attn.v_dim)
        else:
            pair += 4 * attn.num_heads * attn.head_dim
    per_row = sum(p.numel() for name, p in model.named_parameters() if not _NOT_PER_ROW.search(name))
    return round(COST_SCALE * pair / (2 * per_row)) if pair and per_row else 0


def _rows_within(deep, a: int, b: int):
    """``ScoringModel.place_images``' deepstack (rows, features) kept to batch rows a..b - 1, re-based
    to a (a rank's share of the batch under data-parallel attention); None stays None."""
    if deep is None:
        return None
    rows, features = deep
    keep = (rows >= a) & (rows < b)
    return rows[keep] - a, tuple(f[keep] for f in features)


class ScoringModel(NumericsUser, nn.Module):
    router_points: frozenset[str] = frozenset()  # capture-only points (MoE: blocks.l.router)
    deepstack_layers = 0  # blocks after which image features are added at the image rows (Qwen3-VL)
    triton_elementwise = True  # see use_triton_elementwise

    @property
    def cuda_graphs(self) -> bool:
        """Whether a pass may replay as CUDA graphs (``engine.graphs``): on one rank (a rank's
        collectives are not captured). A family that reads the GPU on the host while capturing is
        found out by the capture, and runs eagerly."""
        return not self.ctx.parallel

    def check_hooks(self, hooks: Hooks) -> None:
        """Refuse hooks at points this model does not have: a router point of a dense block (it
        would capture nothing), steering router probabilities, or projecting them onto a vector."""
        for point in hooks.steer:
            if point.endswith(".router"):
                raise LogprobeError("steer", f"{point}: router probabilities are capture-only",
                                    "steer a residual-stream point (e.g. blocks.N.mlp_out)")
        for point, tables in hooks.capture.items():
            if point.endswith(".router") and point not in self.router_points:
                raise LogprobeError("capture", f"{point}: this block has no router (not a mixture-of-experts MLP)",
                                    "capture router probabilities of a mixture-of-experts block")
            if point.endswith(".router") and any(t.kind == "project" for t in tables):
                raise LogprobeError("capture", f"{point}: router probabilities cannot be projected onto a "
                                    "hidden-size vector", "use reduce none, last, mean or sum")

    def use_triton_elementwise(self, on: bool) -> None:
        """RMSNorm, rotary and SiLU(gate) * up as single Triton passes on CUDA (the default), or
        as PyTorch ops (``False``: the benchmark's before/after); MoE blocks switch between the
        fused Triton kernel (``kernels.moe``) and their PyTorch path the same way, the hybrid
        models' short conv between ``kernels.short_conv`` and the batched PyTorch conv. No effect on
        CPU. Kept across the numerics engines hand in (``Numerics.triton``)."""
        self.triton_elementwise = on
        self.set_numerics(replace(self.numerics, triton=True))

    def set_numerics(self, numerics: Numerics) -> None:
        """Every layer computes under ``numerics`` from now on (``layers.numerics``), its
        ``triton`` as ``use_triton_elementwise`` last said; a no-op when they already do."""
        super().set_numerics(replace(numerics, triton=numerics.triton and self.triton_elementwise))

    def shard_vocab(self, cfg, ctx: ParallelContext) -> None:
        """The vocabulary's chunk grid, this rank's shard of it (``vocab_range``) and the
        vocabulary-parallel ``embed_tokens`` over that shard."""
        self.vocab_grid = vocab_chunk_width(cfg.vocab_size)
        self.vocab_range = vocab_shard(cfg.vocab_size, self.vocab_grid, ctx.rank, ctx.size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, *self.vocab_range)

    def head_params(self) -> HeadParams:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return HeadParams(weight=weight, vocab_start=self.vocab_range[0], vocab_total=self.config.vocab_size,
                          comm=self.ctx if self.ctx.parallel else None, grid=self.vocab_grid)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                hooks: Hooks | None = None, images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions [T] (or [3, T]: a multimodal rotary's t/h/w rows) -> final hidden
        states [T, H]. ``images``: (rows [n], embeddings [n, H]) that replace those rows' token
        embeddings (a vision tower's output at the image tokens); [n, (1 + K) H] with K deepstack
        features, each added to those rows after its block (``place_images``)."""
        hooks = hooks or None  # an empty Hooks costs nothing either
        if hooks is not None:
            self.check_hooks(hooks)
        h = self.embed_tokens(input_ids)  # [T, H]: every row (the vocabulary-parallel sum is the group's)
        deep = None
        if images is not None:
            h, deep = self.place_images(h, images)
        if hooks is not None:
            h = hooks("embed", h)
        split = self.row_split(meta, hooks)
        # deepstack features join the blocks' outputs one block at a time: one batch, no micro-batches
        halves = self.micro_batches(meta, split) if split is not None and deep is None else None
        if split is not None:  # data-parallel attention: this rank's sequences only
            a, b = split.own
            h, positions, meta = h[a:b], positions[..., a:b], meta.share(split)  # [n, H], [n]
            deep = _rows_within(deep, a, b)
        if halves is not None:  # two micro-batches, their blocks launched in turn
            h = self.overlapped(h, positions, meta, halves)
        else:
            cis = self.rotary(positions)  # [T, rotary dims / 2] complex
            for i, layer in enumerate(self.layers):
                h = layer(h, cis, meta, hooks)
                if deep is not None and i < len(deep[1]):  # deepstack: block i's image features added
                    rows, features = deep[0], deep[1][i]
                    h = h.index_copy(0, rows, h[rows] + features)
        h = self.norm(h)
        if split is not None:
            h = split.gather(self.ctx, h)  # [T, H]: every rank's rows, for the vocabulary-parallel head
        return h if hooks is None else hooks("final_norm", h)

    def place_images(self, h: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None]:
        """h [T, H] with the image tokens' rows (``images``: rows [n], embeddings [n, (1 + K) H]) taken
        by the tower's first H values, and (rows, the K deepstack features [n, H] each) or None
        (K = ``deepstack_layers`` = 0). Qwen3-VL (K = 3: the tower's blocks 8, 16, 24) adds the
        k-th features to those rows after block k; the hook points see them from
        ``blocks.(k+1).resid_pre`` on (``blocks.k.resid_post`` is the block's own output)."""
        rows, embeds = images
        H, k = h.shape[-1], self.deepstack_layers
        if embeds.shape[-1] != H * (1 + k):
            raise LogprobeError("images", f"the vision tower gave {embeds.shape[-1]} values a token, the text model "
                                f"takes {H} * {1 + k}", "report this: the tower and the text model disagree")
        h = h.index_copy(0, rows, embeds[:, :H].to(h.dtype))
        return h, ((rows, embeds[:, H:].to(h.dtype).split(H, dim=-1)) if k else None)

    def micro_batches(self, meta: AttentionMeta, split: RowSplit) -> tuple[int, RowSplit, RowSplit] | None:
        """Under data-parallel attention, this rank's rows as two micro-batches of sequences
        (``parallel.rows.micro_cuts``: every rank's own rows cut near their middle, each half at
        least ``numerics.micro_batch_rows``) -> (this rank's cut, the halves' splits over the
        ranks), or None: one batch. Only where every block can yield (``steps``)."""
        least = self.numerics.micro_batch_rows
        if least <= 0 or not all(hasattr(layer, "steps") and layer.steps is not None for layer in self.layers):
            return None
        local = [meta.share(RowSplit(split.bounds, r)).cuts() for r in range(len(split.counts))]
        cut = micro_cuts(local, least)
        if cut is None:
            return None
        return (cut[split.rank], *micro_splits(cut, split.counts, split.rank))

    def overlapped(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                   halves: tuple[int, RowSplit, RowSplit]) -> torch.Tensor:
        """This rank's rows h [n, H] as two micro-batches (rows ``:c`` and ``c:``) through every
        block, their steps interleaved (``layers.steps.interleave``): while one's expert rows and
        sums travel, the other's attention and experts run. Each row's numbers are its own, as in
        one batch (bitwise in deterministic mode, whose kernels are batch-invariant)."""
        c, first, second = halves
        n = h.shape[0]
        chains = []
        for i, (rows, (a, b)) in enumerate(((first, (0, c)), (second, (c, n)))):
            part = meta.share(RowSplit((0, c, n), i))  # the segments of rows a:b, re-based
            part = AttentionMeta(part.segments, kv_block=part.kv_block, rows=rows)
            chains.append(block_chain(self.layers, h[a:b], self.rotary(positions[..., a:b]), part))
        return torch.cat(interleave(*chains))  # [n, H]

    def row_split(self, meta: AttentionMeta, hooks: Hooks | None) -> RowSplit | None:
        """How this batch's rows split over the ranks under data-parallel attention
        (``ctx.attention == "data"``, ``parallel.rows``), or None: every rank runs every row. A
        batch with hooks (captures, steering and routing replay read and write every row) or
        over cached keys (chunks, cached prefixes) runs whole on every rank, as with tensor-parallel
        attention; so does an empty one."""
        if not self.ctx.data_attention or hooks is not None or meta.cache is not None or meta.past \
                or meta.num_rows == 0:
            return None
        cuts = meta.cuts()  # balanced by cost: rows and attention pairs (``parallel.rows``)
        return RowSplit(assign_rows(cuts, self.ctx.size, cut_costs(meta.segments, cuts, self.pair_weight)),
                        self.ctx.rank)

    @property
    def pair_weight(self) -> int:
        """``attention_pair_weight`` of this model, computed once (the same on every rank: the
        attention blocks and dense weights are whole on each under data-parallel attention)."""
        w = self.__dict__.get("_pair_weight")
        if w is None:
            w = self.__dict__["_pair_weight"] = attention_pair_weight(self)
        return w

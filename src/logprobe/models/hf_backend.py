"""The transformers backend: any causal LM transformers can load, scored by logprobe's own head.

The packed batch is unpacked into a right-padded batch (real tokens first, so causal attention
never reaches a pad and default positions 0..L-1 are right), the model's base forward gives
the final hidden states, and they are packed back into [T, H]. Slower than the native path.
It takes only independent sequences: no shared-prefix context and no chunk KV cache
(``caps.context`` is False, so the engine neither shares prefixes nor chunks for it).

Default mode: one padded forward per batch; the engine packs requests longest first
(``engine.scheduler.plan_batches``), so a batch holds neighbouring lengths and little padding.
A request's numbers may then move in the last bits with its batch (another padded length,
other kernels).

Deterministic mode (``caps.deterministic``): each request runs alone in its own forward (a batch
of one, no padding, no attention mask), so its hidden states cannot depend on what else the
batch holds, its order or the budget; the log-prob head is batch-invariant in that mode, so a
request's every output is bitwise the same alone and in any mix. Slower: one forward per request.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import LogprobeError
from ..layers.attention import AttentionMeta
from ..layers.logprob_head import HeadParams
from ..layers.numerics import NumericsUser
from .caps import ModelCaps


class TransformersModel(NumericsUser, nn.Module):
    caps = ModelCaps(context=False, hooks=False, deterministic=True)

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model.requires_grad_(False)
        self.base = getattr(hf_model, hf_model.base_model_prefix)
        out = hf_model.get_output_embeddings()
        if out is None:
            raise LogprobeError("model", f"{type(hf_model).__name__} has no output embeddings (LM head)")
        cfg = hf_model.config
        scale = float(getattr(cfg, "logit_scale", None) or 1.0)
        if getattr(cfg, "logits_scaling", None):  # Granite divides logits
            scale = scale / float(cfg.logits_scaling)
        self.head = HeadParams(weight=out.weight, bias=getattr(out, "bias", None), scale=scale,
                               softcap=getattr(cfg, "final_logit_softcapping", None))
        self.vocab_size = out.weight.shape[0]

    def head_params(self) -> HeadParams:
        return self.head

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        if meta.cache is not None or any(s.context for s in meta.segments):
            raise LogprobeError("model", "the transformers backend cannot run shared-prefix or chunked batches",
                                "score with a native model, or let the engine plan the batch")
        cu_seqlens = [0] + [s.end for s in meta.segments]
        lengths = [s.end - s.start for s in meta.segments]
        if self.numerics.deterministic:  # each request alone: a batch of one, no padding, no mask
            return torch.cat([self.base(input_ids=input_ids[s:s + n][None], use_cache=False).last_hidden_state[0]
                              for s, n in zip(cu_seqlens[:-1], lengths)])  # [T, H]
        B, L = len(lengths), max(lengths)
        pad = torch.zeros(B, L, dtype=input_ids.dtype, device=input_ids.device)  # [B, L]
        mask = torch.zeros(B, L, dtype=torch.long, device=input_ids.device)  # [B, L]
        for i, (s, n) in enumerate(zip(cu_seqlens[:-1], lengths)):
            pad[i, :n] = input_ids[s:s + n]
            mask[i, :n] = 1
        hidden = self.base(input_ids=pad, attention_mask=mask, use_cache=False).last_hidden_state  # [B, L, H]
        return torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])  # [T, H]

    @torch.no_grad()
    def check_head(self) -> None:
        """Refuse a model whose logits are not ``head(last_hidden_state)`` (an unknown transform)."""
        ids = torch.arange(1, 9, device=self.head.weight.device)[None] % self.vocab_size  # [1, 8]
        ref = self.hf(input_ids=ids, use_cache=False).logits[0].float()  # [8, V]
        h = self.base(input_ids=ids, use_cache=False).last_hidden_state[0].float()  # [8, H]
        z = h @ self.head.weight.float().T
        if self.head.bias is not None:
            z = z + self.head.bias.float()
        z = z * self.head.scale
        if self.head.softcap is not None:
            z = torch.tanh(z / self.head.softcap) * self.head.softcap
        tol = 1e-3 if self.head.weight.dtype == torch.float32 else 5e-2
        if not torch.allclose(z, ref, atol=tol * max(1.0, float(ref.abs().max())), rtol=0):
            raise LogprobeError("model", f"{type(self.hf).__name__} transforms its logits in a way logprobe "
                                "does not know, so its scores would be wrong", "please report this model")

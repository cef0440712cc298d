"""Quantized linear layers kept packed in memory, dequantized inside the matmul.

Same interface as ``layers.linear.Linear`` (``forward(x [T, in]) -> [T, out]``, ``numerics``), so
the model never knows the weight format. Formats:

* ``GGUFLinear``: GGUF Q8_0 / Q4_0 / Q4_1 blocks of 32 and Q4_K / Q6_K super-blocks of 256
  (``kernels.gguf_quants``).
* ``CTLinear``: compressed-tensors integer weights (llm-compressor's checkpoints): ``pack-quantized``
  int4 or int8 codes in int32 words (W4A16, W8A16) and ``naive-quantized`` int8, with per-group
  (e.g. 128) or per-channel scales, symmetric or with a zero point:  w = (q - zp) * scale.

On CPU a layer expands its weight to float32 for the one product and drops it, so the
full-precision model never exists: peak weight memory is the packed model plus one layer. The
expanded weight is bitwise the one the dense loader builds (same function), so packed and dense
results are identical. On CUDA, int4 layers run ``kernels.w4a16``: the Triton dequant-GEMM for few
rows, a one-pass Triton expansion of the one layer + cuBLAS for many; GGUF layers expand in one
Triton pass into the activation dtype (``kernels.gguf_expand``, bitwise the same weight) + cuBLAS.

``PackedEmbedding`` keeps a (possibly tied) token embedding packed; its ``weight`` is a
``PackedRows`` view that the log-prob head slices chunk by chunk, so the head dequantizes one
vocabulary chunk at a time. On CUDA the head instead asks for ``PackedRows.resident()``: the whole
matrix expanded once into the model's dtype and kept, when it fits in ``DENSE_HEAD_SHARE`` of the
free memory, so the fused Triton head runs on it (bitwise the same weight as the chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..kernels import interpreting, triton_available
from ..kernels.gguf_expand import gguf_expand
from ..kernels.gguf_quants import block_values, dequantize_blocks
from ..kernels.packing import unpack_int32
from ..kernels.w4a16 import w4a16_linear
from .linear import Linear

DENSE_HEAD_SHARE = 0.1  # the most of the free GPU memory a resident dense copy of a packed head may take
EXPAND_ROWS = 8192  # rows expanded at a time into the resident copy (bounds the temporaries)


def dense_head_fits(need: int, free: int) -> bool:
    """Whether a packed LM head of ``need`` bytes dense is kept expanded, with ``free`` bytes free.

    >>> llama_8b_bf16 = 128256 * 4096 * 2  # 1.05 GB
    >>> dense_head_fits(llama_8b_bf16, 40 * 2**30), dense_head_fits(llama_8b_bf16, 8 * 2**30)
    (True, False)
    """
    return need <= free * DENSE_HEAD_SHARE


def expand_all(owner: PackedWeight, dtype: torch.dtype, step: int = EXPAND_ROWS) -> torch.Tensor:
    """``owner.rows_in(slice(None), dtype)`` [out, in], built ``step`` rows at a time (bitwise the same:
    every row expands alone). ``PackedWeight.dense`` gives the same values through one float32 copy
    of the whole matrix; this bounds the temporaries and keeps GGUF's one-pass expansion."""
    out = torch.empty(owner.out_features, owner.in_features, dtype=dtype, device=owner.device)
    for r0 in range(0, owner.out_features, step):
        r1 = min(r0 + step, owner.out_features)
        out[r0:r1] = owner.rows_in(slice(r0, r1), dtype)
    return out


class PackedRows:
    """A read-only, tensor-like view of a packed ``[out, in]`` weight: ``rows[idx]`` dequantizes
    just those rows (an index tensor or a slice) to ``dtype``. Enough for the chunked head."""

    def __init__(self, owner: PackedWeight, dtype: torch.dtype) -> None:
        self.owner = owner
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.owner.out_features, self.owner.in_features))

    @property
    def device(self) -> torch.device:
        return self.owner.device

    def stride(self, dim: int = -1) -> int:
        return 0  # not a strided tensor: keeps the fused Triton head (which needs one) off

    def __getitem__(self, idx) -> torch.Tensor:
        return self.owner.rows_in(idx, self.dtype)

    def resident(self) -> torch.Tensor | None:
        """The whole weight in ``dtype``, expanded once and kept by its owner, for the fused CUDA
        head (which needs a strided tensor; the chunked head re-expands every vocabulary chunk of
        every batch). None off CUDA, or when it would take more than ``DENSE_HEAD_SHARE`` of the
        free memory (then the chunked head runs, as before)."""
        kept = getattr(self.owner, "resident_rows", None)
        if kept is not None and kept.dtype == self.dtype:
            return kept
        if self.device.type != "cuda":
            return None
        need = self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()
        if not dense_head_fits(need, torch.cuda.mem_get_info(self.device)[0]):
            return None
        self.owner.resident_rows = expand_all(self.owner, self.dtype)
        return self.owner.resident_rows


class PackedWeight(nn.Module):
    """What every packed format provides: ``rows(idx) -> float32 [n, in]`` and its byte count."""

    out_features: int
    in_features: int
    compute_dtype: torch.dtype = torch.float32

    def rows(self, idx=slice(None)) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def rows_in(self, idx, dtype: torch.dtype) -> torch.Tensor:
        """``rows(idx).to(dtype)``, bitwise; a format may get there in one pass (GGUF on CUDA)."""
        return self.rows(idx).to(dtype)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight, dequantized: float32 [out, in] (then cast to dtype)."""
        w = self.rows(slice(None))
        return w if dtype is None else w.to(dtype)

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def packed_bytes(self) -> int:
        """Bytes of this layer's weight storage (codes, scales, zero points; not the bias)."""
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")


class _PackedLinearMixin(PackedWeight):
    fusable = False  # packed blocks are expanded inside forward: never concatenated
    # the ParallelContext of the gathered-row layer this one replaced (``adopt``): its input and
    # output are gathered over the ranks as that layer's are (None: no communication)
    tp_gather = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.tp_gather
        if ctx is not None:  # x [T, in / size] -> the whole input; this rank's outputs -> [T, out]
            return ctx.gather_columns(self._local_forward(ctx.gather_columns(x)))
        return self._local_forward(x)

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.numerics.row_tile is None:  # deterministic mode: the fixed-tile product
            y = self._cuda_forward(x)
            if y is not None:
                return y
        return self.product(x, self.weight_in(x.dtype), self.bias)  # [out, in] expanded

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in ``dtype``: the float32 expansion the dense loader makes, then ``dtype``."""
        return self.rows(slice(None)).to(dtype)

    def adopt(self, layer) -> None:
        """Take over the deterministic layout of the dense layer this one replaces (its column
        blocks and numerics), so packed and dense weights give the same bits."""
        self.col_blocks = getattr(layer, "col_blocks", None)
        self.numerics = getattr(layer, "numerics", self.numerics)
        if getattr(layer, "gathered", False) and layer.ctx.size > 1:  # a row layer split over ranks: gather too
            if type(self).forward is not _PackedLinearMixin.forward:
                raise LogprobeError("tensor_parallel_size", f"{type(self).__name__} has a forward of its own, which "
                                    "does not gather a row-parallel layer's input", "use tensor_parallel_size 1")
            self.tp_gather = layer.ctx

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    @property
    def weight(self) -> PackedRows:
        return PackedRows(self, self.compute_dtype)


class GGUFLinear(_PackedLinearMixin, Linear):
    """A GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrix: buffers ``d`` [out, nb] f16, ``m`` (Q4_1's
    minimum, Q4_K's dmin), ``qs`` codes (the rest of each k-quant super-block). ``one_pass``
    (class-wide): the Triton expansion on CUDA; False expands in PyTorch (for measuring it)."""

    one_pass = True

    def __init__(self, qtype: str, d: torch.Tensor, qs: torch.Tensor, m: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.qtype = qtype
        self.out_features, nb = d.shape
        self.in_features = nb * block_values(qtype)
        self.register_buffer("d", d)
        self.register_buffer("qs", qs)
        self.register_buffer("m", m)
        self.register_buffer("bias", bias)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        return dequantize_blocks(self.qtype, self.d[idx], self.qs[idx], None if self.m is None else self.m[idx])

    def rows_in(self, idx, dtype: torch.dtype) -> torch.Tensor:
        # on CUDA the rows expand in one Triton pass straight into dtype (the head's vocabulary
        # chunks of a packed embedding, embedding lookups): bitwise ``rows(idx).to(dtype)``
        if not self._one_pass(dtype):
            return self.rows(idx).to(dtype)

        d, m = self.d[idx], None if self.m is None else self.m[idx].contiguous()
        if d.ndim != 2 or d.shape[0] == 0:  # not a list of rows (or none): the reference path
            return self.rows(idx).to(dtype)
        return gguf_expand(self.qtype, d.contiguous(), self.qs[idx].contiguous(), m, dtype)

    def _one_pass(self, dtype: torch.dtype) -> bool:
        return self.one_pass and (self.d.is_cuda or interpreting()) and dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and triton_available()

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        # the whole layer expanded in one Triton pass straight into x's dtype: bitwise the
        # reference's ``rows(...).to(x.dtype)``, so the product is the same F.linear
        if not self._one_pass(x.dtype):
            return None
        return F.linear(x, self.rows_in(slice(None), x.dtype), self.bias)

    def permute_rows(self, perm: torch.Tensor) -> None:
        for name in ("d", "qs", "m", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[perm].contiguous())

    def extra_repr(self) -> str:
        return f"{self.qtype}, in={self.in_features}, out={self.out_features}"


class CTLinear(_PackedLinearMixin, Linear):
    """A compressed-tensors integer weight: w[o, k] = (q[o, k] - zp[o, g]) * scale[o, g], g = k // group.

    Buffers: ``qweight`` ([out, in * bits / 32] int32 words, or [out, in] int8 for naive int8),
    ``scale`` [out, G] (checkpoint dtype), ``zero_point`` [out, G] int8 or None (symmetric).
    ``group_size`` = in for per-channel scales (G = 1)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                 num_bits: int, group_size: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if num_bits not in (4, 8):
            raise LogprobeError("quantization_config", f"{num_bits}-bit integer weights are not supported",
                                "logprobe reads 4- and 8-bit compressed-tensors weights")
        self.num_bits, self.group_size = num_bits, group_size
        self.out_features, self.in_features = int(qweight.shape[0]), int(in_features)
        groups = -(-self.in_features // group_size)
        if tuple(scale.shape) != (self.out_features, groups):
            raise LogprobeError("weight_scale", f"shape {tuple(scale.shape)} does not match "
                                f"[{self.out_features}, {groups}] (in {self.in_features}, group {group_size})")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.register_buffer("bias", bias)

    def codes(self, idx=slice(None)) -> torch.Tensor:
        """Signed integer codes [n, in]."""
        q = self.qweight[idx]
        if q.dtype == torch.int32:
            return unpack_int32(q, self.num_bits, self.in_features)
        return q.to(torch.int16)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        q = self.codes(idx)  # [n, in]
        n, k = q.shape
        scale = self.scale[idx].float()  # [n, G]
        G, g = scale.shape[1], self.group_size
        pad = G * g - k  # a last partial group (e.g. 576 columns in groups of 128)
        qf = F.pad(q, (0, pad)).float().view(n, G, g)  # [n, G, g]
        if self.zero_point is not None:
            qf = qf - self.zero_point[idx].float()[..., None]
        # codes and zero points are small integers, so the float32 product is exact
        return (qf * scale[..., None]).view(n, G * g)[:, :k]  # [n, in]

    def permute_rows(self, perm: torch.Tensor) -> None:
        for name in ("qweight", "scale", "zero_point", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[perm].contiguous())

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.num_bits != 4 or self.qweight.dtype != torch.int32 or x.dtype not in (torch.float16, torch.bfloat16) \
                or not triton_available():
            return None

        y = w4a16_linear(x, self.qweight, self.scale, self.zero_point, self.group_size)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        zp = "asym" if self.zero_point is not None else "sym"
        return f"int{self.num_bits} {zp} group {self.group_size}, in={self.in_features}, out={self.out_features}"


class PackedEmbedding(nn.Module):
    """Token embedding over a packed ``[V, H]`` weight: looks up by dequantizing only the rows asked for."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.rows_in(ids, self.dtype)  # [T, H]

    @property
    def weight(self) -> PackedRows:
        return PackedRows(self.packed, self.dtype)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weight storage by kind: "packed" (PackedWeight layers) and "dense" (every other
    parameter and buffer, norms included). A tied embedding is counted once."""
    packed = dense = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, PackedWeight):
            if id(m) not in seen:
                seen.add(id(m))
                packed += m.packed_bytes()
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t is not None and id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                dense += t.numel() * t.element_size()
    return {"packed": packed, "dense": dense, "total": packed + dense}

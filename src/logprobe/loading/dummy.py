"""Random weights built where they run (``load_format="dummy"``, vLLM's name): each rank makes only
its own shard, on its own device, through the same family builder and FP8 block layers that a
checkpoint's shard fills. For speed measurements of models larger than a machine's disk or host
memory (DeepSeek-V3's 671B on 8 GPUs): the numbers such a model scores mean nothing, its speed is
the real model's.

What is made (``random_tensors``): the rank's model on the meta device names every tensor and its
shape; the model of one rank (ctx None) gives each tensor's whole shape; the loader's own cut
(``sharding.rank_cut``) applied to the whole tensor's row indices says which rows the rank holds.
Every value is a hash of (seed, tensor name, its row in the whole tensor, its column), never of the
rank: a replicated tensor is the same bits on every rank, and the shards of N ranks put together
are the one-rank model, bit for bit (deterministic mode then scores the same bits at every size).

    Linear weights [out, in], experts [E, out, in]   uniform, std 1 / sqrt(in)
    FP8 block checkpoints (quantization_config       the same matrices as e4m3 codes filling
      quant_method "fp8")                            [-448, 448] and one float32 scale per block
                                                     (std / 448 * sqrt(3), times 0.75 .. 1.25): the
                                                     FP8 layers a checkpoint's shard holds
                                                     (``fp8_block.fp8_layer``, ``FP8BlockExperts``);
                                                     norms, embeddings, routers, lm_head float
    norms                                            1 + uniform(-0.1, 0.1)
    embeddings                                       uniform, std 1
    routers [E, H]                                   std 1 / sqrt(H): logits spread about one,
                                                     load spread over the experts; ``skew`` s: the
                                                     rows of the first max(1, E / 16) experts times
                                                     1 + s (a trained router's hot experts)
    biases, e_score_correction_bias                  zero

Families built this way: the Llama family (dense and mixtures of experts: Qwen3-MoE, ...), the
DeepSeek-V3 style (``deepseek_v3``, ``kimi_k2``) and the sigmoid-router ones (GLM-4.5,
MiniMax-M2); float or FP8 block configs. Others are refused, naming the fix.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from ..layers.fp8_block_linear import FP8, FP8BlockExperts
from ..layers.moe import Experts
from ..parallel.context import ParallelContext
from .checkpoint import SKIP
from .fp8_block import FP8BlockScheme, RankPart, fp8_layer, fp8_scheme, is_fp8_block, kept_float
from .registry import Family, Load
from .sharding import rank_cut

LOAD_FORMATS = ("auto", "dummy")
RANDOM_FAMILIES = ("llama", "deepseek", "sigmoid_moe")  # Family.name of those built at random
_M = (1 << 32) - 1
_CHUNK = 1 << 24  # elements hashed at a time: int64 temporaries of 128 MiB


@dataclass(frozen=True, slots=True)
class RandomWeights:
    """``load_format="dummy"`` with its knobs: ``seed`` (another seed, other weights) and ``skew``
    (a skewed router: the first E/16 experts' router rows times 1 + skew)."""

    seed: int = 0
    skew: float = 0.0


def check_load_format(value) -> RandomWeights | None:
    """``load_format`` -> None ("auto": the checkpoint's weights) or the ``RandomWeights`` to make.

    >>> check_load_format("auto"), check_load_format("dummy")
    (None, RandomWeights(seed=0, skew=0.0))
    """
    if isinstance(value, RandomWeights):
        if isinstance(value.seed, bool) or not isinstance(value.seed, int) or not math.isfinite(value.skew) \
                or value.skew <= -1:
            raise LogprobeError("load_format", f"{value!r}: seed must be an integer and skew a number > -1")
        return value
    if value == "auto":
        return None
    if value == "dummy":
        return RandomWeights()
    raise LogprobeError("load_format", f"{value!r} is not a load format",
                        f"use one of {', '.join(LOAD_FORMATS)} (or a RandomWeights(seed, skew))")


def check_random_family(family: Family, raw: dict | None, path_name: str) -> None:
    """Refuse random weights where they are not built: GGUF files, other families, quantization
    other than FP8 blocks."""
    if raw is None:
        raise LogprobeError("load_format", f"dummy: {path_name} is a GGUF file; random weights are built from a "
                            "Hugging Face config", "give a directory holding config.json and the tokenizer")
    if family.name not in RANDOM_FAMILIES:
        raise LogprobeError("load_format", f"dummy: random weights are not built for the {family.title} family",
                            "use a checkpoint of it, or a config of the Llama, DeepSeek-V3 or GLM-4.5 / "
                            "MiniMax-M2 families")
    if raw.get("quantization_config") is not None and not is_fp8_block(raw):
        raise LogprobeError("load_format", "dummy: random weights are float or FP8 blocks (quant_method 'fp8'), "
                            f"not {(raw['quantization_config'] or {}).get('quant_method')!r}",
                            "remove quantization_config (bf16) or give an FP8 block one")


def name_seed(seed: int, name: str) -> int:
    """A 32-bit seed of (seed, tensor name), the same in every process (not Python's ``hash``)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest(), "little")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (multipliers < 2^27: no int64 overflow)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M
    return (x >> 16) ^ x


def uniform(rows: torch.Tensor, cols: int, seed: int) -> torch.Tensor:
    """float32 [len(rows), cols] in [-1, 1): element (i, j) a hash of (seed, rows[i], j) alone, so
    any cut of the rows gets the same values as the whole.

    >>> a = uniform(torch.arange(6), 5, 7); b = uniform(torch.tensor([4, 1]), 5, 7)
    >>> torch.equal(a[[4, 1]], b), bool(a.abs().max() <= 1)
    (True, True)
    """
    hr = _mix((rows.long() ^ (seed & 0xFFFF0000)) & _M)[:, None]  # [R, 1]
    hc = _mix((torch.arange(cols, device=rows.device) ^ ((seed & 0xFFFF) << 16)) & _M)[None, :]  # [1, C]
    return _mix(hr ^ hc).float() * (2.0 / 2 ** 32) - 1.0


def fill(out: torch.Tensor, rows: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """``out`` [n, cols] (any float dtype, FP8 included) = ``scale`` * uniform(rows, cols, seed),
    made in pieces of ``_CHUNK`` elements."""
    step = max(1, _CHUNK // max(out.shape[1], 1))
    for a in range(0, out.shape[0], step):
        out[a:a + step] = (uniform(rows[a:a + step], out.shape[1], seed) * scale).to(out.dtype)
    return out


def _held(cut, shape: tuple[int, ...], device) -> torch.Tensor:
    """The rows of the whole tensor of ``shape`` a rank holds, as ``cut`` (``rank_cut``) takes them:
    [n] row ids of a 1-D or 2-D tensor, [e, n] ids ``expert * out + row`` of a 3-D one."""
    lead = shape[:-1] if len(shape) > 1 else shape
    ids = torch.arange(math.prod(lead), device=device).view(*lead, 1)
    held = ids if cut is None else cut(ids)
    return held[..., 0] if len(shape) > 1 else held.reshape(-1)


@dataclass(slots=True)
class _Maker:
    seed: int
    skew: float
    scheme: FP8BlockScheme | None
    load: Load

    def plain(self, name: str, shape: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
        """A float tensor (float32: the builder casts it, the router kept float32 where the family does)."""
        dev = self.load.device
        if len(shape) == 1:
            if name.endswith("norm.weight"):
                return 1.0 + fill(torch.empty(len(rows), 1, device=dev), rows, name_seed(self.seed, name), 0.1)[:, 0]
            return torch.zeros(len(rows), device=dev)
        flat = rows.reshape(-1)
        std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(shape[-1])
        out = fill(torch.empty(len(flat), shape[-1], device=dev), flat, name_seed(self.seed, name), std * math.sqrt(3))
        if self.skew and _is_router(name):
            hot = max(1, shape[0] // 16)
            out[flat < hot] *= 1 + self.skew
        return out.view(*rows.shape, shape[-1])

    def fp8(self, name: str, shape: tuple[int, ...], rows: torch.Tensor):
        """The FP8 layer a checkpoint's rank would hold: codes of its rows, each row with its block row's
        scales (``fp8_layer`` with the rank's ``RankPart``; experts as ``FP8BlockExperts``)."""
        (bh, bw), dev = self.scheme.block, self.load.device
        out, cols = shape[-2], shape[-1]
        groups, blocks = -(-cols // bw), -(-out // bh)
        std = 1.0 / math.sqrt(cols)
        flat = rows.reshape(-1)
        codes = fill(torch.empty(len(flat), cols, device=dev, dtype=FP8), flat, name_seed(self.seed, name), 448.0)
        sseed = name_seed(self.seed, name + "_scale_inv")
        if len(shape) == 2:
            lo, hi = int(flat.min()) // bh, int(flat.max()) // bh + 1
            scale_inv = self._scales(torch.arange(lo, hi, device=dev), groups, sseed, std)
            part = RankPart(flat, (out, cols), lo, (blocks, groups))
            return fp8_layer(name.removesuffix(".weight"), codes, scale_inv, self.scheme, part)
        if self.scheme.quantize_activations:
            raise LogprobeError("quantize_activations", "FP8 experts with quantized activations are not run",
                                "leave quantize_activations off")
        block_ids = (flat // out) * blocks + (flat % out) // bh  # each row's (expert, block row)
        scale = self._scales(block_ids, groups, sseed, std)  # [rows, G]: each row its block row's
        return FP8BlockExperts(codes.view(*rows.shape, cols), scale.view(*rows.shape, groups), bw, bh)

    def fp8_halves(self, name: str, shape: tuple[int, ...], expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Matrix ``name`` (expert ``expert`` of a stack) as its checkpoint stores it: e4m3 codes
        [out, in] and ``weight_scale_inv`` [ceil(out/bh), G], the values ``fp8`` makes for its rows."""
        (bh, bw), dev = self.scheme.block, self.load.device
        out, cols = shape[-2], shape[-1]
        groups, blocks = -(-cols // bw), -(-out // bh)
        std = 1.0 / math.sqrt(cols)
        first = 0 if expert is None else expert
        rows = torch.arange(out, device=dev) + first * out
        codes = fill(torch.empty(out, cols, device=dev, dtype=FP8), rows, name_seed(self.seed, name), 448.0)
        block_ids = torch.arange(blocks, device=dev) + first * blocks
        return codes, self._scales(block_ids, groups, name_seed(self.seed, name + "_scale_inv"), std)

    def _scales(self, block_rows: torch.Tensor, groups: int, seed: int, std: float) -> torch.Tensor:
        wobble = fill(torch.empty(len(block_rows), groups, device=self.load.device), block_rows, seed, 0.25)
        return (1.0 + wobble) * (std * math.sqrt(3) / 448.0)


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))


def _fp8_name(name: str, shape: tuple[int, ...], model, scheme: FP8BlockScheme | None) -> bool:
    """Whether a checkpoint of ``scheme`` stores tensor ``name`` as FP8: the weights of a block's
    projections and experts (not its router, norms, embeddings or lm_head, nor modules the scheme
    keeps float)."""
    if scheme is None or not name.startswith("layers.") or not name.endswith(("_proj", "_proj.weight", "_mqa.weight")):
        return False
    owner = model.get_submodule(name.rpartition(".")[0])
    if len(shape) == 3:
        return isinstance(owner, Experts)
    return len(shape) == 2 and not kept_float("model." + name.removesuffix(".weight"), scheme.not_convert)


def held_fp8_random(family: Family, cfg, raw: dict) -> dict[str, tuple[int, int]]:
    """``fp8_block.held_fp8`` of a model made at random: the native weights it makes FP8 (``_fp8_name``)
    -> the scheme's block; an expert stack by its name."""
    scheme = fp8_scheme(raw["quantization_config"])
    with torch.device("meta"):
        whole = family.build_meta(cfg)
    return {name: scheme.block for name, t in whole.state_dict().items()
            if _fp8_name(name, tuple(t.shape), whole, scheme)}


def random_checkpoint(family: Family, cfg, raw: dict, weights: RandomWeights, device, dtype: torch.dtype,
                      hf_name) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of the model ``load_format=weights`` makes, one whole tensor at a time, as a
    trainer sends its weights: (``hf_name(native unit name)``, tensor) in the checkpoint's layout,
    experts one by one, FP8 weights as their two halves (e4m3 codes, ``weight_scale_inv`` per block),
    float ones in ``dtype`` (routers float32, as the families hold them). A model made at random with
    seed A and updated with these tensors of seed B scores as one made with seed B, bit for bit: a
    weight sync of a model larger than any disk, checked. ``hf_name``: e.g. the update's
    ``sent_names`` (``layers.1.mlp.experts.gate_proj.3`` -> ``model.layers.1.mlp.experts.3.gate_proj.weight``)."""
    scheme = fp8_scheme(raw["quantization_config"]) if is_fp8_block(raw) else None
    with torch.device("meta"):
        whole = family.build_meta(cfg)
    make = _Maker(weights.seed, weights.skew, scheme, Load(torch.device(device), torch.float32))
    for name, t in whole.state_dict().items():
        shape = tuple(t.shape)
        units = [(f"{name.removesuffix('.weight')}.{e}", e) for e in range(shape[0])] if len(shape) == 3 \
            else [(name, None)]
        for unit, e in units:
            if _fp8_name(name, shape, whole, scheme):
                codes, scale_inv = make.fp8_halves(name, shape, e)
                sent = hf_name(unit)
                yield sent, codes
                yield sent.removesuffix(".weight") + ".weight_scale_inv", scale_inv
                continue
            rows = torch.arange(shape[-2] if len(shape) > 1 else shape[0], device=device)
            value = make.plain(name, shape, rows if e is None else rows + e * shape[-2])
            yield hf_name(unit), value if _is_router(name) else value.to(dtype)


def random_tensors(family: Family, cfg, raw: dict, ctx: ParallelContext | None, load: Load, weights: RandomWeights):
    """(native name, tensor or FP8 layer) of every tensor rank ``ctx`` holds (None: one rank, the
    whole model), made on ``load.device``: what ``family.build`` takes from a checkpoint's reader."""
    with torch.device("meta"):  # shapes and cuts only: no bytes
        whole = family.build_meta(cfg)
        rank = family.build_meta(cfg, ctx) if ctx is not None else whole
    scheme = fp8_scheme(raw["quantization_config"], load.quantize_activations) if is_fp8_block(raw) else None
    make = _Maker(weights.seed, weights.skew, scheme, load)
    shapes = {k: tuple(v.shape) for k, v in whole.state_dict().items()}
    for name, t in rank.state_dict().items():
        if not t.dtype.is_floating_point:
            raise LogprobeError("load_format", f"dummy: {name} is {t.dtype}, which random weights do not fill")
        cut = None if ctx is None else rank_cut(rank, name)
        if cut is SKIP:
            continue
        rows = _held(cut, shapes[name], load.device)
        if tuple(rows.shape) != tuple(t.shape[:-1] if t.dim() > 1 else t.shape):
            raise LogprobeError("model", f"dummy: {name}: the rank's cut {tuple(rows.shape)} does not match its "
                                f"tensor {tuple(t.shape)}")
        if _fp8_name(name, shapes[name], whole, scheme):
            yield name, make.fp8(name, shapes[name], rows)
        else:
            yield name, make.plain(name, shapes[name], rows)

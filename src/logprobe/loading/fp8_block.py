"""FP8 block-quantized checkpoints as DeepSeek-V3 / V3.1, Kimi K2, GLM-4.5-FP8, MiniMax-M2 and
Qwen3-FP8 ship them (``quantization_config.quant_method: "fp8"``, transformers' ``FineGrainedFP8Config``):

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

Each quantized Linear ``<m>`` stores ``<m>.weight`` float8_e4m3fn [out, in] and
``<m>.weight_scale_inv`` float32 [ceil(out/bh), ceil(in/bw)]; the weight is
``float32(code) * scale_inv`` of its block (``layers.fp8_block_linear``; the last blocks of a width
that is not a multiple of the block are partial, as transformers' and vLLM's dequantization read
them). Which modules are quantized is what the checkpoint stores: a float8 weight with its
``weight_scale_inv``; everything else is a plain float tensor (embeddings, norms, routers, lm_head).
``modules_to_not_convert`` (MiniMax's alias ``ignored_layers``), matched as transformers matches it
(a prefix ending at a module boundary, a regex with the same boundary, or a suffix), must name
only float modules: an FP8 tensor there is refused (transformers would load its codes without
their scale).

What is computed. By default the weights stay FP8 in memory and are expanded to the model dtype
one layer at a time inside each matmul, with float activations (W8A16): the model is then exactly
the one whose weights are the dequantized FP8 weights (DeepSeek's ``fp8_cast_bf16.py`` gives the
same bf16 weights), and that is what tests score against a float64 forward. DeepSeek's own
inference, vLLM and transformers' FP8 kernels also round each Linear's input to FP8 per token and
group of ``bw`` columns (``activation_scheme: "dynamic"``); ``quantize_activations=True`` runs that
too (``layers.act_quant_linear.ActQuantLinear``, FP8 GEMMs on CUDA), whose reference is the
format's fake-quantization: scale = group absmax / 448 (compressed-tensors' rule; DeepSeek-V3's
kernel divides the same way), codes rounded to e4m3. It needs input widths that are multiples of
``bw`` and dense (non-expert) matrices; experts with quantized activations are refused.

Under tensor and expert parallelism (``cut``: ``loading.sharding.rank_cut``) a rank reads its rows
of each FP8 weight and the block rows of its scales those rows fall in (``fp8_rows``,
``scale_rows``), other ranks' experts not at all; every split is by whole rows, and each row keeps
its block row's scales, so a rank's range may start or end inside a block exactly.

Refused, with the key named: ``activation_scheme`` "static", ``fmt`` other than "e4m3", keys this
reader does not know, ``modules_to_convert`` (quantized embeddings), ``expert_dtype`` other than
"fp8", ``scale_fmt`` "ue8m0" with quantized activations (power-of-two activation scales: not run),
non-float scales, a float8 weight without its scale or a scale without its weight, and
``input_scale`` / ``weight_scale`` tensors (another layout).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.act_quant_linear import ActQuantLinear
from ..layers.fp8_block_linear import FP8, FP8BlockLinear, block_rows
from ..layers.moe import ExpertMatrices
from ..layers.quant_linear import PackedWeight
from .checkpoint import _EXPERT, SKIP, check_plain_dtype, open_files, safetensors_files

_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers",
         "scale_fmt", "dequantize", "modules_to_convert", "expert_dtype"}
_OTHER_LAYOUTS = ("input_scale", "weight_scale", "activation_scale", "input_scale_inv")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True, frozen=True)
class FP8BlockScheme:
    """A checked ``quantization_config``: block (rows, cols), module patterns kept float, scale format,
    and whether activations are quantized (the caller's choice, not the config's)."""

    block: tuple[int, int]
    not_convert: tuple[str, ...]
    scale_fmt: str
    quantize_activations: bool


def is_fp8_block(raw: dict) -> bool:
    q = raw.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def _refuse(problem: str, fix: str = "give an FP8 block checkpoint as DeepSeek ships it (fmt e4m3, dynamic "
            "activations, weight_block_size [128, 128]) or a bf16 checkpoint") -> None:
    raise LogprobeError("quantization_config", problem, fix)


def fp8_scheme(qcfg: dict, quantize_activations: bool = False) -> FP8BlockScheme:
    """Check a ``quant_method: "fp8"`` config; refuse (naming the key) anything not run exactly.

    >>> fp8_scheme({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    ...             "weight_block_size": [128, 128]}).block
    (128, 128)
    """
    unknown = sorted(set(qcfg) - _KEYS)
    if unknown:
        _refuse(f"keys {unknown} are not known to logprobe's FP8 block reader, which cannot tell whether they "
                "change the model's function")
    if qcfg.get("fmt", "e4m3") != "e4m3":
        _refuse(f"fmt {qcfg['fmt']!r}: only e4m3 weights are read")
    if str(qcfg.get("activation_scheme", "dynamic")).lower() != "dynamic":
        _refuse(f"activation_scheme {qcfg['activation_scheme']!r}: static activation scales are not run",
                "logprobe runs the dynamic scheme (the released DeepSeek / Qwen3 FP8 checkpoints)")
    block = qcfg.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        _refuse(f"weight_block_size {block!r} is not two positive integers (per-tensor FP8 is not this format)")
    if qcfg.get("modules_to_convert"):
        _refuse(f"modules_to_convert {qcfg['modules_to_convert']!r} quantizes embeddings, which is not run")
    if qcfg.get("expert_dtype", "fp8") != "fp8":
        _refuse(f"expert_dtype {qcfg['expert_dtype']!r}: only FP8 experts are read")
    scale_fmt = qcfg.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        _refuse(f"scale_fmt {scale_fmt!r} is not float or ue8m0")
    if scale_fmt == "ue8m0" and quantize_activations:
        _refuse("scale_fmt 'ue8m0' rounds activation scales to powers of two, which is not run",
                "score with float activations (quantize_activations=False: the dequantized-weight model)")
    skip = qcfg.get("modules_to_not_convert") or qcfg.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        _refuse(f"modules_to_not_convert {skip!r} is not a list of module names")
    return FP8BlockScheme((int(block[0]), int(block[1])), tuple(skip), scale_fmt, bool(quantize_activations))


def kept_float(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``modules_to_not_convert`` names ``module``, as transformers matches it: a prefix or
    regex ending at a module boundary, or a suffix.

    >>> kept_float("model.layers.1.mlp.gate", ("mlp.gate",)), kept_float("model.layers.1.mlp.gate_proj", ("mlp.gate",))
    (True, False)
    """
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def fp8_layer(module: str, codes: torch.Tensor, scale_inv: torch.Tensor, scheme: FP8BlockScheme,
              part: RankPart | None = None):
    """One module's ``weight`` and ``weight_scale_inv`` -> ``FP8BlockLinear`` (float activations) or
    ``ActQuantLinear`` (FP8 activations per token and group of ``bw``); shapes checked. ``part``:
    a tensor-parallel rank's rows (``codes`` and ``scale_inv`` its parts, ``fp8_block_tensors``'
    ``cut``); each row takes the scales of its block row, so a rank's range may start or end
    inside a block and stay exact."""
    if codes.ndim != 2:
        _refuse(f"{module}.weight {tuple(codes.shape)} is not a 2-D matrix")
    if scale_inv.dtype not in _SCALE_DTYPES:
        _refuse(f"{module}.weight_scale_inv is {str(scale_inv.dtype).removeprefix('torch.')}, not a float scale")
    (bh, bw), (out, cols) = scheme.block, part.shape if part else codes.shape
    want = (-(-out // bh), -(-cols // bw))
    if (part.scale_shape if part else tuple(scale_inv.shape)) != want:
        _refuse(f"{module}.weight_scale_inv {part.scale_shape if part else tuple(scale_inv.shape)} is not one "
                f"scale per {bh}x{bw} block of a [{out}, {cols}] weight {want}")
    # [rows held, G]: each weight row's block-row scales
    rows = block_rows(scale_inv, bh, out) if part is None else \
        scale_inv.float()[part.rows // bh - part.first_block].contiguous()
    if not scheme.quantize_activations:
        return FP8BlockLinear(codes.contiguous(), rows, bw, block_height=bh)
    if cols % bw:
        _refuse(f"{module}: input width {cols} is not a multiple of the activation group {bw}",
                "score with float activations (the default)")
    return ActQuantLinear(codes.contiguous(), rows, bw, "float", None, bw)


def fp8_block_tensors(path: Path, scheme: FP8BlockScheme, param_name: Callable[[str, str], str | None], log,
                      cut=None) -> Iterator[tuple[str, object]]:
    """(native name, tensor or FP8 layer) of every tensor of ``path`` that ``param_name(key, file)``
    maps (None: skipped, e.g. multi-token-prediction layers). A module's FP8 layer is yielded under
    its ``.weight`` name once its codes and scale are both read (they may sit in different shards).
    ``cut(name)``: a tensor-parallel rank's reading (``loading.sharding.rank_cut``; the scale is cut
    as its weight, ``fp8_rows``)."""

    codes: dict[str, tuple[object, str]] = {}
    scales: dict[str, tuple[torch.Tensor, str]] = {}
    skipped: set[int] = set()
    for f, st in open_files(path, prefetch=cut is None):
        for key in st.keys():
            module, _, leaf = key.rpartition(".")
            name = param_name(module + ".weight" if leaf == "weight_scale_inv" else key, f.name)
            if name is None:
                m = _LAYER_KEY.match(key)
                if m is not None:
                    skipped.add(int(m.group(1)))
                continue
            if leaf in _OTHER_LAYOUTS:
                _refuse(f"{key} in {f.name}: {leaf} belongs to another FP8 layout (static or per-tensor scales), "
                        "not DeepSeek's block scales (weight_scale_inv)")
            how = None if cut is None else cut(name)
            if how is SKIP:  # another rank's expert: not read
                continue
            coded = leaf == "weight" and st.get_slice(key).get_dtype() == "F8_E4M3"
            value = st.get_tensor(key) if how is None else fp8_rows(st, key, how, scheme) if coded else \
                scale_rows(st, key, how, scheme) if leaf == "weight_scale_inv" else how(st.get_slice(key))
            if leaf == "weight_scale_inv" or coded or (leaf == "weight" and value.dtype == FP8):
                if kept_float(module, scheme.not_convert):
                    _refuse(f"{key} in {f.name} is FP8 data, but modules_to_not_convert names {module}: "
                            "transformers would read its codes without their scale")
                (scales if leaf == "weight_scale_inv" else codes)[module] = (value, f.name)
                if module in codes and module in scales:
                    layer = _paired(module, codes.pop(module)[0], scales.pop(module)[0], scheme)
                    yield name if leaf == "weight" else param_name(module + ".weight", f.name), layer
                continue
            check_plain_dtype(key, value, f.name)
            yield name, value
    for module, (_, where) in codes.items():
        _refuse(f"{module}.weight in {where} is float8 but {module}.weight_scale_inv is missing")
    for module, (_, where) in scales.items():
        _refuse(f"{module}.weight_scale_inv in {where} has no float8 {module}.weight beside it")
    if skipped:
        log.warning("%s: skipped multi-token-prediction layer%s %s (not used to score text)", path.name,
                    "s" * (len(skipped) > 1), ", ".join(map(str, sorted(skipped))))


@dataclass(slots=True, frozen=True)
class RankPart:
    """What a tensor-parallel rank read of one FP8 weight: ``rows`` [n], the indices of its rows in
    the whole ``shape`` weight (in the order held); of the scales, block rows from ``first_block``
    of the whole ``scale_shape`` ones."""

    rows: torch.Tensor
    shape: tuple[int, int]
    first_block: int
    scale_shape: tuple[int, ...]


def _held_rows(how, n: int) -> torch.Tensor:
    """The rows, in order, that cut ``how`` (``loading.sharding.rank_cut``) takes of a tensor of ``n`` rows."""
    return how(torch.arange(n)[:, None])[:, 0]  # [n, 1] indices cut as the tensor is


def fp8_rows(st, key: str, how, scheme: FP8BlockScheme) -> tuple[torch.Tensor, RankPart]:
    """A rank's part of FP8 weight ``key`` of an open safetensors file: its codes [n, in], read
    alone, and where they sit (``RankPart``, scale fields filled by ``scale_rows``). ``how``: the
    rank's cut, which takes whole rows; a cut that is not whole rows of the weight is refused
    (its column blocks would need scales of their own)."""
    part = st.get_slice(key)
    shape = tuple(int(n) for n in part.get_shape())
    if len(shape) != 2:
        _refuse(f"{key} {shape} is not a 2-D matrix")
    codes, rows = how(part), _held_rows(how, shape[0])
    if codes.ndim != 2 or codes.shape[1] != shape[1] or rows.shape != (codes.shape[0],):
        _refuse(f"{key}: this rank's part {tuple(codes.shape)} of the [{shape[0]}, {shape[1]}] FP8 weight is not "
                f"whole rows of it, so its {scheme.block[1]}-column scale blocks would be cut",
                "use a tensor_parallel_size whose split keeps whole rows (or the bf16 checkpoint)")
    return codes, RankPart(rows, shape, 0, ())


def scale_rows(st, key: str, how, scheme: FP8BlockScheme) -> tuple[torch.Tensor, RankPart]:
    """A rank's block rows of ``weight_scale_inv`` ``key``: those its weight rows (cut ``how``)
    fall in, first to last (read alone), and the whole scale's shape."""
    part = st.get_slice(key)
    shape = tuple(int(n) for n in part.get_shape())
    if len(shape) != 2 or shape[0] == 0:
        return part[:], RankPart(torch.zeros(0, dtype=torch.long), (0, 0), 0, shape)  # refused by fp8_layer
    blocks = _held_rows(how, shape[0] * scheme.block[0]) // scheme.block[0]  # block row of each held row
    lo, hi = int(blocks.min()), int(blocks.max()) + 1
    return part[lo:hi], RankPart(blocks, (0, 0), lo, shape)


def _paired(module: str, codes, scale_inv, scheme: FP8BlockScheme):
    """``fp8_layer`` of whole codes and scales, or of a rank's parts (``fp8_rows``, ``scale_rows``)."""
    if isinstance(codes, tuple):
        (codes, rows), (scale_inv, blocks) = codes, scale_inv
        part = RankPart(rows.rows, rows.shape, blocks.first_block, blocks.scale_shape)
        return fp8_layer(module, codes, scale_inv, scheme, part)
    return fp8_layer(module, codes, scale_inv, scheme)


def held_fp8(path: Path, raw: dict, cfg, param_name) -> dict[str, tuple[int, int]]:
    """The native weights an FP8 block checkpoint holds FP8 -> its block (rows, cols), from the
    safetensors headers (no tensor read): each ``<m>.weight_scale_inv``'s weight by the family's
    ``param_name(key, cfg, file)``, an expert's as its stack (``layers.N.mlp.experts.gate_proj``).
    What a parallel scorer's driver, which holds no weights, checks a weight update against."""
    from safetensors import safe_open

    block = fp8_scheme(raw["quantization_config"]).block
    out = {}
    for f in safetensors_files(path):  # (a directory without weights: ``dummy.held_fp8_random``)
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if not key.endswith(".weight_scale_inv"):
                    continue
                name = param_name(key.removesuffix("_scale_inv"), cfg, f.name)
                if name is not None:
                    m = _EXPERT.fullmatch(name)
                    out[f"{m.group(1)}.{m.group(3)}" if m else name] = block
    return out


def dense_fp8(w):
    """``weights="dense"``: an FP8 weight-only layer -> its float32 dequantized weight (the same bits
    once cast to the model dtype); an activation-quantized one keeps its rounding, weight expanded."""
    if isinstance(w, FP8BlockLinear):
        return w.rows()
    return w.expand() if isinstance(w, ActQuantLinear) else w


# -- installing packed layers into a model built on the meta device ---------------------------------


def split_packed(tensors, device: torch.device, dtype: torch.dtype, fp32: tuple[str, ...] = ()
                 ) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight], dict[str, ExpertMatrices]]:
    """(name, tensor or packed layer) pairs -> (plain state in ``dtype`` (names ending in ``fp32``:
    float32), packed Linear layers, packed expert matrices), all on ``device``."""
    state, packed, experts = {}, {}, {}
    for name, w in tensors:
        if isinstance(w, ExpertMatrices):
            w.compute_dtype = dtype
            experts[name] = w.to(device)
        elif isinstance(w, PackedWeight):
            w.compute_dtype = dtype
            packed[name] = w.to(device)
        else:
            state[name] = w.to(device=device, dtype=torch.float32 if name.endswith(fp32) else dtype)
    return state, packed, experts


def with_shapes(state: dict, packed: dict, experts: dict) -> dict:
    """``state`` plus a meta tensor of each packed matrix's shape (for ``check_weights_match``)."""
    shapes = {n: torch.empty(w.out_features, w.in_features, device="meta") for n, w in packed.items()}
    shapes |= {n: torch.empty(tuple(w.shape), device="meta") for n, w in experts.items()}
    return {**state, **shapes}


def install_packed(model: torch.nn.Module, state: dict, packed: dict, experts: dict, interleave) -> None:
    """Put packed layers in place of the Linear modules they replace (their bias moved out of
    ``state`` into them; rows permuted as ``interleave(state)`` permutes a float weight's rows) and
    packed experts in place of their parameters."""
    for name, w in packed.items():
        bias = state.pop(name.removesuffix(".weight") + ".bias", None)
        if bias is not None:
            w.bias = bias
        rows = torch.arange(w.out_features)[:, None]  # [out, 1]: the permutation the float weight would get
        perm = interleave({name: rows})[name][:, 0]
        if not torch.equal(perm, rows[:, 0]):
            w.permute_rows(perm.to(w.device))
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        owner = model.get_submodule(parent)
        w.adopt(getattr(owner, child))
        setattr(owner, child, w)
    for name, w in experts.items():  # layers.N.mlp.experts.gate_proj -> Experts.gate_proj
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).set_packed(child, w)

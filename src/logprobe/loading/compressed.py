"""compressed-tensors checkpoints (what llm-compressor saves): integer weight-only schemes.

config.json carries ``quantization_config`` with ``quant_method: compressed-tensors``, a
``format`` and ``config_groups`` of schemes; each quantized Linear ``<m>`` stores

    pack-quantized:  <m>.weight_packed int32 [out, in*bits/32], <m>.weight_scale [out, G],
                     <m>.weight_shape [2], <m>.weight_zero_point (asymmetric: packed along dim 0)
    naive-quantized: <m>.weight int8 [out, in], <m>.weight_scale [out, G] (+ weight_zero_point)

with G = ceil(in / group_size) for the "group" strategy and 1 for "channel". Supported: int4/int8
weights with float activations (W4A16, W4A16_ASYM, W8A16); activation quantization (W8A8,
FP8, NVFP4) is refused with a clear error.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..models.llama import LlamaConfig

_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
_AUX = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def _scheme_for(module: str, groups: dict) -> dict:
    """The config group whose targets match a module name ("Linear", "re:<regex>" or a name)."""
    for g in groups.values():
        for t in g.get("targets") or []:
            if t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or module.endswith(t):
                return g
    raise LogprobeError("quantization_config", f"no config group targets the quantized module {module!r}")


def _check_scheme(scheme: dict, fmt: str, module: str) -> dict:
    w = scheme.get("weights") or {}
    if scheme.get("input_activations") is not None:
        raise LogprobeError("quantization_config", f"{module} quantizes activations too (e.g. W8A8/FP8), "
                            "which logprobe does not run", "use a weight-only scheme: W4A16, W4A16_ASYM or W8A16")
    if fmt not in _FORMATS or w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
        raise LogprobeError("quantization_config", f"{module}: format {fmt!r} with {w.get('num_bits')}-bit "
                            f"{w.get('type')} weights is not supported",
                            "logprobe reads int4/int8 pack-quantized or int8 naive-quantized weights")
    if w.get("strategy") not in ("group", "channel"):
        raise LogprobeError("quantization_config", f"{module}: strategy {w.get('strategy')!r} is not supported",
                            "use group or channel scales")
    if w.get("actorder") not in (None, "weight", "static"):  # "group" order needs g_idx
        raise LogprobeError("quantization_config", f"{module}: actorder {w.get('actorder')!r} is not supported")
    return w


def ct_layer(module: str, t: dict[str, torch.Tensor], scheme: dict, fmt: str):
    """One module's stored tensors -> a ``CTLinear``."""
    from ..layers.quant_linear import CTLinear, unpack_int32

    w = _check_scheme(scheme, fmt, module)
    bits = int(w["num_bits"])
    scale = t["weight_scale"]
    if fmt == "pack-quantized":
        qweight = t["weight_packed"]
        out, cols = (int(x) for x in t["weight_shape"].tolist())
    else:
        qweight = t["weight"].to(torch.int8)
        out, cols = qweight.shape
    if scale.ndim == 1:
        scale = scale[:, None]  # [out] -> [out, 1]
    group = int(w["group_size"]) if w["strategy"] == "group" else cols
    zp = None
    if not w.get("symmetric", True):
        zp = t.get("weight_zero_point")
        if zp is None:
            raise LogprobeError("model", f"{module} is asymmetric but has no weight_zero_point")
        if zp.ndim == 1:
            zp = zp[:, None]
        if fmt == "pack-quantized" and zp.dtype == torch.int32:
            zp = unpack_int32(zp.T.contiguous(), bits, out).T  # packed along the output dim
        zp = zp.to(torch.int8).contiguous()  # [out, G]
    return CTLinear(qweight.contiguous(), scale.contiguous(), zp, bits, group, cols)


def ct_tensors(path: Path, cfg: LlamaConfig, qcfg: dict, packed: bool):
    """Yield (parameter name, tensor or CTLinear) for a compressed-tensors checkpoint."""
    from safetensors import safe_open

    from .hf import hf_param_name, safetensors_files

    method = qcfg.get("quant_method")
    if method != "compressed-tensors":
        raise LogprobeError("quantization_config", f"quant_method {method!r} is not supported",
                            "logprobe reads compressed-tensors checkpoints (llm-compressor), GGUF files, "
                            "or unquantized safetensors")
    groups = qcfg.get("config_groups") or {}
    top_format = qcfg.get("format")
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                tensors[key] = st.get_tensor(key)
    quantized = {k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale")}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in quantized:
            if leaf in _AUX or leaf.startswith("input_") or leaf.startswith("output_"):
                continue
            if leaf in ("weight_packed", "weight") and (leaf == "weight_packed" or not value.is_floating_point()):
                scheme = _scheme_for(module, groups)
                layer = ct_layer(module, {k.rpartition(".")[2]: v for k, v in tensors.items()
                                          if k.rpartition(".")[0] == module}, scheme,
                                 scheme.get("format") or top_format)
                name = hf_param_name(module + ".weight", cfg, path.name)
                if name is not None:
                    yield name, (layer if packed else layer.dense())
                continue
            # a float weight beside its scales: already dequantized ("frozen"), load it as it is
        name = hf_param_name(key, cfg, path.name)
        if name is not None:
            yield name, value

"""NVFP4 / NVFP4A16 checkpoints written by the compressed-tensors package, and their float64 reference.

As llm-compressor's round-to-nearest ``QuantizationModifier`` makes them, with the package's own API:
apply the preset scheme to every Linear but lm_head; each weight's global scale from its min/max
(``generate_gparam``), its FP8 group scales from each 16-column group's min/max (``calculate_qparams``
with that global scale); for NVFP4, each Linear's static ``input_global_scale`` from the min/max of
its inputs over a few calibration sequences (``generate_gparam``, the preset's static_minmax observer);
then ``ModelCompressor`` packs (``nvfp4-pack-quantized``) and saves. The loader under test never calls
this package.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch


def _weight_qparams(m) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = m.quantization_scheme.weights
    w = m.weight.detach()
    out, cols = w.shape
    gs = generate_gparam(w.amin(), w.amax())  # [1] float32
    m.weight_global_scale.data = gs.to(m.weight_global_scale.dtype).reshape(m.weight_global_scale.shape)
    grouped = w.view(out, cols // args.group_size, args.group_size)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=gs)
    m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)


def _input_global_scales(model, calibration: list[list[int]]) -> None:
    from compressed_tensors.quantization.utils import generate_gparam

    stats, hooks = {}, []
    mods = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
            and m.quantization_scheme.input_activations is not None}

    def observe(name):
        def hook(module, args):
            x = args[0].detach()
            lo, hi = stats.get(name, (x.amin(), x.amax()))
            stats[name] = (torch.minimum(lo, x.amin()), torch.maximum(hi, x.amax()))
        return hook

    for name, m in mods.items():
        m.quantization_enabled = False
        hooks.append(m.register_forward_pre_hook(observe(name)))
    with torch.no_grad():
        for ids in calibration:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    for name, m in mods.items():
        m.quantization_enabled = True
        gs = generate_gparam(stats[name][0], stats[name][1])
        m.input_global_scale.data = gs.to(m.input_global_scale.dtype).reshape(m.input_global_scale.shape)


def nvfp4_checkpoint(src: Path, out_dir: Path, scheme: str, calibration: list[list[int]], tokenizer=None) -> Path:
    """Quantize the float Llama at ``src`` with the NVFP4 or NVFP4A16 preset and save it compressed."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from quant_helpers import compress_and_save
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config, show_progress=False)
    for _, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _weight_qparams(m)
    if scheme == "NVFP4":
        _input_global_scales(model, calibration)
    return compress_and_save(model, out_dir, tokenizer)


def _args(d: Path):
    from compressed_tensors.quantization import QuantizationArgs

    (group,) = json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"].values()
    a = group.get("input_activations")
    return QuantizationArgs(**group["weights"]), (None if a is None else QuantizationArgs(**a))


def package_weight(stored: dict, module: str, wargs, dtype=torch.float64) -> torch.Tensor:
    """A module's weight as the package dequantizes it (``unpack_fp4_from_uint8`` + ``dequantize``), in ``dtype``."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = stored[f"{module}.weight_packed"]
    m, n = packed.shape
    q = unpack_fp4_from_uint8(packed, m, 2 * n, dtype=dtype)
    return dequantize(q, stored[f"{module}.weight_scale"].to(dtype), None, wargs, dtype=dtype,
                      global_scale=stored[f"{module}.weight_global_scale"].to(dtype))


def package_quantize(x: torch.Tensor, input_global_scale: torch.Tensor, aargs) -> torch.Tensor:
    """compressed-tensors' ``forward_quantize`` of an input activation (in x's dtype)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    holder = SimpleNamespace(quantization_status=QuantizationStatus.COMPRESSED,
                             input_global_scale=input_global_scale.to(x.dtype))
    return forward_quantize(holder, x, "input", aargs)


def nvfp4_reference(d: Path):
    """The float64 reference of an NVFP4 / NVFP4A16 checkpoint from the package's own functions: weights
    by ``package_weight``; for NVFP4 every quantized Linear's input fake-quantized by ``forward_quantize``
    in float64 in a forward pre-hook. Pinning (``model.act_pins``: HF module name -> the float32 quantized
    input [T, in] the model under test used for its first T tokens): where a 16-column group of the
    reference's activation differs from the pinned one, the group must sit on a rounding tie (its FP8
    scale, or an element's FP4 code, flips under a relative perturbation of 1e-5 of the group's largest
    |x|); the group then takes the pinned values, and ``model.act_flips`` records (module, token, group)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    wargs, aargs = _args(d)
    stored = load_file(str(d / "model.safetensors"))
    state, inputs = {}, {}
    for key, t in stored.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight_packed":
            state[f"{module}.weight"] = package_weight(stored, module, wargs)
            if aargs is not None:
                inputs[module] = stored[f"{module}.input_global_scale"].double()
        elif leaf not in ("weight_scale", "weight_global_scale", "input_global_scale"):
            state[key] = t.double()
    cfg = AutoConfig.from_pretrained(str(d))
    cfg.quantization_config = None
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.act_pins, model.act_flips = {}, []
    for name, gs in inputs.items():
        def hook(module, args, gs=gs, name=name):
            x = args[0]
            xq = package_quantize(x, gs, aargs)
            if name in model.act_pins:
                xq = _pin(model, name, x, xq, gs, aargs)
            return (xq,)
        model.get_submodule(name).register_forward_pre_hook(hook)
    return model


def _ties(x: torch.Tensor, gs: torch.Tensor, aargs, rel: float = 1e-5) -> torch.Tensor:
    """[T, G] bool: whether a 16-column group of float64 x [T, in] sits within ``rel`` (relative to the
    group's largest |x|) of a rounding boundary of its FP8 scale or of one of its FP4 codes: the
    package's own quantization of x pushed up and down by that much differs."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    T, k = x.shape
    amax = x.view(T, k // 16, 16).abs().amax(-1, keepdim=True).expand(T, k // 16, 16).reshape(T, k)  # [T, in]
    holder = SimpleNamespace(quantization_status=QuantizationStatus.COMPRESSED, input_global_scale=gs)
    out = []
    for v in (x + rel * amax * torch.sign(x), x - rel * amax * torch.sign(x)):
        scale, _ = compute_dynamic_scales_and_zp(value=v[None], args=aargs, module=holder, global_scale=gs)
        out.append((scale[0], package_quantize(v[None], gs, aargs)[0]))  # [T, G], [T, in]
    (s_up, q_up), (s_down, q_down) = out
    code_flip = ((q_up - q_down).abs() > 1e-3 * amax).view(T, k // 16, 16).any(-1)
    return (s_up != s_down) | code_flip


def _pin(model, name, x, xq, gs, aargs):
    pinned = model.act_pins[name].double()  # [T, in]
    T, k = pinned.shape
    x0, q0 = x[0, :T], xq[0, :T]
    differs = ((pinned - q0).abs() > 1e-4 * (pinned.abs() + q0.abs()).clamp(min=1e-30)).view(T, k // 16, 16).any(-1)
    if not bool(differs.any()):
        return xq
    tie = _ties(x0, gs, aargs)
    assert bool(tie[differs].all()), (name, differs.nonzero().tolist(), tie.nonzero().tolist())
    out = xq.clone()
    mask = differs.repeat_interleave(16, -1)  # [T, in]
    out[0, :T][mask] = pinned[mask]
    for t, g in differs.nonzero().tolist():
        model.act_flips.append((name, t, g))
    return out

"""Quantized checkpoints for the tests, written by the real ``compressed-tensors`` package.

llm-compressor itself pins an older transformers than ours, so the checkpoints are made the way
its round-to-nearest ``QuantizationModifier`` makes them, with compressed-tensors' own API:
apply the preset scheme (W4A16 = int4 symmetric group 128, W4A16_ASYM, W8A16 = int8 per
channel) to every Linear but lm_head, set min/max scales (``calculate_qparams``), compress with
``ModelCompressor`` (pack-quantized) and save. The loader under test never calls this package.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _minmax_qparams(module, args):
    """Round-to-nearest scales from the weight's own min/max, per group or channel (observer: minmax)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.detach()
    out, cols = w.shape
    if args.strategy in ("tensor", "block"):  # one scale per tensor / per block (minmax over it)
        bh, bw = args.block_structure if args.strategy == "block" else (out, cols)
        R, C = -(-out // bh), -(-cols // bw)
        blocks = torch.nn.functional.pad(w, (0, C * bw - cols, 0, R * bh - out)).view(R, bh, C, bw)
        return calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), args)  # [R, C]
    g = args.group_size if args.strategy == "group" else cols
    G = -(-cols // g)
    padded = torch.nn.functional.pad(w, (0, G * g - cols))  # [out, G*g]
    grouped = padded.view(out, G, g)
    # a partial last group must not see the zero padding
    valid = torch.nn.functional.pad(torch.ones(cols, dtype=torch.bool, device=w.device), (0, G * g - cols)).view(G, g)
    big = torch.finfo(w.dtype).max
    mins = torch.where(valid, grouped, big).amin(-1)  # [out, G]
    maxs = torch.where(valid, grouped, -big).amax(-1)
    return calculate_qparams(mins, maxs, args)


def tiny_wide_llama(path: Path, seed: int = 0):
    """A tiny random Llama whose Linear inputs (128, 256) hold whole groups of 128 (compressed-tensors
    refuses a group size that does not divide the input width); saved with the byte tokenizer."""
    from helpers import byte_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 128, 256, 32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    return path


def _calibrate_inputs(model, calibration: list[list[int]]) -> None:
    """Static input scales (the FP8 preset's ``static_minmax`` observer): min/max of each quantized
    Linear's input over the calibration sequences, run with quantization off, then ``calculate_qparams``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    stats, hooks = {}, []

    def observe(name):
        def hook(module, args):
            x = args[0].detach()
            lo, hi = stats.get(name, (x.amin(), x.amax()))
            stats[name] = (torch.minimum(lo, x.amin()), torch.maximum(hi, x.amax()))
        return hook

    mods = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
            and m.quantization_scheme.input_activations is not None
            and not m.quantization_scheme.input_activations.dynamic}
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
        scale, _ = calculate_qparams(stats[name][0].reshape(1), stats[name][1].reshape(1),
                                     m.quantization_scheme.input_activations)
        m.input_scale.data = scale.to(m.input_scale.dtype).reshape(m.input_scale.shape)


def quantize_and_save(model, out_dir: Path, scheme: str = "W4A16", tokenizer=None,
                      group_size: int | None = None, calibration: list[list[int]] | None = None) -> Path:
    """Quantize ``model`` (a transformers causal LM, modified in place) and save it compressed.
    ``group_size`` overrides the preset's (128) for grouped schemes. Activation-quantized presets
    (FP8_DYNAMIC, W8A8, FP8_BLOCK) need nothing more; static ones (FP8) get their ``input_scale``
    from running ``calibration`` (lists of token ids)."""
    quantize_in_place(model, scheme, group_size)
    if calibration is not None:
        _calibrate_inputs(model, calibration)
    return compress_and_save(model, out_dir, tokenizer)


def compress_and_save(model, out_dir: Path, tokenizer=None) -> Path:
    """compressed-tensors' ``ModelCompressor`` on a quantized ``model``, saved with its config."""
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out_dir))
    compressor.update_config(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


def quantize_in_place(model, scheme: str = "W4A16", group_size: int | None = None) -> None:
    """compressed-tensors' ``apply_quantization_config`` of a preset on every ``Linear`` of
    ``model`` (``lm_head`` ignored), with round-to-nearest min/max scales (``_minmax_qparams``).
    ``W8A16_CHANNEL`` and the like: the preset with per-channel scales."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    channel = scheme.endswith("_CHANNEL")
    qscheme = preset_name_to_scheme(scheme.removesuffix("_CHANNEL"), ["Linear"])
    if channel:
        qscheme.weights.strategy, qscheme.weights.group_size = "channel", None
    if group_size is not None and qscheme.weights.strategy == "group":
        qscheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config, show_progress=False)
    for _, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is not None:
            scale, zp = _minmax_qparams(m, m.quantization_scheme.weights)
            m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data = zp.to(m.weight_zero_point.dtype).reshape(m.weight_zero_point.shape)


def decompressed_state(out_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as the compressed-tensors package dequantizes them (HF names)."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    del ModelCompressor
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def act_quant_reference(out_dir: Path, dtype: torch.dtype = torch.float64, quantize_dtype: torch.dtype | None = None):
    """The float64 reference of an activation-quantized compressed-tensors checkpoint, built from the
    package's own functions: weights dequantized by ``dequantize``, and every quantized Linear's
    input fake-quantized by ``forward_quantize`` (dynamic scales from ``compute_dynamic_scales_and_zp``,
    static ones from the stored ``input_scale``) in a forward pre-hook; then the transformers model in
    ``dtype`` (float64). ``quantize_dtype``: the dtype the activations are quantized in (default
    ``dtype``). Returns the model (hooks attached).

    Pinning (``model.act_pins``: HF module name -> the float32 quantized input [T, in] that the model
    under test used for the first T tokens): quantization is discontinuous, so where the exact value
    x / scale lies within float32 noise of a rounding boundary, a float64 and a float32 evaluation
    round it to adjacent codes (and the difference then spreads to later layers). Where the pinned
    value is another code than the package's float64 one, the hook checks that the two codes are
    adjacent and records how far x / scale lies from the boundary between them (``model.act_flips``:
    (module, token, column, distance relative to the row's largest |x / scale|)), then uses the pinned code times the float64 scale.
    Everywhere else the package's own float64 result is used."""
    import json
    from types import SimpleNamespace

    from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import dequantize, forward_quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    qcfg = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    wargs, aargs = QuantizationArgs(**group["weights"]), QuantizationArgs(**group["input_activations"])
    stored = load_file(str(out_dir / "model.safetensors"))
    state, inputs = {}, {}
    for key, t in stored.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and f"{module}.weight_scale" in stored:
            scale = stored[f"{module}.weight_scale"].double()
            state[key] = dequantize(t, scale, None, wargs, dtype=torch.float64).to(dtype)
            inputs[module] = SimpleNamespace(quantization_status=QuantizationStatus.COMPRESSED,
                                             input_scale=stored.get(f"{module}.input_scale"), input_zero_point=None)
            if inputs[module].input_scale is not None:
                inputs[module].input_scale = inputs[module].input_scale.to(quantize_dtype or dtype)
        elif leaf not in ("weight_scale", "input_scale", "weight_zero_point", "input_zero_point"):
            state[key] = t.to(dtype)
    cfg = AutoConfig.from_pretrained(str(out_dir))
    cfg.quantization_config = None
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.act_pins, model.act_flips = {}, []
    for name, holder in inputs.items():
        def hook(module, args, holder=holder, name=name):
            x = args[0]
            xq = forward_quantize(holder, x.to(quantize_dtype or x.dtype), "input", aargs).to(x.dtype)
            if name in model.act_pins:
                xq = _pin(model, name, holder, x, xq, aargs)
            return (xq,)
        model.get_submodule(name).register_forward_pre_hook(hook)
    return model


def _pin(model, name, holder, x, xq, aargs):
    """See ``act_quant_reference``: x, xq [1, L, in] float64; the pins cover the first T tokens."""
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    pinned = model.act_pins[name].double()  # [T, in]
    T, k = pinned.shape
    x0, q0 = x[0, :T], xq[0, :T]
    if aargs.dynamic:  # the package's float64 scales, broadcast to [T, in]
        scale, _ = compute_dynamic_scales_and_zp(value=x[:, :T], args=aargs, module=holder)  # [1, T, 1 or G]
        scale = scale[0].expand(T, k) if aargs.strategy == "token" else scale[0].repeat_interleave(aargs.group_size, -1)
    else:
        scale = holder.input_scale.expand(T, k)
    flip = (pinned - q0).abs() > 1e-3 * torch.maximum(pinned.abs(), q0.abs())
    if not bool(flip.any()):
        return xq
    c_ref, c_pin = (q0 / scale)[flip], (pinned / scale)[flip]
    def code(c):  # c = code * (1 +- a few ulps): the code itself
        return c.round() if aargs.type == "int" else c.to(torch.float8_e4m3fn).double()

    c_ref, c_pin = code(c_ref), code(c_pin)
    exact_all = x0 / scale  # [T, in], in code units
    exact = exact_all[flip]
    mid = (c_ref + c_pin) / 2
    # adjacent codes: nothing representable lies strictly between them
    if aargs.type == "int":
        assert bool(((c_ref - c_pin).abs() == 1).all()), (name, c_ref, c_pin)
    else:
        assert bool((mid.to(torch.float8_e4m3fn).double() != mid).all()), (name, c_ref, c_pin)
    lo, hi = (-128.0, 127.0) if aargs.type == "int" else (-448.0, 448.0)
    # float32 noise in x is relative to the row's magnitude (a dot product's rounding error), so the
    # distance to the boundary is measured against the row's largest |x / scale|
    row_max = exact_all.abs().amax(-1, keepdim=True).expand(T, k)[flip]
    dist = (exact.clamp(lo, hi) - mid).abs() / row_max
    for (t, c), d in zip(flip.nonzero().tolist(), dist.tolist()):
        model.act_flips.append((name, t, c, d))
    out = xq.clone()
    out[0, :T][flip] = c_pin * scale[flip]
    return out


def requantize_gguf(src: Path, dst: Path, matrix_type: str, embedding_type: str | None = None) -> Path:
    """Copy a GGUF file (metadata and all) with every 2-D tensor re-encoded by gguf-py: matrices as
    ``matrix_type``, token_embd as ``embedding_type`` (default: the same). 1-D tensors stay F32.
    E.g. the default Q4_1 model -> an F16 "reference" and a Q4_0 re-quantization of that reference."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        w = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if w.ndim == 1:
            writer.add_tensor(t.name, w)
            continue
        qt = Q[(embedding_type or matrix_type) if t.name == "token_embd.weight" else matrix_type]
        data = quants.quantize(w, qt) if qt != Q.F32 else w
        writer.add_tensor(t.name, data, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def copy_gguf(src: Path, dst: Path, set_kv: dict | None = None, add_tensors: dict | None = None) -> Path:
    """Copy a GGUF file with metadata keys added or replaced (``{"llama.expert_count": 8}``: the value
    type follows the Python type: str, bool, int -> uint32, float -> float32) and extra float32 tensors
    (``{"blk.0.ffn_gate_inp.weight": array}``). Tensors are copied as stored (same type, same bytes)."""
    import gguf
    import numpy as np

    set_kv = dict(set_kv or {})
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in set_kv:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    V = gguf.GGUFValueType
    for key, value in set_kv.items():
        vtype = V.STRING if isinstance(value, str) else V.BOOL if isinstance(value, bool) else \
            V.UINT32 if isinstance(value, int) else V.FLOAT32
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (add_tensors or {}).items():
        writer.add_tensor(name, np.asarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst

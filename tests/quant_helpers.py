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
    g = args.group_size if args.strategy == "group" else cols
    G = -(-cols // g)
    padded = torch.nn.functional.pad(w, (0, G * g - cols))  # [out, G*g]
    grouped = padded.view(out, G, g)
    # a partial last group must not see the zero padding
    valid = torch.nn.functional.pad(torch.ones(cols, dtype=torch.bool), (0, G * g - cols)).view(G, g)
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


def quantize_and_save(model, out_dir: Path, scheme: str = "W4A16", tokenizer=None,
                      group_size: int | None = None) -> Path:
    """Quantize ``model`` (a transformers causal LM, modified in place) and save it compressed.
    ``group_size`` overrides the preset's (128) for grouped schemes."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    channel = scheme.endswith("_CHANNEL")  # e.g. W8A16_CHANNEL: the preset with per-channel scales
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
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out_dir))
    compressor.update_config(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


def decompressed_state(out_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as the compressed-tensors package dequantizes them (HF names)."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    del ModelCompressor
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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

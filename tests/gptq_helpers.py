"""GPTQ and AWQ checkpoints hand-packed from each format's spec, and independent unpackers.

Neither AutoGPTQ/GPTQModel nor AutoAWQ installs without GPU kernels, so the tests write the layouts
themselves, from a tiny random Llama: each Linear but lm_head is quantized round-to-nearest in
float64 (scales rounded to fp16 first, as the formats store them), packed with numpy (not with
logprobe's packing), saved as safetensors with a config.json carrying the ``quantization_config``
the real tools write. ``gptq_unpack`` / ``awq_unpack`` read the words back one Python integer at a
time, straight from the spec, and give the float64 weights the format defines.

GPTQ (AutoGPTQ ``QuantLinear.pack``): qweight [in/p, out], word r of column o = sum_i q[o, r*p+i] << b*i;
qzeros [G, out/p], word c of group row g = sum_i zs[g, c*p+i] << b*i with zs = z - 1 (v1) or z (v2);
scales [G, out] fp16; g_idx [in]. AWQ (AutoAWQ ``WQLinear_GEMM.from_linear``): qweight [in, out/8],
word c of row k = sum_i q[c*8 + ORDER[i], k] << 4i, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros the
same packing of z [G, out]; scales [G, out] fp16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[r, c] unsigned values -> int32 words [r, c * bits / 32]: value i of each run of 32/bits sits at
    bits*i (numpy uint64 arithmetic)."""
    import numpy as np

    per = 32 // bits
    v = values.numpy().astype(np.uint64).reshape(values.shape[0], -1, per)  # [r, w, per]
    assert bool((v < (1 << bits)).all())
    w = (v << (np.arange(per, dtype=np.uint64) * np.uint64(bits))).sum(-1)  # [r, w], < 2^32
    return torch.from_numpy(w.astype(np.uint32).view(np.int32).copy())


def _values(word: int, bits: int) -> list[int]:
    w = word & 0xFFFFFFFF
    return [(w >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]


def _rtn(w: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest over the last dim of w [..., n] (float64): (q, z, scale fp16) as GPTQ/AWQ's
    quantizers compute them (sym: zero (maxq + 1) / 2 and scale 2 max|w| / maxq)."""
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = ((hi - lo) / maxq).to(torch.float16)
    s = scale.double()
    z = torch.full_like(s, (maxq + 1) // 2) if sym else torch.clamp(torch.round(-lo / s), 0, maxq)
    q = torch.clamp(torch.round(w / s[..., None]) + z[..., None], 0, maxq)
    return q.long(), z.long(), scale


def gptq_pack(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v1: bool, seed: int = 0):
    """A float64 weight [out, in] -> (GPTQ tensors, dequantized float64 weight [out, in])."""
    out, cols = w.shape
    maxq = (1 << bits) - 1
    g = cols if group == -1 else group
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.long)
    g_idx[order] = torch.arange(cols) // g  # the i-th channel in act order belongs to group i // g
    G = -(-cols // g)
    q = torch.empty(out, cols, dtype=torch.long)
    zeros = torch.empty(G, out, dtype=torch.long)
    scales = torch.empty(G, out, dtype=torch.float16)
    for j in range(G):
        ch = (g_idx == j).nonzero()[:, 0]
        qj, zj, sj = _rtn(w[:, ch], maxq, sym)
        q[:, ch], zeros[j], scales[j] = qj, zj, sj
    deq = (q - zeros[g_idx].T).double() * scales[g_idx].T.double()  # [out, in]
    stored = zeros - 1 if v1 else zeros
    assert bool((stored >= 0).all())
    tensors = {"qweight": _words(q, bits).T.contiguous(),  # [in / per, out]: packed along the input dim
               "qzeros": _words(stored, bits),  # [G, out / per]: along the output dim
               "scales": scales, "g_idx": g_idx.to(torch.int32)}
    return tensors, deq


def gptq_unpack(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """GPTQ tensors -> the float64 weight [out, in] the spec defines (read back with Python integers)."""
    per = 32 // bits
    qw, qz = t["qweight"].tolist(), t["qzeros"].tolist()
    q = torch.tensor([[v for word in col for v in _values(word, bits)] for col in zip(*qw)])  # [out, in]
    z = torch.tensor([[v for word in row for v in _values(word, bits)] for row in qz]) + (1 if v1 else 0)  # [G, out]
    g_idx = t["g_idx"].long()
    assert q.shape[1] == len(qw) * per
    return (q - z[g_idx].T).double() * t["scales"][g_idx].T.double()


def awq_pack(w: torch.Tensor, group: int):
    """A float64 weight [out, in] -> (AWQ GEMM tensors, dequantized float64 weight [out, in])."""
    out, cols = w.shape
    G = cols // group
    q, z, s = _rtn(w.view(out, G, group), 15, sym=False)  # q [out, G, group], z/s [out, G]
    q = q.view(out, cols)
    deq = (q - z.repeat_interleave(group, 1)).double() * s.double().repeat_interleave(group, 1)

    order = (torch.arange(out // 8)[:, None] * 8 + torch.tensor(ORDER)).reshape(out)  # word position -> output

    def pack(vals: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        return _words(vals[:, order], 4)

    return {"qweight": pack(q.T), "qzeros": pack(z.T), "scales": s.T.contiguous()}, deq


def awq_unpack(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    def unpack(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out]
        rows = []
        for row in words.tolist():
            vals = [0] * (8 * len(row))
            for c, word in enumerate(row):
                for i, v in enumerate(_values(word, 4)):
                    vals[c * 8 + ORDER[i]] = v
            rows.append(vals)
        return torch.tensor(rows)

    q, z = unpack(t["qweight"]).T, unpack(t["qzeros"]).T  # [out, in], [out, G]
    return (q - z.repeat_interleave(group, 1)).double() * t["scales"].T.double().repeat_interleave(group, 1)


def write_quantized(src: Path, dst: Path, method: str, qcfg: dict, pack) -> dict[str, torch.Tensor]:
    """Quantize every Linear but lm_head of the float checkpoint ``src`` with ``pack(name, w64) ->
    (tensors, deq)`` and save it to ``dst`` (config.json + tokenizer copied, ``quantization_config``
    added). Returns the reference state: the float64 dequantized weights under their HF names."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    saved, ref = {}, {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            tensors, deq = pack(module, value.double())
            saved.update({f"{module}.{k}": v for k, v in tensors.items()})
            ref[key] = deq
        else:
            saved[key] = value
            ref[key] = value.double()
    save_file(saved, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": method, **qcfg}
    (dst / "config.json").write_text(json.dumps(raw))
    return ref

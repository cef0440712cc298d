"""NVFP4 and NVFP4A16 compressed-tensors checkpoints (issue 22): the CPU reference path (emulation).

Checkpoints are written by the compressed-tensors package (``nvfp4_helpers.nvfp4_checkpoint``) from one
tiny random Llama. The reference is float64 transformers holding the package's dequantized weights
(``unpack_fp4_from_uint8`` + ``dequantize``) and, for NVFP4, every quantized Linear's input
fake-quantized by the package's ``forward_quantize`` in float64. Where float32 and float64 land on
opposite sides of a rounding boundary (an FP8 group scale or an FP4 code), the model-level comparison
pins that group to our value after checking it is such a tie; on the same float32 inputs our quantized
activations equal the package's bitwise (no pinning).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from nvfp4_helpers import nvfp4_checkpoint, nvfp4_reference, package_quantize, package_weight
from quant_helpers import tiny_wide_llama

from logprobe import Scorer
from logprobe.config import Deterministic, EngineConfig
from logprobe.layers.fp4_linear import FP4Linear, round_to_fp4, unpack_fp4
from logprobe.loading import load_model

SCHEMES = ["NVFP4", "NVFP4A16"]


def _seqs() -> list[dict]:
    g = torch.Generator().manual_seed(4)
    out = []
    for length in (40, 25, 60):
        ids = torch.randint(2, 300, (length,), generator=g).tolist()
        out.append({"prompt_token_ids": ids[:5], "completion_token_ids": ids[5:]})
    return out


@pytest.fixture(scope="module")
def fp4_dirs(tmp_path_factory):
    from helpers import byte_tokenizer

    src = tiny_wide_llama(tmp_path_factory.mktemp("fp4-src"), seed=2)
    g = torch.Generator().manual_seed(7)
    calibration = [torch.randint(2, 300, (32,), generator=g).tolist() for _ in range(4)]
    return {s: nvfp4_checkpoint(src, tmp_path_factory.mktemp(f"fp4-{s}"), s, calibration, byte_tokenizer()[0])
            for s in SCHEMES}


def test_fp4_gold_tables_and_the_packages_rounding():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    # byte 0xA3: low nibble 0x3 = +1.5 (column 0), high nibble 0xA = sign + index 2 = -1.0 (column 1)
    assert unpack_fp4(torch.tensor([[0xA3, 0x7F]], dtype=torch.uint8)).tolist() == [[1.5, -1.0, -6.0, 6.0]]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    assert torch.equal(unpack_fp4(every), unpack_fp4_from_uint8(every, 16, 32, dtype=torch.float32))
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    assert round_to_fp4(torch.tensor(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_to_fp4(-torch.tensor(ties)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    v = torch.cat([torch.linspace(-6, 6, 4801), torch.tensor(ties), -torch.tensor(ties)])
    v = torch.cat([v, torch.nextafter(v, torch.tensor(10.0)), torch.nextafter(v, torch.tensor(-10.0))])
    assert torch.equal(round_to_fp4(v), cast_to_fp4(v.clone()))


def _args(d):
    from compressed_tensors.quantization import QuantizationArgs

    group = json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    a = group["input_activations"]
    return QuantizationArgs(**group["weights"]), None if a is None else QuantizationArgs(**a)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_layers_expand_like_the_package(scheme, fp4_dirs):
    from safetensors.torch import load_file

    from logprobe.layers.rotary import to_interleaved

    d = fp4_dirs[scheme]
    wargs, _ = _args(d)
    stored = load_file(str(d / "model.safetensors"))
    for weights in ("packed", "dense"):
        model = load_model(str(d), "cpu", "float32", weights=weights).model
        layers = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
        if weights == "dense" and scheme == "NVFP4A16":  # weight-only: dense is a float model
            assert not layers
            continue
        assert len(layers) == 14 and not isinstance(model.lm_head, FP4Linear)
        assert all((m.input_global_scale is not None) == (scheme == "NVFP4") for m in layers.values())
        for name, m in layers.items():
            want = package_weight(stored, f"model.{name}", wargs, dtype=torch.float32)  # the package, in float32
            if name.endswith(("q_proj", "k_proj")):
                want = to_interleaved(want, 4 if name.endswith("q_proj") else 2)
            assert torch.equal(m.dense(), want), name


def _capture(loaded) -> dict[str, list]:
    seen: dict[str, list] = {}
    for name, m in loaded.model.named_modules():
        if isinstance(m, FP4Linear) and m.input_global_scale is not None:
            def wrapped(x, m=m, key="model." + name, orig=m.quantize_input):
                xq = orig(x)
                seen.setdefault(key, []).append((x.detach().clone(), xq.detach().clone()))
                return xq
            m.quantize_input = wrapped
    return seen


def test_activation_quantization_is_the_packages_bitwise(fp4_dirs):
    from safetensors.torch import load_file

    d = fp4_dirs["NVFP4"]
    wargs, aargs = _args(d)
    stored = load_file(str(d / "model.safetensors"))
    loaded = load_model(str(d), "cpu", "float32")
    seen = _capture(loaded)
    Scorer(loaded, progress=False).logprobs(_seqs()[:1])
    assert len(seen) == 14
    for name, [(x, xq)] in seen.items():
        theirs = package_quantize(x[None], stored[f"{name}.input_global_scale"], aargs)[0]
        assert torch.equal(xq, theirs), name
        w = package_weight(stored, name, wargs)  # float64
        want = theirs.double() @ w.T
        got = loaded.model.get_submodule(name.removeprefix("model."))(x).double()
        if name.endswith(("q_proj", "k_proj")):
            from logprobe.layers.rotary import to_interleaved

            want = to_interleaved(want.T, 4 if name.endswith("q_proj") else 2).T
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_the_references_tie_detector(fp4_dirs):
    """The pinning in ``nvfp4_reference`` only accepts groups on a rounding tie: an FP4 code tie
    (x / s' = 0.75 between codes 0.5 and 1) and an FP8 scale tie (absmax / 6 = 1.0625, midway between
    e4m3 1.0 and 1.125) are ties; a group away from every boundary is not."""
    from nvfp4_helpers import _ties

    _, aargs = _args(fp4_dirs["NVFP4"])
    x = torch.zeros(1, 48, dtype=torch.float64)
    x[0, 0], x[0, 1] = 6.0, 0.75  # scale exactly 1: code tie
    x[0, 16], x[0, 17] = 6.0, 0.6  # no tie
    x[0, 32], x[0, 33] = 6.375, 2.2  # scale tie
    assert _ties(x, torch.ones(1, dtype=torch.float64), aargs).tolist() == [[True, False, True]]


def _targets(model, seq: dict) -> torch.Tensor:
    ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(seq["prompt_token_ids"])
    return lp[n - 1:-1].gather(1, torch.tensor(ids[n:])[:, None])[:, 0]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_logprobs_match_float64_reference(scheme, device, fp4_dirs):
    """On CPU, and on CUDA (the same float32 emulation), in float32."""
    d = fp4_dirs[scheme]
    ref = nvfp4_reference(d)
    loaded = load_model(str(d), device, "float32")
    seen = _capture(loaded)
    scorer = Scorer(loaded, progress=False)
    ours, theirs, unpinned = [], [], 0.0
    for seq in _seqs():
        seen.clear()
        lp = scorer.logprobs([seq])[0].logprobs.double().cpu()
        ref.act_pins = {}
        unpinned = max(unpinned, (lp - _targets(ref, seq)).abs().max().item())
        ref.act_pins = {name: torch.cat([xq for _, xq in parts]).cpu() for name, parts in seen.items()}
        ours.append(lp)
        theirs.append(_targets(ref, seq))
    ours_t, theirs_t = torch.cat(ours), torch.cat(theirs)
    delta = (ours_t - theirs_t).abs().max().item()
    print(f"{scheme} {device}: max |delta| {delta:.2e} nat pinned ({len(ref.act_flips)} tied groups pinned), "
          f"{unpinned:.2e} unpinned, over {ours_t.numel()} tokens")
    assert delta <= 1e-4
    assert f"{math.exp(-ours_t.mean().item()):.4g}" == f"{math.exp(-theirs_t.mean().item()):.4g}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_equals_dense_and_deterministic_batch_invariance(scheme, fp4_dirs):
    d = fp4_dirs[scheme]
    seqs = _seqs()
    packed = load_model(str(d), "cpu", "float32")
    dense = load_model(str(d), "cpu", "float32", weights="dense")
    for det in (False, True):
        cfg = EngineConfig(deterministic=det and Deterministic(tile=16), progress=False)
        a = Scorer(packed, config=cfg).logprobs(seqs)
        b = Scorer(dense, config=cfg).logprobs(seqs)
        assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
        if det:
            for i, seq in enumerate(seqs):
                alone = Scorer(packed, config=cfg).logprobs([seq])[0].logprobs
                assert torch.equal(alone, a[i].logprobs), i


# -- what stays refused ---------------------------------------------------------------------------------

MOD = "model.layers.0.mlp.down_proj"


def _edited(src, dst, edit_group=None, edit_tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_group is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_group(raw["quantization_config"]["config_groups"]["group_0"], raw["quantization_config"])
        (dst / "config.json").write_text(json.dumps(raw))
    if edit_tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        edit_tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _w(**kw):
    return lambda g, q: g["weights"].update(kw)


def _a(**kw):
    return lambda g, q: g["input_activations"].update(kw)


REFUSED = {
    # name: (scheme, config edit, tensor edit, substrings of the error)
    "mxfp4 groups of 32": ("NVFP4A16", _w(group_size=32), None, ["group_size 32", "MXFP4"]),
    "per-group strategy": ("NVFP4A16", _w(strategy="group"), None, ["strategy 'group'", "tensor_group"]),
    "weight scale dtype": ("NVFP4A16", _w(scale_dtype="torch.uint8"), None, ["scale_dtype 'torch.uint8'"]),
    "asymmetric weights": ("NVFP4A16", _w(symmetric=False), None, ["asymmetric weights"]),
    "other format": ("NVFP4A16", lambda g, q: (g.update(format="pack-quantized"), q.update(format="pack-quantized")),
                     None, ["'nvfp4-pack-quantized', not 'pack-quantized'"]),
    "fully dynamic activations": ("NVFP4", _a(dynamic=True), None, ["dynamic True", "'local'"]),
    "int4 activations": ("NVFP4", _a(type="int"), None, ["input activations int4", "combination"]),
    "unknown activation option": ("NVFP4", _a(rotation="hadamard"), None, ["'rotation'"]),
    "lm_head activations": ("NVFP4", lambda g, q: q.update(ignore=[]), None, ["lm_head", "log-prob head"]),
    "missing input_global_scale": ("NVFP4", None, lambda s: s.pop(f"{MOD}.input_global_scale"),
                                   [f"{MOD}.input_global_scale", "lacks"]),
    "input_global_scale on NVFP4A16": ("NVFP4A16", None, lambda s: s.update({f"{MOD}.input_global_scale":
                                                                             torch.ones(1)}),
                                       [f"{MOD}.input_global_scale", "does not have"]),
    "float32 group scales": ("NVFP4A16", None, lambda s: s.update({f"{MOD}.weight_scale":
                                                                   s[f"{MOD}.weight_scale"].float()}),
                             [f"{MOD}.weight_scale", "float32", "float8_e4m3fn"]),
    "zero global scale": ("NVFP4", None, lambda s: s.update({f"{MOD}.weight_global_scale": torch.zeros(1)}),
                          [f"{MOD}.weight_global_scale", "positive"]),
    "wrong scale shape": ("NVFP4A16", None, lambda s: s.update({f"{MOD}.weight_scale":
                                                                s[f"{MOD}.weight_scale"][:, :8].contiguous()}),
                          [f"{MOD}.weight_scale", "one scale per 16"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_fp4_variants_are_refused(case, fp4_dirs, tmp_path):
    from logprobe import LogprobeError

    scheme, edit_group, edit_tensors, needles = REFUSED[case]
    d = _edited(fp4_dirs[scheme], tmp_path / "edited", edit_group, edit_tensors)
    with pytest.raises(LogprobeError) as err:
        load_model(str(d), "cpu", "float32")
    msg = str(err.value)
    assert msg.startswith("quantization_config:"), msg
    for needle in needles:
        assert needle in msg, (needle, msg)

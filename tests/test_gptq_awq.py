"""GPTQ and AWQ checkpoints (issue 22): repacked at load into CTLinear / ActOrderLinear, scored exactly.

Checkpoints are hand-packed from each format's spec (``gptq_helpers``: round-to-nearest in float64,
bit packing with Python integers) from one tiny random Llama. Checked here:

* the pure index functions against literal gold tables (bit positions, the AWQ order, act-order);
* the test's own unpacker (written from the spec, independent of logprobe) reads its packing back;
* each loaded layer expands to exactly the float64-dequantized weight (rounded to float32, which
  holds it exactly: a small integer times an fp16 scale);
* per-token log-probs within 1e-4 nat of a float64 transformers model holding the dequantized
  weights, perplexity equal to 4 digits; packed == dense bitwise, deterministic mode batch-invariant.
"""

from __future__ import annotations

import math

import pytest
import torch
from gptq_helpers import awq_pack, awq_unpack, gptq_pack, gptq_unpack, write_quantized
from helpers import ref_logprobs
from quant_helpers import tiny_wide_llama

from logprobe import Scorer
from logprobe.config import Deterministic, EngineConfig
from logprobe.layers.act_order_linear import ActOrderLinear
from logprobe.layers.quant_linear import CTLinear
from logprobe.loading import load_model
from logprobe.loading.awq import awq_output_order, unpack_awq
from logprobe.loading.gptq import group_order, pack_words, unpack_words

# name: (quant_method, quantization_config, packing args)
VARIANTS = {
    "gptq-4bit-g32-sym-v1": ("gptq", dict(bits=4, group_size=32, sym=True, desc_act=False, checkpoint_format="gptq")),
    "gptq-4bit-g32-asym-actorder-v1": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=True,
                                                    checkpoint_format="gptq")),
    "gptq-4bit-g128-asym-actorder-v2": ("gptq", dict(bits=4, group_size=128, sym=False, desc_act=True,
                                                     format="gptq_v2")),
    "gptq-8bit-channel-sym-v1": ("gptq", dict(bits=8, group_size=-1, sym=True, desc_act=False)),
    "gptq-8bit-g64-asym-actorder-v1": ("gptq", dict(bits=8, group_size=64, sym=False, desc_act=True,
                                                    checkpoint_format="gptq")),
    "awq-gemm-g64": ("awq", dict(bits=4, group_size=64, zero_point=True, version="gemm")),
}


def _packer(method: str, qcfg: dict):
    if method == "awq":
        return lambda module, w: awq_pack(w, qcfg["group_size"])
    v1 = qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) == "gptq"
    return lambda module, w: gptq_pack(w, qcfg["bits"], qcfg["group_size"], qcfg["sym"], qcfg["desc_act"], v1,
                                       seed=len(module))


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory):
    """name -> (checkpoint dir, float64 reference state)."""
    src = tiny_wide_llama(tmp_path_factory.mktemp("gptq-src"), seed=11)
    out = {}
    for name, (method, qcfg) in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = d, write_quantized(src, d, method, qcfg, _packer(method, qcfg))
    return out


# -- pure index functions: gold tables --------------------------------------------------------------------


def test_index_functions_gold_tables():
    w = torch.tensor([[0x76543210, -0x789ABCE0]], dtype=torch.int32)  # -0x789ABCE0 = 0x87654320 as uint32
    assert unpack_words(w, 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 3, 4, 5, 6, 7, 8]]
    assert torch.equal(pack_words(unpack_words(w, 4), 4), w)
    assert unpack_words(torch.tensor([[0x04030201]], dtype=torch.int32), 8).tolist() == [[1, 2, 3, 4]]
    assert pack_words(torch.tensor([[255, 0, 0, 255]]), 8).tolist() == [[-0x00FFFF01]]  # 0xFF0000FF
    assert pack_words(torch.tensor([[1, 2, 3]]), 4).tolist() == [[0x321]]  # a partial word is zero-padded
    assert awq_output_order(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert awq_output_order(16).tolist()[8:] == [8, 12, 9, 13, 10, 14, 11, 15]
    # outputs 0..7 holding q = o pack to 0x75316420 (nibble i holds output [0, 2, 4, 6, 1, 3, 5, 7][i])
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32), 8).tolist() == [list(range(8))]
    assert group_order(torch.tensor([0, 0, 1, 1]), 2) is None
    assert group_order(torch.tensor([1, 0, 1, 0]), 2).tolist() == [1, 3, 0, 2]
    assert group_order(torch.tensor([2, 0, 1, 0, 1]), 2).tolist() == [1, 3, 2, 4, 0]  # partial last group


def test_spec_unpackers_read_the_packing_back():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g, dtype=torch.float64)
    for bits, group, sym, desc, v1 in [(4, 16, True, False, True), (4, 16, False, True, False), (8, -1, False, True, True)]:
        t, deq = gptq_pack(w, bits, group, sym, desc, v1, seed=1)
        assert torch.equal(gptq_unpack(t, bits, v1), deq)
        assert (deq - w).abs().max() < 0.6 * t["scales"].double().max()  # really a quantization of w
    t, deq = awq_pack(w, 16)
    assert torch.equal(awq_unpack(t, 16), deq)
    assert (deq - w).abs().max() < 0.6 * t["scales"].double().max()


def test_gptq_layer_follows_g_idx_whatever_desc_act():
    """A stored g_idx decides the groups (GPTQModel's group-aware reordering writes one with desc_act
    false): the layer is act-order and expands to the weight the spec defines, in float32 exactly."""
    from logprobe.loading.gptq import gptq_layer

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for bits, v1 in ((4, True), (8, False)):
        t, deq = gptq_pack(w, bits, 16, False, True, v1, seed=2)
        for desc_act in (True, False):
            layer = gptq_layer("m", t, bits, 16, desc_act, v1)
            assert isinstance(layer, ActOrderLinear)
            assert torch.equal(layer.dense().double(), deq)
            x = torch.randn(3, 64)
            assert torch.allclose(layer(x).double(), x.double() @ deq.T, rtol=1e-5, atol=1e-5)


# -- loading and exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layers_expand_to_the_dequantized_weights(variant, quant_dirs):
    from logprobe.layers.rotary import to_interleaved

    d, ref = quant_dirs[variant]
    method, qcfg = VARIANTS[variant]
    model = load_model(str(d), "cpu", "float32").model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CTLinear)}
    assert len(layers) == 14
    act_order = qcfg.get("desc_act", False)
    for m in layers.values():  # one group (128 inputs in groups of 128) needs no reordering
        assert isinstance(m, ActOrderLinear) == (act_order and 0 < qcfg["group_size"] < m.in_features)
    assert all(m.num_bits == qcfg["bits"] for m in layers.values())
    for name, m in layers.items():
        want = ref[f"model.{name}.weight"].float()
        assert torch.equal(want.double(), ref[f"model.{name}.weight"])  # float32 holds it exactly
        if name.endswith(("q_proj", "k_proj")):
            want = to_interleaved(want, 4 if name.endswith("q_proj") else 2)
        assert torch.equal(m.dense(), want), name


def _reference(d, ref: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(d))
    cfg.quantization_config = None
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    missing, unexpected = model.load_state_dict(ref, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _seqs() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for length in (48, 30, 64):
        ids = torch.randint(2, 300, (length,), generator=g).tolist()
        out.append({"prompt_token_ids": ids[:4], "completion_token_ids": ids[4:]})
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_float64_reference(variant, quant_dirs):
    d, ref = quant_dirs[variant]
    model = _reference(d, ref)
    seqs = _seqs()
    packed = load_model(str(d), "cpu", "float32")
    ours = Scorer(packed, progress=False).logprobs(seqs)
    want = []
    for seq in seqs:
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        n = len(seq["prompt_token_ids"])
        want.append(ref_logprobs(model, ids)[n - 1:-1].gather(1, torch.tensor(ids[n:])[:, None])[:, 0])
    got_t, want_t = torch.cat([o.logprobs.double() for o in ours]), torch.cat(want)
    delta = (got_t - want_t).abs().max().item()
    print(f"{variant}: max |delta| {delta:.2e} nat over {got_t.numel()} tokens")
    assert delta <= 1e-4
    assert f"{math.exp(-got_t.mean().item()):.4g}" == f"{math.exp(-want_t.mean().item()):.4g}"


@pytest.mark.parametrize("variant", ["gptq-4bit-g32-asym-actorder-v1", "awq-gemm-g64"])
def test_packed_equals_dense_and_deterministic_batch_invariance(variant, quant_dirs):
    """ActOrderLinear (GPTQ act-order) and a repacked CTLinear (AWQ): one expansion function for packed
    and dense, and deterministic mode's row tiles keep a request's bits independent of its batch."""
    d, _ = quant_dirs[variant]
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


# -- CUDA: the W4A16 Triton kernel on repacked GPTQ / AWQ layers ----------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["gptq-4bit-g32-asym-actorder-v1", "gptq-4bit-g128-asym-actorder-v2",
                                     "gptq-8bit-g64-asym-actorder-v1", "awq-gemm-g64"])
def test_cuda_layers_and_logprobs(variant, quant_dirs):
    """int4 layers run the Triton kernel (act-order: on the permuted activation) and agree with the
    definition (the weight rounded to bf16, as the kernel's reference rounds it); log-probs of the
    bf16 model stay near the float64 reference."""
    import torch.nn.functional as F

    d, ref = quant_dirs[variant]
    loaded = load_model(str(d), "cuda", "bfloat16")
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [m for m in loaded.model.modules() if isinstance(m, CTLinear)]
    assert len(layers) == 14
    for m in layers:
        for rows in (5, 300):  # the dequant-GEMM (< 256 rows) and the expansion + cuBLAS path
            x = torch.randn(rows, m.in_features, device="cuda", dtype=torch.bfloat16, generator=g)
            if m.num_bits == 4:
                assert m._cuda_forward(x) is not None
            want = F.linear(x.float(), m.rows().to(torch.bfloat16).float(), None if m.bias is None else m.bias.float())
            err = (m(x).float() - want).abs().max().item()
            assert err <= 1e-2 * want.abs().max().item(), (m, rows, err)
    model = _reference(d, ref)
    seq = _seqs()[0]
    ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
    want = ref_logprobs(model, ids)[3:-1].gather(1, torch.tensor(ids[4:])[:, None])[:, 0]
    got = Scorer(loaded, progress=False).logprobs([seq])[0].logprobs.double().cpu()
    print(f"{variant} cuda bf16: max |delta| {(got - want).abs().max().item():.3f} nat")
    assert (got - want).abs().max() < 0.15

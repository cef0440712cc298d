"""FP8 block-quantized checkpoints (``loading.fp8_block``, ``layers.fp8_block_linear``) against the
float64 forward of their dequantized weights.

The checkpoints are written the way DeepSeek's are: every projection ``<m>.weight`` float8_e4m3fn
with ``<m>.weight_scale_inv`` float32 [ceil(out/bh), ceil(in/bw)] (scale = block absmax / 448),
norms, embeddings, routers and lm_head left float, ``quantization_config`` ``{"quant_method":
"fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bh, bw]}``. Blocks are
smaller than the released 128 x 128 so that tiny matrices hold several, and chosen so that some
widths are not multiples of them (the last blocks partial). One module named in
``modules_to_not_convert`` stays float; one module's scale sits in a different shard than its codes.

The reference: the same checkpoint with each FP8 weight replaced by code * scale computed in float64
(exact), loaded by transformers in float64 (its RMSNorm in float64 too for DeepSeek). Per-token
log-probs agree to 1e-4; the FP8 model must also hold its weights as FP8 codes. Router near-ties
are kept out as in ``test_deepseek`` (margins asserted).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import byte_tokenizer, copy_checkpoint, random_sequences, ref_logprobs, tiny_config

from logprobe import LogprobeError, Scorer
from logprobe.layers.act_quant_linear import ActQuantLinear
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear
from logprobe.loading import load_model
from logprobe.loading.fp8_block import fp8_scheme, kept_float

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_deepseek import MIN_MARGIN, _norm64, _randomise, _reference, _routing_stats, hfds, make_model  # noqa: E402

TOL = 1e-4
FP8 = torch.float8_e4m3fn


def quantize_blocks(w: torch.Tensor, bh: int, bw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 codes [out, in], float32 scale_inv [ceil(out/bh), ceil(in/bw)])."""
    out, k = w.shape
    R, C = -(-out // bh), -(-k // bw)
    padded = F.pad(w.float(), (0, C * bw - k, 0, R * bh - out))  # [R*bh, C*bw]
    amax = padded.view(R, bh, C, bw).abs().amax(dim=(1, 3))  # [R, C]
    scale = (amax / 448).clamp_min(1e-12)
    full = scale.repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    return (padded / full).to(FP8)[:out, :k].contiguous(), scale


def dequant64(codes: torch.Tensor, scale: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    out, k = codes.shape
    return codes.double() * scale.double().repeat_interleave(bh, 0)[:out].repeat_interleave(bw, 1)[:, :k]


def write_fp8(src, fp8_dir, ref_dir, block, not_convert, quantized) -> int:
    """Rewrite the float checkpoint ``src`` as an FP8 block one (``fp8_dir``, two shards) and as its
    float64 dequantization (``ref_dir``); returns how many matrices were quantized."""
    bh, bw = block
    tensors = load_file(str(src / "model.safetensors"))
    fp8, ref, n, moved = {}, {}, 0, None
    for key, w in tensors.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and quantized(key) and not kept_float(module, tuple(not_convert)):
            codes, scale = quantize_blocks(w, bh, bw)
            fp8[key], fp8[module + ".weight_scale_inv"] = codes, scale
            ref[key] = dequant64(codes, scale, bh, bw)
            moved, n = moved or module + ".weight_scale_inv", n + 1
        else:
            fp8[key], ref[key] = w, w.double()
    cfg = json.loads((src / "config.json").read_text())
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        byte_tokenizer()[0].save_pretrained(str(d))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": not_convert}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    shards = {"model-00002-of-00002.safetensors": {moved: fp8.pop(moved)}, "model-00001-of-00002.safetensors": fp8}
    for name, part in shards.items():
        save_file(part, str(fp8_dir / name))
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return n


def _proj(key: str) -> bool:
    return "_proj" in key and "norm" not in key


@pytest.fixture(scope="module")
def ds_fp8(tmp_path_factory):
    """Tiny deepseek_v3 (q_lora, dense block 0, grouped routing, shared expert), FP8 blocks of 32 x 32:
    q_b_proj reads 24 columns, kv_a_proj_with_mqa writes 40 rows (partial blocks)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(hfds.DeepseekV3RMSNorm, "forward", _norm64)
    root = tmp_path_factory.mktemp("ds_fp8")
    torch.manual_seed(0)
    model = make_model("qlora").float().eval()
    _randomise(model, seed=0)
    model.save_pretrained(str(root / "float"))
    n = write_fp8(root / "float", root / "fp8", root / "ref", (32, 32), ["model.layers.0.mlp.down_proj"], _proj)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(str(root / "ref"), dtype=torch.float64,
                                                             attn_implementation="eager",
                                                             experts_implementation="eager").eval()
    yield root, ref, n
    mp.undo()


def _sequences() -> list[dict]:
    seqs = random_sequences(4, seed=7, max_prompt=30, max_completion=50)
    seqs.append({"prompt_token_ids": list(range(2, 42)), "completion_token_ids": list(range(60, 100))})
    return seqs


def _worst(scorer, ref, seqs, routed: bool = False) -> tuple[float, int, float]:
    worst, compared, margin = 0.0, 0, float("inf")
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        if routed:
            lp, routers = _reference(ref, ids)
            for logits, bias, chosen in routers:
                margin = min(margin, _routing_stats(logits, bias, chosen, hi)[0])
        else:
            lp = ref_logprobs(ref, ids)
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
    return worst, compared, margin


def test_deepseek_fp8_matches_dequantized_float64(ds_fp8):
    root, ref, n = ds_fp8
    scorer = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False)
    model = scorer.loaded.model
    fp8_layers = [m for m in model.modules() if isinstance(m, FP8BlockLinear)]
    experts = [m for m in model.modules() if isinstance(m, FP8BlockExperts)]
    assert len(experts) == 3 * 3 and len(fp8_layers) + 8 * len(experts) == n  # 8 experts stacked per matrix
    assert all(m.qweight.dtype == FP8 for m in fp8_layers + experts) and experts
    assert not isinstance(model.layers[0].mlp.down_proj, FP8BlockLinear)  # modules_to_not_convert: float
    assert model.layers[1].self_attn.kv_a_proj_with_mqa.out_features == 40  # 40 rows in blocks of 32
    worst, compared, margin = _worst(scorer, ref, _sequences(), routed=True)
    print(f"deepseek fp8: max |delta| {worst:.2e} over {compared} tokens, router margin {margin:.2e}")
    assert compared > 50 and margin > MIN_MARGIN
    assert worst < TOL


@pytest.fixture(scope="module")
def qwen_fp8(tmp_path_factory):
    """Tiny qwen3 (head_dim 32, q/k norms), FP8 blocks of 48 rows x 32 columns: no output width
    (64, 128) is a multiple of 48."""
    root = tmp_path_factory.mktemp("qwen_fp8")
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="eager").float()
    model.save_pretrained(str(root / "float"))
    write_fp8(root / "float", root / "fp8", root / "ref", (48, 32), ["lm_head", "model.layers.1.self_attn.o_proj"],
              _proj)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype=torch.float64,
                                                            attn_implementation="eager").eval()
    return root, ref


def test_qwen3_fp8_matches_dequantized_float64(qwen_fp8):
    root, ref = qwen_fp8
    scorer = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False)
    attn = scorer.loaded.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FP8BlockLinear) and attn.q_proj.qweight.dtype == FP8
    assert not isinstance(scorer.loaded.model.layers[1].self_attn.o_proj, FP8BlockLinear)
    worst, compared, _ = _worst(scorer, ref, _sequences())
    print(f"qwen3 fp8: max |delta| {worst:.2e} over {compared} tokens")
    assert compared > 50 and worst < TOL
    # the same numbers as the float checkpoint of the dequantized weights, rounded to float32
    flat = Scorer(str(root / "ref"), device="cpu", dtype="float32", progress=False)
    seqs = _sequences()[:3]
    for a, b in zip(scorer.logprobs(seqs), flat.logprobs(seqs)):
        assert (a.logprobs - b.logprobs).abs().max().item() < 1e-5
    with pytest.raises(LogprobeError, match="as FP8 blocks"):  # float tensors are not quantized into FP8 blocks
        scorer.update_weights(load_file(str(root / "ref" / "model.safetensors")))


def _fake_quant_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """DeepSeek's dynamic activation rounding, as its kernel computes it (float32): per token and
    group, s = absmax / 448, code = e4m3(x / s); returned as code * s in float64."""
    T, k = x.shape
    g = x.float().view(T, k // group, group)
    s = g.abs().amax(-1, keepdim=True) / 448
    s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
    return ((g / s).to(FP8).double() * s.double()).view(T, k)


def test_quantize_activations_opt_in(qwen_fp8):
    root, _ = qwen_fp8
    loaded = load_model(str(root / "fp8"), device="cpu", dtype="float32", quantize_activations=True)
    q = loaded.model.layers[0].self_attn.q_proj
    layer = loaded.model.layers[0].mlp.down_proj
    assert isinstance(layer, ActQuantLinear) and layer.act_group == 32 and layer.act_kind == "float"
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(1)) * 3
    x[2, :32] = 0  # an all-zero group
    want = _fake_quant_groups(x, 32) @ layer.rows().double().T  # the format's activations, float64 product
    assert (layer(x).double() - want).abs().max().item() < 1e-5
    assert q.qweight.dtype == FP8 or isinstance(q, ActQuantLinear)
    seqs = _sequences()[:2]
    quant = Scorer(loaded, progress=False).logprobs(seqs)
    plain = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False).logprobs(seqs)
    delta = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(quant, plain))
    assert 0 < delta < 0.5  # rounding the activations changes the numbers, a little
    with pytest.raises(LogprobeError, match="quantize_activations"):
        load_model(str(root / "ref"), device="cpu", dtype="float32", quantize_activations=True)


def test_deepseek_activation_quantization_refused_for_partial_widths(ds_fp8):
    root, _, _ = ds_fp8
    with pytest.raises(LogprobeError, match="not a multiple of the activation group"):
        load_model(str(root / "fp8"), device="cpu", dtype="float32", quantize_activations=True)


BASE_Q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("change, words", [
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"surprise": 1}, "surprise"),
    ({"modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    ({"expert_dtype": "fp4"}, "expert_dtype"),
])
def test_config_refusals(change, words):
    with pytest.raises(LogprobeError) as e:
        fp8_scheme({**BASE_Q, **change})
    assert e.value.field == "quantization_config" and words in str(e.value)
    with pytest.raises(LogprobeError, match="ue8m0"):
        fp8_scheme({**BASE_Q, "scale_fmt": "ue8m0"}, quantize_activations=True)
    assert fp8_scheme({**BASE_Q, "scale_fmt": "ue8m0", "ignored_layers": ["gate"]}).not_convert == ("gate",)


def test_tensor_refusals(qwen_fp8, tmp_path):
    root, _ = qwen_fp8
    src = root / "fp8"
    key = "model.layers.0.self_attn.q_proj"

    def listed(cfg):
        cfg["quantization_config"]["modules_to_not_convert"].append("layers.0.self_attn.q_proj")

    cases = [
        (dict(edit_config=listed), "modules_to_not_convert names"),
        (dict(edit_tensors=lambda t: t.pop(key + ".weight_scale_inv")), "weight_scale_inv is missing"),
        (dict(edit_tensors=lambda t: t.update({key + ".weight_scale_inv": t[key + ".weight_scale_inv"][:1]})),
         "is not one scale per 48x32 block"),
        (dict(edit_tensors=lambda t: t.update({key + ".input_scale": torch.ones(1)})), "another FP8 layout"),
        (dict(edit_tensors=lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                               t["model.layers.0.mlp.up_proj.weight"].float()})),
         "has no float8"),
    ]
    for i, (edit, words) in enumerate(cases):
        d = copy_checkpoint(src, tmp_path / f"case{i}", **edit)
        with pytest.raises(LogprobeError, match=words):
            load_model(str(d), device="cpu", dtype="float32")


def test_dense_weights_same_bits(qwen_fp8):
    root, _ = qwen_fp8
    seqs = _sequences()[:2]
    packed = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False).logprobs(seqs)
    dense = load_model(str(root / "fp8"), device="cpu", dtype="float32", weights="dense")
    assert not any(isinstance(m, FP8BlockLinear) for m in dense.model.modules())
    for a, b in zip(packed, Scorer(dense, progress=False).logprobs(seqs)):
        assert torch.equal(a.logprobs, b.logprobs)


def test_expert_stack_expansion_is_each_expert():
    """``FP8BlockExperts.stacked`` (what the fused expert kernel reads on CUDA) holds each expert's
    ``expert(e)`` bitwise, in every dtype: the fused and per-expert paths see the same weights."""
    for width in (72, 64):  # a last partial block of columns, and none
        w = torch.randn(3, 40, width, generator=torch.Generator().manual_seed(0)) * 30
        layers = []
        for e in range(3):
            codes, scale = quantize_blocks(w[e], 32, 32)
            layers.append(FP8BlockLinear.from_blocks(codes, scale, 32, 32))
        experts = FP8BlockExperts.stack(layers)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            experts.compute_dtype = dtype
            stacked = experts.stacked(dtype)
            assert all(torch.equal(stacked[e], experts.expert(e)) for e in range(3))
            # rounded once as stored: the float32 expansion, then the dtype
            assert torch.equal(experts.rows().to(dtype), stacked.reshape(-1, width))
            assert torch.equal(experts.stacked(dtype, 1, 3), stacked[1:3])  # a run of experts
            for e, layer in enumerate(layers):
                assert torch.equal(layer.weight_in(dtype), layer.rows().to(dtype))
                assert torch.equal(layer.weight_in(dtype), stacked[e])


MOE_KINDS = ["glm4_moe", "minimax_m2", "qwen3_moe"]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_families_fp8_match_dequantized_float64(kind, tmp_path):
    """GLM-4.5 (qkv bias moved into the FP8 layers, partial rotary rows permuted), MiniMax-M2 (Mixtral's
    w1/w2/w3 expert names) and Qwen3-MoE (the Llama-family loader, FP8 experts stacked): FP8 blocks of
    32 x 32 against the float64 forward of the dequantized weights; routing margins asserted."""
    import test_moe
    import test_moe_sigmoid_families as sig

    mp = pytest.MonkeyPatch()
    mp.setattr(sig.hfglm.Glm4MoeRMSNorm, "forward", sig._norm64)
    mp.setattr(sig.hfmm.MiniMaxM2RMSNorm, "forward", sig._norm64)
    try:
        torch.manual_seed(0)
        if kind == "qwen3_moe":
            model = transformers.AutoModelForCausalLM.from_config(
                test_moe.moe_config(kind), attn_implementation="eager", experts_implementation="eager").float()
        else:
            model = sig.make_model(kind).float()
            sig._randomise(model, seed=sig.SEEDS[kind])
        model.save_pretrained(str(tmp_path / "float"))
        n = write_fp8(tmp_path / "float", tmp_path / "fp8", tmp_path / "ref", (32, 32), ["lm_head"],
                      lambda key: _proj(key) or ".experts." in key)
        ref = type(model).from_pretrained(str(tmp_path / "ref"), dtype=torch.float64, attn_implementation="eager",
                                          experts_implementation="eager").eval()
        scorer = Scorer(str(tmp_path / "fp8"), device="cpu", dtype="float32", progress=False)
        held = [m for m in scorer.loaded.model.modules() if isinstance(m, (FP8BlockLinear, FP8BlockExperts))]
        assert n > 0 and any(isinstance(m, FP8BlockExperts) for m in held)
        assert all(m.qweight.dtype == FP8 for m in held)
        seqs = _sequences()
        worst, compared, margin = 0.0, 0, float("inf")
        for seq, res in zip(seqs, scorer.logprobs(seqs)):
            ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
            lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
            if kind == "qwen3_moe":
                lp = ref_logprobs(ref, ids)
            else:
                lp, routers = sig._reference(ref, ids)
                for logits, bias, chosen in routers:
                    margin = min(margin, sig._routing_stats(logits, bias, chosen, hi, sig.GROUPS[kind])[0])
            tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
            worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
            compared += len(tgt)
    finally:
        mp.undo()
    print(f"{kind} fp8: max |delta| {worst:.2e} over {compared} tokens, router margin {margin:.2e}")
    assert compared > 50 and (kind == "qwen3_moe" or margin > sig.MIN_MARGIN)
    assert worst < TOL

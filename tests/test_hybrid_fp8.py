"""FP8 block checkpoints of the hybrid Qwen families (``loading.hybrid`` with ``loading.fp8_block``)
against the float64 transformers forward of their dequantized weights.

Three tiny random checkpoints saved by transformers' own classes (``test_qwen3_next``'s): Qwen3.5
multimodal dense (text under ``model.language_model.``, a vision tower to skip), Qwen3.5 MoE
multimodal and Qwen3-Next (fused ``in_proj_qkvz`` / ``in_proj_ba``, block 2 dense). They are
rewritten the way Qwen's FP8 releases are laid out: each quantized Linear ``<m>.weight`` as
float8_e4m3fn codes with ``<m>.weight_scale_inv`` float32 [ceil(out/bh), ceil(in/bw)] (scale = block
absmax / 448), ``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [48, 32], "modules_to_not_convert": [...]}``. Quantized: attention
q/k/v/o, the Gated DeltaNet projections and out_proj, the dense MLP, the experts, the shared expert,
and the vision tower's matrices (read dequantized). Float: embeddings, lm_head, norms, conv1d, A_log,
dt_bias, routers, the shared-expert gate, and what ``modules_to_not_convert`` names: as Qwen does,
block 0's ``in_proj_ba`` (Qwen3-Next) or ``in_proj_b`` / ``in_proj_a`` (Qwen3.5); block 2's are FP8.
Blocks of 48 rows x 32 columns: no row count here (4 .. 256) is a multiple of 48 and the shared
expert reads 48 columns, so the last blocks are partial; one scale sits in another shard than its codes.

The reference: the same checkpoint with each FP8 weight replaced by code * scale in float64 (exact),
loaded by transformers in float64 (its float32 casts read as float64, ``test_qwen3_next``'s fixture).
Ours runs in float32 through ``Scorer``, the weights held as FP8 codes: per-token log-probs within
1e-4 of float64 (float32 rounding, as the float checkpoints); every FP8 layer's expansion is
bitwise the float32 weight logprobe reads from the dequantized float checkpoint, and the two
float32 forwards agree to float32 rounding (their matmuls are grouped differently).
Also: deterministic mode's batch invariance on FP8 weights (companions, chunks, shared prefixes),
a tensor-parallel rank's FP8 rows, and TP = 2 bitwise TP = 1 (gloo workers, slow tier). MoE router near-ties are kept out as in ``test_qwen3_next`` (margins asserted).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, copy_checkpoint
from test_fp8_block import dequant64, quantize_blocks
from test_qwen3_next import (  # noqa: F401  (float64_reference: a fixture used by name)
    MIN_MARGIN,
    _randomise,
    _reference,
    _sequences,
    float64_reference,
    make_model,
)

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig, numerics_for
from logprobe.layers.act_quant_linear import ActQuantLinear
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear
from logprobe.layers.gated_delta import split_qwen3_next_projections
from logprobe.layers.parallel_linear import held_ranges
from logprobe.loading import load_model
from logprobe.loading.hybrid import (
    _split_rows,
    build_hybrid,
    hybrid_config,
    hybrid_shard_tensors,
    hybrid_tensors,
)
from logprobe.loading.loader import parallel_context
from logprobe.loading.sharding import held_experts
from logprobe.models.qwen3_next import HybridModel

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TOL = 1e-4  # float32 against float64, as the float checkpoints (test_qwen3_next)
# against the float checkpoint of the same (dequantized) weights, both float32: bitwise the same
# weights (asserted), products grouped differently (the float model fuses q/k/v, gate/up and the
# mixer's input projections into one matmul each; FP8 layers multiply apart)
SAME = 5e-5
FP8 = torch.float8_e4m3fn
BLOCK = (48, 32)
KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
SEEDS = {"qwen3_5": 101, "qwen3_5_moe": 116, "qwen3_next": 103}  # MoE: chosen for MIN_MARGIN after quantization
_FLOAT = ("embed_tokens", "lm_head", "norm", "conv1d", "A_log", "dt_bias", "mlp.gate.weight", "shared_expert_gate")


def _not_convert(kind: str) -> list[str]:
    """Qwen's list (lm_head, routers, gates, block 0's small projections); block 2's are quantized."""
    if kind == "qwen3_next":
        small = ["model.layers.0.linear_attn.in_proj_ba"]
    else:
        small = [f"model.language_model.layers.0.linear_attn.in_proj_{x}" for x in "ab"]
    return ["lm_head", "mlp.gate", "shared_expert_gate", *small]


def _quantized(key: str, w: torch.Tensor, not_convert: list[str]) -> bool:
    module = key.removesuffix(".weight")
    return (key.endswith(".weight") and w.dim() == 2 and w.is_floating_point() and not any(f in key for f in _FLOAT)
            and not any(module == p or module.endswith("." + p) or module.endswith(p) for p in not_convert))


def write_hybrid_fp8(src, fp8_dir, ref_dir, kind: str) -> list[str]:
    """Rewrite the float checkpoint ``src`` as an FP8 block one (two shards) and as its float64
    dequantization; returns the quantized modules."""
    bh, bw = BLOCK
    not_convert = _not_convert(kind)
    fp8, ref, modules = {}, {}, []
    for key, w in load_file(str(src / "model.safetensors")).items():
        if _quantized(key, w, not_convert):
            module = key.removesuffix(".weight")
            codes, scale = quantize_blocks(w, bh, bw)
            fp8[key], fp8[module + ".weight_scale_inv"] = codes, scale
            ref[key] = dequant64(codes, scale, bh, bw)
            modules.append(module)
        else:
            fp8[key], ref[key] = w, w.double()
    cfg = json.loads((src / "config.json").read_text())
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        byte_tokenizer()[0].save_pretrained(str(d))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK), "modules_to_not_convert": not_convert}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    moved = next(m for m in modules if "linear_attn.out_proj" in m) + ".weight_scale_inv"
    shards = {"model-00002-of-00002.safetensors": {moved: fp8.pop(moved)}, "model-00001-of-00002.safetensors": fp8}
    for name, part in shards.items():
        save_file(part, str(fp8_dir / name))
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return modules


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, float64_reference):  # noqa: F811
    out = {}
    for i, kind in enumerate(KINDS):
        root = tmp_path_factory.mktemp(f"{kind}_fp8")
        torch.manual_seed(i)
        model = make_model(kind).float().eval()
        _randomise(model, seed=SEEDS[kind])
        model.save_pretrained(str(root / "float"))
        modules = write_hybrid_fp8(root / "float", root / "fp8", root / "ref", kind)
        ref = type(model).from_pretrained(str(root / "ref"), dtype=torch.float64, attn_implementation="eager",
                                          experts_implementation="eager").eval()
        out[kind] = (root, ref, modules)
    return out


def _worst(scorer, ref, seqs) -> tuple[float, int, float]:
    worst, compared, margin = 0.0, 0, float("inf")
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        lp, routers = _reference(ref, ids)
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for p in routers:  # rows 0..hi-1 feed the scored rows (causal)
            top = p[:hi].topk(3, dim=-1).values
            margin = min(margin, (top[:, 1] - top[:, 2]).min().item())
    return worst, compared, margin


def _assert_same_weights(fp8_model, flat_model) -> None:
    """Every FP8 layer's expansion is bitwise the float32 weight logprobe reads from the dequantized
    float checkpoint (rotary row order and Qwen3-Next's row split included): the same model."""
    flat = flat_model.state_dict()
    checked = 0
    for name, m in fp8_model.named_modules():
        if isinstance(m, FP8BlockLinear):
            assert torch.equal(m.rows(), flat[name + ".weight"]), name
        elif isinstance(m, FP8BlockExperts):
            owner, _, child = name.rpartition(".")
            assert torch.equal(m.stacked(torch.float32), flat[f"{owner}.{child}"]), name
        else:
            continue
        checked += 1
    assert checked > 0


def _held(model) -> tuple[list, list]:
    return ([m for m in model.modules() if isinstance(m, FP8BlockLinear)],
            [m for m in model.modules() if isinstance(m, FP8BlockExperts)])


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_matches_dequantized_float64(kind, fp8_dirs):
    root, ref, modules = fp8_dirs[kind]
    scorer = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False)
    model = scorer.loaded.model
    assert scorer.info.backend == "native" and type(model).__name__ == "HybridModel"
    layers, experts = _held(model)
    assert all(m.qweight.dtype == FP8 for m in layers + experts)
    text = [m for m in modules if ".visual." not in m]  # the vision tower's: dequantized at load
    if kind == "qwen3_next":  # in_proj_qkvz -> qkv and z; block 2's in_proj_ba -> b and a
        assert len(layers) + 8 * len(experts) == len(text) + 3
    else:
        assert len(layers) + 8 * len(experts) == len(text)
    assert bool(experts) == (kind != "qwen3_5")
    l0, l1, l2 = model.layers[0], model.layers[1], model.layers[2]
    for mixer, small_fp8 in ((l0.linear_attn, False), (l2.linear_attn, True)):
        assert isinstance(mixer.in_proj_qkv, FP8BlockLinear) and isinstance(mixer.in_proj_z, FP8BlockLinear)
        assert isinstance(mixer.out_proj, FP8BlockLinear)
        assert isinstance(mixer.in_proj_b, FP8BlockLinear) == small_fp8  # modules_to_not_convert: float
        assert isinstance(mixer.in_proj_a, FP8BlockLinear) == small_fp8
        assert mixer.conv_weight.dtype == torch.float32
    attn = l1.self_attn
    assert all(isinstance(getattr(attn, p), FP8BlockLinear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if kind != "qwen3_5":
        assert isinstance(l1.mlp.shared_expert.down_proj, FP8BlockLinear) and l1.mlp.shared_expert.down_proj.in_features == 48
    seqs = _sequences()
    worst, compared, margin = _worst(scorer, ref, seqs)
    # the float checkpoint of the dequantized weights, read by logprobe in float32: the same weights
    # (code * scale rounded once to float32 either way), so the same numbers to float32 rounding
    flat = Scorer(str(root / "ref"), device="cpu", dtype="float32", progress=False)
    same = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(scorer.logprobs(seqs), flat.logprobs(seqs)))
    _assert_same_weights(model, flat.loaded.model)
    print(f"{kind} fp8: max |delta| {worst:.2e} vs float64, {same:.2e} vs the float32 dequantized checkpoint, "
          f"over {compared} tokens, router margin {margin:.2e}")
    assert compared > 50 and (kind == "qwen3_5" or margin > MIN_MARGIN)
    assert worst < TOL and same < SAME


def test_dense_weights(fp8_dirs):
    """``weights="dense"`` expands the FP8 weights (experts too) at load: bitwise the packed layers'
    expansion, the same numbers to float32 rounding (dense projections are fused into one matmul)."""
    root, _, _ = fp8_dirs["qwen3_next"]
    seqs = _sequences()[:2]
    packed = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False)
    dense = load_model(str(root / "fp8"), device="cpu", dtype="float32", weights="dense")
    assert _held(dense.model) == ([], [])
    _assert_same_weights(packed.loaded.model, dense.model)
    for a, b in zip(packed.logprobs(seqs), Scorer(dense, progress=False).logprobs(seqs)):
        assert (a.logprobs - b.logprobs).abs().max().item() < SAME


def test_quantize_activations(fp8_dirs):
    """Qwen3.5 dense with FP8 activations (opt-in): ActQuantLinear layers, numbers a little off the
    weight-only ones; Qwen3-Next's fused projections and the FP8 experts refuse them, naming the key."""
    root, _, _ = fp8_dirs["qwen3_5"]
    loaded = load_model(str(root / "fp8"), device="cpu", dtype="float32", quantize_activations=True)
    assert isinstance(loaded.model.layers[0].linear_attn.in_proj_qkv, ActQuantLinear)
    seqs = _sequences()[:2]
    quant = Scorer(loaded, progress=False).logprobs(seqs)
    plain = Scorer(str(root / "fp8"), device="cpu", dtype="float32", progress=False).logprobs(seqs)
    delta = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(quant, plain))
    assert 0 < delta < 0.5
    for kind, words in (("qwen3_next", "fused in_proj_qkvz"), ("qwen3_5_moe", "experts stored as ActQuantLinear")):
        with pytest.raises(LogprobeError, match=words):
            load_model(str(fp8_dirs[kind][0] / "fp8"), device="cpu", dtype="float32", quantize_activations=True)


def _set(**change):
    def edit(cfg):
        cfg["quantization_config"].update(change)
    return edit


def test_refusals(fp8_dirs, tmp_path):
    """Schemes not run, and tensors that do not fit the scheme, are refused naming the key."""
    src = fp8_dirs["qwen3_next"][0] / "fp8"
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz"

    def kept_float(cfg):
        cfg["quantization_config"]["modules_to_not_convert"].append(qkvz)

    def gptq(cfg):
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}

    def fp8_conv(t):
        t["model.layers.0.linear_attn.conv1d.weight"] = t["model.layers.0.linear_attn.conv1d.weight"].to(FP8)

    cases = [
        (dict(edit_config=_set(activation_scheme="static")), "quantization_config", "activation_scheme 'static'"),
        (dict(edit_config=_set(fmt="e5m2")), "quantization_config", "fmt 'e5m2'"),
        (dict(edit_config=_set(weight_block_size=[48])), "quantization_config", "weight_block_size"),
        (dict(edit_config=gptq), "quantization_config", "gptq"),
        (dict(edit_config=kept_float), "quantization_config", "modules_to_not_convert names"),
        (dict(edit_tensors=lambda t: t.pop(qkvz + ".weight_scale_inv")), "quantization_config",
         "weight_scale_inv is missing"),
        (dict(edit_tensors=fp8_conv), "quantization_config", "conv1d.weight"),
    ]
    for i, (edit, field, words) in enumerate(cases):
        d = copy_checkpoint(src, tmp_path / f"case{i}", **edit)
        with pytest.raises(LogprobeError, match=words) as e:
            load_model(str(d), device="cpu", dtype="float32")
        assert e.value.field == field


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_rank_reads_its_fp8_rows(kind, fp8_dirs):
    """Rank 1 of 2 (``hybrid_shard_tensors``): every FP8 layer holds the rows its layer states
    (``held_ranges``: q/k/v heads, the mixer's three q/k/v ranges, value heads, output rows), kept
    FP8 and bitwise those rows of the whole layer; Qwen3-Next's fused projections split, then cut;
    FP8 experts: the rank's half (expert parallelism 2), float tensors as before. Heads split
    (``attention_parallel="tensor"``; Qwen3-Next by data, its default, reads them whole: below)."""
    path = fp8_dirs[kind][0] / "fp8"
    raw = json.loads((path / "config.json").read_text())
    cfg = hybrid_config(raw)
    whole = dict(hybrid_tensors(path, cfg, raw))
    ctx = parallel_context(cfg, 1, 2, None, 2 if cfg.moe is not None else 1, "tensor")
    got = dict(hybrid_shard_tensors(path, cfg, ctx))
    assert got.keys() == whole.keys()  # the vision tower too: every rank reads it whole
    with torch.device("meta"):
        model = HybridModel(cfg, ctx)
    cut = 0
    for name, w in got.items():
        if isinstance(w, FP8BlockLinear):
            assert w.qweight.dtype == FP8
            full, ranges = whole[name].rows(), held_ranges(model, name)
            want = full if ranges is None else torch.cat([full[a:b] for a, b in ranges])
            cut += want.shape[0] < full.shape[0]
            assert torch.equal(w.rows(), want), name
        elif isinstance(w, FP8BlockExperts):
            start, end = held_experts(model)
            assert end - start == 4 and torch.equal(w.stacked(torch.float32),
                                                    whole[name].stacked(torch.float32)[start:end]), name
        else:
            assert not isinstance(whole[name], (FP8BlockLinear, FP8BlockExperts)), name
            if name.startswith("visual."):  # dequantized at load, whole
                assert torch.equal(w, whole[name]), name
    assert cut >= 8  # q/k/v, in_proj_qkv/z, out_proj, o_proj, ... are this rank's rows only
    if cfg.moe is not None:  # by data: every FP8 layer but the experts read whole, kept FP8
        ctx = parallel_context(cfg, 1, 2, None, 2)
        assert ctx.attention == "data"
        got = dict(hybrid_shard_tensors(path, cfg, ctx))
        layers = [n for n, w in got.items() if isinstance(w, FP8BlockLinear)]
        assert len(layers) >= 8 and all(torch.equal(got[n].rows(), whole[n].rows()) for n in layers)


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per model
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_fp8_tp2_equals_tp1(kind, fp8_dirs):
    """FP8 checkpoints at TP = 2 (Qwen3-Next: experts split over the two ranks): bitwise TP = 1 in
    deterministic mode; in default mode products of other shapes, so float32 rounding (``SAME``)."""
    path = str(fp8_dirs[kind][0] / "fp8")
    seqs = _sequences()
    one = Scorer(path, device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (True, False):
        one.config = EngineConfig(deterministic=det)
        want[det] = one.logprobs(seqs)
    with Scorer(path, device="cpu", dtype="float32", progress=False, tensor_parallel_size=2) as s:
        for det in (True, False):
            s.config = EngineConfig(deterministic=det)
            for x, y in zip(s.logprobs(seqs), want[det]):
                if det:
                    assert torch.equal(x.logprobs, y.logprobs), kind
                else:
                    assert (x.logprobs - y.logprobs).abs().max() <= SAME


def test_fused_split_keeps_row_scales():
    """Qwen3-Next's FP8 ``in_proj_qkvz`` / ``in_proj_ba`` cut into Qwen3.5's four projections: each
    part expands bitwise to the same cut of the dequantized fused weight (rows regrouped across
    partial 48-row blocks), float ``in_proj_ba`` beside FP8 ``in_proj_qkvz`` too."""
    cfg = hybrid_config({"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 72, "num_hidden_layers": 1,
                         "layer_types": ["linear_attention"], "num_attention_heads": 2, "num_key_value_heads": 1,
                         "head_dim": 16, "intermediate_size": 32, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 6, "linear_key_head_dim": 8, "linear_value_head_dim": 4})
    gen = torch.Generator().manual_seed(0)
    qkvz = torch.randn(2 * (2 * 8 + 2 * 3 * 4), 72, generator=gen)  # [Hk (2 Dk + 2 r Dv), H]: 80 rows
    ba = torch.randn(2 * 2 * 3, 72, generator=gen)  # [Hk 2 r, H]: 12 rows
    layers = [FP8BlockLinear.from_blocks(*quantize_blocks(w, *BLOCK), *BLOCK) for w in (qkvz, ba)]
    want = split_qwen3_next_projections(layers[0].rows(), layers[1].rows(), 2, 8, 6, 4)
    for ba_w, ba_fp8 in ((layers[1], True), (layers[1].rows(), False)):
        got = _split_rows(layers[0], ba_w, cfg)
        for part, w in want.items():
            fp8 = part in ("in_proj_qkv", "in_proj_z") or ba_fp8
            assert isinstance(got[part], FP8BlockLinear) == fp8
            assert torch.equal(got[part].rows() if fp8 else got[part], w), part
    assert not torch.equal(want["in_proj_z"], layers[0].rows()[-24:])  # per key head, not the last rows


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_fp8_deterministic_batch_invariance(kind, fp8_dirs):
    """Deterministic mode on FP8 weights: a request's bits do not depend on its companions, on a
    small budget cutting it into chunks, or on a shared 70-token context (shared up to 64)."""
    path = str(fp8_dirs[kind][0] / "fp8")
    rng = random.Random(3)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    ctx = tok(70)
    seqs = [{"prompt_token_ids": ctx, "completion_token_ids": tok(rng.randint(1, 20))} for _ in range(3)]
    seqs += [{"prompt_token_ids": tok(5), "completion_token_ids": tok(4)},
             {"prompt_token_ids": tok(20), "completion_token_ids": tok(140)}]
    one = Scorer(path, device="cpu", dtype="float32", config=EngineConfig(deterministic=True, share_prefixes=False,
                                                                            progress=False))
    alone = [one.logprobs([q])[0] for q in seqs]
    for budget in (64, 4096):
        one.config = EngineConfig(deterministic=True, share_prefixes=True, max_batch_tokens=budget, progress=False)
        for a, b in zip(alone, one.logprobs(seqs)):
            assert torch.equal(a.logprobs, b.logprobs), budget


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_vision_tower_fp8_weights_dequantized(kind, fp8_dirs):
    """The tower's FP8 weights (this checkpoint quantizes them) are read dequantized: float layers,
    and bitwise the tower of the float checkpoint holding those dequantized weights."""
    root = fp8_dirs[kind][0]
    fp8 = load_model(str(root / "fp8"), "cpu", "float32").model
    ref = load_model(str(root / "ref"), "cpu", "float32").model
    assert not any(isinstance(m, (FP8BlockLinear, ActQuantLinear)) for m in fp8.visual.modules())
    px = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fp8.encode_image(px, (1, 4, 4)), ref.encode_image(px, (1, 4, 4)))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_vision_tower_whole_on_a_tensor_parallel_rank(kind, fp8_dirs):
    """Rank 1 of 2 built from its own reading of the FP8 checkpoint (``hybrid_shard_tensors``; the
    MoE's experts split two ways) holds the whole tower, dequantized: its embeddings are bitwise
    those of the one-rank model (deterministic mode; the tower runs no collective)."""
    path = fp8_dirs[kind][0] / "fp8"
    raw = json.loads((path / "config.json").read_text())
    cfg = hybrid_config(raw)
    ctx = parallel_context(cfg, 1, 2, None, 2 if cfg.moe is not None else 1)
    rank = build_hybrid(cfg, hybrid_shard_tensors(path, cfg, ctx), torch.device("cpu"), torch.float32, ctx)
    one = load_model(str(path), "cpu", "float32").model
    assert not any(isinstance(m, (FP8BlockLinear, ActQuantLinear)) for m in rank.visual.modules())
    numerics = numerics_for(EngineConfig(deterministic=True), "cpu")
    px = torch.randn(32, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    for model in (rank, one):
        model.set_numerics(numerics)
    with torch.no_grad():
        assert torch.equal(rank.encode_image(px, (2, 4, 4)), one.encode_image(px, (2, 4, 4)))

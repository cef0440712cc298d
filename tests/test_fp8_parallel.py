"""FP8 block checkpoints (``loading.fp8_block``) under tensor and expert parallelism, gloo workers on CPU.

Five tiny random checkpoints rewritten the way DeepSeek ships FP8 (``tests/test_fp8_block.write_fp8``:
every projection and expert float8_e4m3fn with ``weight_scale_inv`` per block, norms, embeddings,
routers and lm_head float): Qwen3 dense, Qwen3-MoE, DeepSeek-V3 (latent attention, grouped sigmoid
routing, a dense first block, a shared expert), GLM-4.5 and MiniMax-M2. Blocks of 24 rows x 16
columns, so that rank ranges start and end inside blocks: q_proj's 128 rows split at 64 (block
48:72), an expert's 32 gate rows at 16 (block 0:24), o_proj's and down_proj's 64 output rows at 32
(block 24:48). A rank keeps each of its rows with its block row's scales, so such a split is exact.

* a rank reads its rows of each FP8 weight (and its experts only) and holds them as FP8 codes,
  equal to those rows of the one-process layer, codes and scales;
* TP = 2 (EP = 1: every expert's rows split; EP = 2: whole experts per rank; DeepSeek-V3 also
  TP = EP = 4: a head and two experts a rank) in deterministic mode:
  the raw bits of one process's log-probs, entropy, ranks and top-k; default mode within 1e-5;
* every rank's log-probs against the float64 forward of the dequantized weights (transformers,
  float64, its RMSNorm in float64): within ``TOL`` = 1e-5, at the options' temperature; the
  sigmoid routers' selection margins (the gap between the last expert or group kept and the
  first dropped, float64) asserted above 1e-5, so no near-tie decides a choice (the softmax
  router of Qwen3-MoE: a flipped choice would show far above 1e-5 against float64);
* a cut that is not whole rows of an FP8 weight is refused naming the tensor and the fix, other
  quantized checkpoints are still refused under tensor parallelism, and a weight update of a
  split FP8 model is refused (float tensors cannot be written into FP8 rows exactly).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ref_logprobs, tiny_config

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear
from logprobe.loading.hf import read_config
from logprobe.loading.loader import describe_model, parallel_context

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from test_fp8_block import _proj, _sequences, write_fp8  # noqa: E402
from test_moe_parallel import OPTS, _bits_equal  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK = (24, 16)
TOL = 1e-5
MIN_MARGIN = 1e-5  # router selection gaps kept above this (float32 rounding of the scores is ~1e-7)
SIZES = {"qwen3": [(2, 1)], "qwen3_moe": [(2, 1), (2, 2)], "deepseek_v3": [(2, 1), (2, 2), (4, 4)],
         "glm4_moe": [(2, 1), (2, 2)], "minimax_m2": [(2, 1), (2, 2)]}


def _make(kind: str):
    """(float32 transformers model, its RMSNorm classes to run in float64 for the reference)."""
    if kind == "qwen3":
        return transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="eager"), ()
    if kind == "qwen3_moe":
        from test_moe import moe_config

        return transformers.AutoModelForCausalLM.from_config(
            moe_config("qwen3_moe"), attn_implementation="eager", experts_implementation="eager"), ()
    if kind == "deepseek_v3":
        import test_deepseek

        model = test_deepseek.make_model("qlora")
        test_deepseek._randomise(model, seed=0)
        return model, (test_deepseek.hfds.DeepseekV3RMSNorm,)
    import test_moe_sigmoid_families as sig

    model = sig.make_model(kind)
    sig._randomise(model, seed=sig.SEEDS[kind])
    return model, (sig.hfglm.Glm4MoeRMSNorm, sig.hfmm.MiniMaxM2RMSNorm)


def _norm64(self, x):
    x = x.double()
    return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """kind -> (FP8 checkpoint dir, float64 transformers model of its dequantized weights)."""
    mp = pytest.MonkeyPatch()
    out = {}
    for kind in SIZES:
        root = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        model, norms = _make(kind)
        for cls in norms:
            mp.setattr(cls, "forward", _norm64)
        model.float().eval().save_pretrained(str(root / "float"))
        write_fp8(root / "float", root / "fp8", root / "ref", BLOCK, ["lm_head"],
                  lambda key: _proj(key) or ".experts." in key)
        ref = type(model).from_pretrained(str(root / "ref"), dtype=torch.float64, attn_implementation="eager",
                                          **({} if kind == "qwen3" else {"experts_implementation": "eager"})).eval()
        out[kind] = (root / "fp8", ref)
    yield out
    mp.undo()


def _float64(kind: str, ref, ids: list[int]) -> tuple[torch.Tensor, float]:
    """(float64 log-probs [L, V] at the options' temperature, the smallest router selection margin
    over the scored rows: inf for the softmax router)."""
    import test_deepseek
    import test_moe_sigmoid_families as sig

    margin, hi = float("inf"), len(ids) - 1
    if kind == "deepseek_v3":
        lp, routers = test_deepseek._reference(ref, ids)
        margin = min(test_deepseek._routing_stats(lg, b, c, hi)[0] for lg, b, c in routers)
    elif kind in sig.GROUPS:
        lp, routers = sig._reference(ref, ids)
        margin = min(sig._routing_stats(lg, b, c, hi, sig.GROUPS[kind])[0] for lg, b, c in routers)
    else:
        lp = ref_logprobs(ref, ids)
    return torch.log_softmax(lp / OPTS["temperature"], dim=-1), margin  # log_softmax(logits / T)


def _float64_worst(kind: str, results, ref, seqs) -> tuple[float, float]:
    """(max |log-prob - float64| over the completions, the smallest router margin met)."""
    worst, margin = 0.0, float("inf")
    for seq, res in zip(seqs, results):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        lp, m = _float64(kind, ref, ids)
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst, margin = max(worst, (res.logprobs.double() - tgt).abs().max().item()), min(margin, m)
    return worst, margin


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per size (~10-20 s each)
@pytest.mark.parametrize("kind", list(SIZES))
def test_fp8_tp_and_ep_equal_one_process(kind, fp8_dirs):
    path, ref = fp8_dirs[kind]
    seqs = _sequences()
    one = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det, progress=False)
        want[det] = one.logprobs(seqs, **OPTS)
    for tp, ep in SIZES[kind]:
        with Scorer(str(path), device="cpu", dtype="float32", progress=False, tensor_parallel_size=tp,
                    expert_parallel_size=ep) as s:
            for det in (True, False):
                s.config = EngineConfig(deterministic=det, progress=False)
                got = s.logprobs(seqs, **OPTS)
                worst, margin = _float64_worst(kind, got, ref, seqs)
                print(f"{kind} fp8 TP={tp} EP={ep} deterministic={det}: max |delta| vs float64 {worst:.2e}, "
                      f"router margin {margin:.2e}")
                assert worst <= TOL and margin > MIN_MARGIN, (kind, tp, ep, det, worst, margin)
                if det:
                    assert _bits_equal(got, want[det]), (kind, tp, ep)
                    continue
                delta = max((x.logprobs - y.logprobs).abs().max().item() for x, y in zip(got, want[det]))
                assert delta <= 1e-5, (kind, tp, ep, delta)
                assert all(torch.equal(x.topk_ids, y.topk_ids) for x, y in zip(got, want[det]))
            if kind == "qwen3":  # float tensors for its FP8 layers: refused on the driver, nothing written
                with pytest.raises(LogprobeError, match="as FP8 blocks"):
                    s.update_weights(load_file(str(path.parent / "ref" / "model.safetensors")))


def _stream(kind, path, cfg, raw, model=None):
    """(name, tensor or FP8 layer) as the loader reads them: whole, or as rank ``model`` cuts them."""
    from logprobe.loading.deepseek import deepseek_tensors
    from logprobe.loading.hf import hf_tensors
    from logprobe.loading.sharding import fp8_shard_tensors, held_experts, rank_cut
    from logprobe.loading.sigmoid_moe import sigmoid_moe_tensors

    if kind.startswith("qwen3"):
        return hf_tensors(path, cfg, raw, packed=True) if model is None else \
            fp8_shard_tensors(path, cfg, None, raw, model)
    read = deepseek_tensors if kind == "deepseek_v3" else sigmoid_moe_tensors
    if model is None:
        return read(path, cfg, raw)
    return read(path, cfg, raw, cut=lambda name: rank_cut(model, name), held=held_experts(model))


@pytest.mark.parametrize("kind, ep", [("qwen3", 1), ("qwen3_moe", 1), ("qwen3_moe", 2), ("deepseek_v3", 1),
                                      ("glm4_moe", 2), ("minimax_m2", 1)])
def test_rank_reads_its_fp8_rows(kind, ep, fp8_dirs):
    """Rank 1 of 2 reads FP8 codes and per-row scales equal to its rows of the whole layers (and
    its experts only) for every FP8 module, and every float tensor as the float reader cuts it;
    row ranges that start or end inside a block of 24 rows included."""
    from logprobe.layers.parallel_linear import held_ranges

    path, _ = fp8_dirs[kind]
    raw = read_config(path)
    meta = describe_model(str(path), "cpu").model
    cfg = meta.config
    with torch.device("meta"):
        rank = type(meta)(cfg, ctx=parallel_context(cfg, 1, 2, None, ep))
    whole = dict(_stream(kind, path, cfg, raw))
    got = dict(_stream(kind, path, cfg, raw, rank))
    assert got.keys() == whole.keys()
    fp8, inside = 0, 0
    for name, m in got.items():
        w = whole[name]
        if isinstance(m, FP8BlockExperts):
            experts, _, proj = name.rpartition(".")
            (e0, e1), (a, b) = rank.get_submodule(experts).held(proj)
            pairs = [(m.qweight, w.qweight[e0:e1, a:b]), (m.scale, w.scale[e0:e1, a:b])]
            inside += a % BLOCK[0] != 0 or b % BLOCK[0] != 0
        elif isinstance(m, FP8BlockLinear):
            ranges = held_ranges(rank, name) or ((0, w.out_features),)
            idx = torch.cat([torch.arange(a, b) for a, b in ranges])
            pairs = [(m.qweight, w.qweight[idx]), (m.scale, w.scale[idx])]
            inside += any(a % BLOCK[0] != 0 or b % BLOCK[0] != 0 for a, b in ranges)
        else:
            ranges = held_ranges(rank, name) if not name.rpartition(".")[0].endswith("experts") else None
            if ranges is not None:
                w = torch.cat([w[a:b] for a, b in ranges])
            pairs = [(m, w)] if ranges is not None or m.shape == w.shape else []
            assert pairs, name
        if isinstance(m, (FP8BlockLinear, FP8BlockExperts)):
            fp8 += 1
            assert m.qweight.dtype == FP8, name
            pairs[0] = (pairs[0][0].view(torch.uint8), pairs[0][1].view(torch.uint8))
        for a, b in pairs:
            assert torch.equal(a, b), name
    assert fp8 > 0 and inside > 0  # some rank ranges start or end inside a block


def test_cut_not_whole_rows_refused(fp8_dirs):
    """The reader takes whole rows of an FP8 weight; a cut of its columns (its scale blocks) is
    refused naming the tensor and the fix, not read with the wrong scales."""
    from safetensors import safe_open

    from logprobe.loading.fp8_block import fp8_rows, fp8_scheme, scale_rows

    path, _ = fp8_dirs["qwen3"]
    scheme = fp8_scheme(read_config(path)["quantization_config"])
    key = "model.layers.0.self_attn.q_proj.weight"
    f = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(path / f), framework="pt") as st:
        codes, part = fp8_rows(st, key, lambda t: t[40:88], scheme)  # rows 40:88 cut blocks 24:48, 72:96: fine
        assert codes.shape == (48, 64) and part.rows.tolist() == list(range(40, 88)) and part.shape == (128, 64)
        scale, blocks = scale_rows(st, key + "_scale_inv", lambda t: t[40:88], scheme)
        assert (blocks.first_block, blocks.scale_shape, scale.shape) == (1, (6, 4), (3, 4))  # block rows 1..3 of 6
        assert torch.equal(scale, st.get_tensor(key + "_scale_inv")[1:4])
        with pytest.raises(LogprobeError, match="q_proj.weight.*not whole rows") as e:
            fp8_rows(st, key, lambda t: t[:, :32], scheme)
    assert e.value.field == "quantization_config" and "tensor_parallel_size" in str(e.value)


def test_other_quantized_checkpoints_still_refused_under_tp(fp8_dirs, tmp_path):
    import shutil

    from logprobe.loading.loader import load_shard
    from logprobe.parallel.context import ParallelContext

    src, _ = fp8_dirs["qwen3"]
    d = tmp_path / "gptq"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LogprobeError, match="quantized checkpoint") as e:
        load_shard(str(d), ParallelContext(0, 2), device="cpu", dtype="float32")
    assert e.value.field == "tensor_parallel_size"


def test_gathered_row_layers_stay_fp8_and_gather(fp8_dirs):
    """A rank's o_proj / down_proj (gathered-row layers) are FP8 layers that gather as the float
    layer does, holding their share of the output rows."""
    from logprobe.loading.loader import load_shard

    path, _ = fp8_dirs["deepseek_v3"]
    cfg = describe_model(str(path), "cpu").model.config
    rank = load_shard(str(path), parallel_context(cfg, 1, 2, None, 1), device="cpu", dtype="float32").model
    for m in (rank.layers[1].self_attn.o_proj, rank.layers[0].mlp.down_proj):
        assert isinstance(m, FP8BlockLinear) and m.tp_gather is not None and m.out_features == 32
    assert rank.layers[1].self_attn.q_b_proj.out_features == 2 * (16 + 8)  # two of the four heads

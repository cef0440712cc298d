"""gpt-oss (``models.gpt_oss``, ``layers.moe_gpt_oss``, ``kernels.mxfp4``, ``loading.gpt_oss``)
against float64 transformers.

A tiny random ``GptOssForCausalLM`` saved by transformers itself (the float layout), with sliding
blocks of window 12 (shorter than the test sequences) beside a full block, YaRN rotary (factor 4,
original length 64, shorter than the sequences too), random sinks (std 1), random biases
everywhere, and ``swiglu_limit`` 1 so the clamps bite. A second checkpoint takes the same weights
with the experts written as the hub ships MXFP4 (random ``*_blocks`` / ``*_scales``, alternating
gate/up rows, ``quantization_config.quant_method = "mxfp4"``); its reference is transformers' model
with the experts set to the blocks dequantized by this file's own decoder of the format
(``_decode_mxfp4``, checked against transformers' ``convert_moe_packed_tensors``).

The reference runs in float64 (its ``GptOssRMSNorm``, which casts to float32 inside, replaced by the
same function in float64); ours in float32 through ``Scorer``: per-token log-probs within 1e-4.
"""

from __future__ import annotations

import json
import random
import shutil
import textwrap

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, run_interpreted

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.scheduler import Chunk, plan_work
from logprobe.kernels.mxfp4 import dequantize_mxfp4, gpt_oss_experts
from logprobe.layers.attention import AttentionMeta, packed_attention
from logprobe.layers.attention_gpu import sink_rescale
from logprobe.layers.moe_gpt_oss import Mxfp4Experts
from logprobe.loading import load_model
from logprobe.loading.gpt_oss import gpt_oss_config

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss as hfo  # noqa: E402

TOL = 1e-4
WINDOW = 12
SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              layer_types=[SLIDING, FULL, SLIDING], max_position_embeddings=512, swiglu_limit=1.0,
              rope_parameters=ROPE, bos_token_id=1, eos_token_id=0, pad_token_id=0)


def _norm64(self, x):
    """transformers' GptOssRMSNorm in float64 (its ``.to(torch.float32)`` would round)."""
    x = x.double()
    return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The OCP MXFP4 format, decoded bit by bit in float64 (independent of ``kernels.mxfp4``):
    byte j of a 16-byte block holds element 2j in its low nibble and 2j + 1 in its high one; a
    nibble is sign | 2 exponent bits | 1 mantissa bit (E2M1, bias 1); the block's byte scale is
    2^(s - 127). [..., G, 16], [..., G] -> [..., G * 32]."""
    b = blocks.long()
    nib = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)  # [..., G, 32]
    sign = torch.where(nib & 8 > 0, -1.0, 1.0).double()
    exp, man = (nib >> 1) & 3, (nib & 1).double()
    mag = torch.where(exp == 0, man / 2, (1 + man / 2) * torch.pow(2.0, (exp - 1).double()))
    return (sign * mag * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


def _model():
    cfg = transformers.GptOssConfig(**CONFIG)
    return transformers.GptOssForCausalLM._from_config(cfg, attn_implementation="eager",
                                                       experts_implementation="eager")


def _mxfp4_dir(dense_dir, out_dir, gen) -> dict[str, torch.Tensor]:
    """``dense_dir``'s checkpoint with every expert matrix replaced by random MXFP4 blocks, as the hub
    lays them out; returns the transformers-layout float64 expert weights they decode to."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(dense_dir / "model.safetensors"))
    experts = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, inner, out = state.pop(name).shape  # transformers' x @ W layout [E, in, out]
        blocks = torch.randint(0, 256, (E, out, inner // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 125, (E, out, inner // 32), generator=gen, dtype=torch.uint8)
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        experts[name] = _decode_mxfp4(blocks, scales).transpose(1, 2)  # [E, in, out]
    shutil.copytree(dense_dir, out_dir, dirs_exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(raw))
    return experts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfo.GptOssRMSNorm, "forward", _norm64)
    d = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = _model().float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if name.endswith("sinks") else 0.3 if p.dim() == 1 else 0.1
            p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))
    mx = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    experts = _mxfp4_dir(d, mx, gen)
    ref_mx = _model().double().eval()
    ref_mx.load_state_dict(model.double().state_dict())
    with torch.no_grad():
        for name, w in experts.items():
            ref_mx.get_parameter(name).copy_(w)
    yield {"dense": (d, model.double()), "mxfp4": (mx, ref_mx), "experts": experts}
    mp.undo()


def _reference(model, ids: list[int]) -> torch.Tensor:
    experts = model.model.layers[0].mlp.experts
    # the checkpoint's values as logprobe's loader reads them (transformers 5.17's config object has
    # no swiglu_alpha attribute at all)
    if (experts.limit, experts.alpha) != (CONFIG["swiglu_limit"], CONFIG.get("swiglu_alpha", 1.702)):
        # transformers before it read swiglu_alpha / swiglu_limit from the config (5.17 hard-codes
        # 1.702 and 7.0) is not the reference of a checkpoint that sets them
        pytest.skip(f"this transformers ignores the config's swiglu_limit ({experts.limit} != {CONFIG['swiglu_limit']})")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _sequences() -> list[dict]:
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    return [{"prompt_token_ids": tok(p), "completion_token_ids": tok(c)} for p, c in ((10, 30), (25, 55), (1, 119),
                                                                                        (60, 40))]


def _worst(scorer, ref, seqs) -> tuple[float, int]:
    worst, n = 0.0, 0
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo = len(seq["prompt_token_ids"]) - 1
        tgt = _reference(ref, ids)[lo:len(ids) - 1].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        n += len(tgt)
    return worst, n


def test_logprobs_match_float64_transformers_and_sinks_window_matter(dirs):
    path, ref = dirs["dense"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == "GptOssModel"
    cfg = scorer.loaded.model.config
    assert cfg.sliding_window == WINDOW and cfg.rope_scaling["rope_type"] == "yarn" and cfg.swiglu_limit == 1.0
    seqs = _sequences()
    worst, n = _worst(scorer, ref, seqs)
    print(f"gpt_oss float: max |delta| {worst:.2e} over {n} tokens")
    assert n > 200 and worst < TOL, f"max |delta log-prob| {worst:.2e}"
    # the window, the sinks and the YaRN scaling each matter: the reference without them is far
    attn = [layer.self_attn for layer in ref.model.layers]
    sinks = [a.sinks.data.clone() for a in attn]
    ref.config.sliding_window = 1000
    try:
        wide, _ = _worst(scorer, ref, seqs)
    finally:
        ref.config.sliding_window = WINDOW
    try:
        for a in attn:
            a.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink
        no_sinks, _ = _worst(scorer, ref, seqs)
    finally:
        for a, s in zip(attn, sinks):
            a.sinks.data.copy_(s)
    print(f"without the window {wide:.2e}, without sinks {no_sinks:.2e}")
    assert wide > 1e-2 and no_sinks > 1e-2
    assert _worst(scorer, ref, seqs)[0] < TOL  # restored


def test_mxfp4_checkpoint_stays_packed_and_matches(dirs):
    path, ref = dirs["mxfp4"]
    loaded = load_model(str(path), "cpu", "float32")
    model = loaded.model
    packed = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(packed) == 2 * 3 and all(m.blocks.dtype == torch.uint8 and m.scales.dtype == torch.uint8
                                        for m in packed)
    assert not any(p.dtype == torch.float32 and p.dim() == 3 for p in model.parameters())  # no dense experts
    scorer = Scorer(loaded, progress=False)
    seqs = _sequences()
    worst, n = _worst(scorer, ref, seqs)
    print(f"gpt_oss mxfp4: max |delta| {worst:.2e} over {n} tokens")
    assert n > 200 and worst < TOL
    # expanded once at load: the same numbers, bitwise
    dense = Scorer(load_model(str(path), "cpu", "float32", weights="dense"), progress=False)
    assert not any(isinstance(m, Mxfp4Experts) for m in dense.loaded.model.modules())
    for a, b in zip(scorer.logprobs(seqs), dense.logprobs(seqs)):
        assert torch.equal(a.logprobs, b.logprobs)


def test_dequantize_matches_the_format_and_transformers(dirs):
    """``kernels.mxfp4.dequantize_mxfp4`` = this file's decoder = transformers' own, bitwise, on
    every byte value and a wide range of scales (subnormal 2^-127 to 2^125)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble code, in both halves of a byte
    scales = torch.randint(0, 253, (3, 5, 4), generator=g, dtype=torch.uint8)  # 6 * 2^126 is past float32
    scales[0, 0, :3] = torch.tensor([0, 252, 127])
    ours = dequantize_mxfp4(blocks, scales)  # [3, 5, 128] float32
    assert torch.equal(ours.double(), _decode_mxfp4(blocks, scales))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 5]: x @ W layout
    assert torch.equal(ours, theirs.transpose(1, 2))
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert ours[0, 0, 64:96:2].tolist() == table and ours[0, 0, 65:96:2].tolist() == table  # scale 2^0
    assert ours[0, 0, 2].item() == 2.0 ** -128 and ours[0, 0, 63].item() == -6.0 * 2.0 ** 125
    with pytest.raises(LogprobeError, match="255"):
        from logprobe.kernels.mxfp4 import check_scales
        check_scales(torch.tensor([1, 255], dtype=torch.uint8), "x")


def _mix(seed: int) -> list[ScoreRequest]:
    """Groups sharing a context longer than the window, long requests that chunk, duplicates,
    partial score windows and mixed head options."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = []
    for n_ctx in (50, 70, 20):
        ctx = tok(n_ctx)
        for _ in range(3):
            cont = tok(rng.randint(1, 40))
            sb = len(ctx) if rng.random() < 0.6 else rng.randint(1, len(ctx) + len(cont) - 1)
            reqs.append(ScoreRequest(ctx + cont, sb, temperature=rng.choice([1.0, 0.7]), top_k=rng.choice([0, 3]),
                                     entropy=rng.random() < 0.3))
    for n in (120, 90, 5):
        t = tok(n)
        reqs.append(ScoreRequest(t, rng.randint(1, n - 1)))
    reqs.append(ScoreRequest(list(reqs[0].tokens), reqs[0].score_begin))
    return reqs


@pytest.mark.parametrize("kind", ["dense", "mxfp4"])
def test_chunks_and_shared_prefixes_bitwise(kind, dirs):
    """Deterministic mode: each request alone is the float64 reference (to 1e-4); packed with
    shared prefixes longer than the window and cut into chunks by small budgets it keeps its bits."""
    path, ref = dirs[kind]
    loaded = load_model(str(path), "cpu", "float32")
    reqs = _mix(3)
    alone_scorer = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [alone_scorer.engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):
        lp = torch.log_softmax(_reference(ref, r.tokens) / r.temperature, -1)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < TOL
    rng = random.Random(1)
    for budget in (64, 100, 1 << 20):
        for share in (True, False):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=share)
            out = Scorer(loaded, config=cfg).engine.run([reqs[i] for i in order])
            for i, res in zip(order, out):
                for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                    x, y = getattr(alone[i], name), getattr(res, name)
                    assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (budget, share, name)
    inputs = [r.tokens[:-1] for r in reqs]
    shared = [t for b in plan_work(inputs, 1 << 20) for t in b if getattr(t, "shared", 0)]
    assert shared and max(t.shared for t in shared) > WINDOW  # a shared prefix longer than the window
    assert any(isinstance(b[0], Chunk) and b[0].begin > WINDOW for b in plan_work(inputs, 64))


def test_sink_attention_kernels_agree():
    """The three sink paths against a float64 softmax with the sink column: SDPA with a sink key
    (default), the tiled kernel (deterministic), and the CUDA path's log-sum-exp rescale."""
    g = torch.Generator().manual_seed(0)
    n, c, Hq, Hkv, D = 37, 20, 4, 2, 16
    q = torch.randn(n, Hq, D, generator=g)
    k, v = torch.randn(c + n, Hkv, D, generator=g), torch.randn(c + n, Hkv, D, generator=g)
    sinks = 2 * torch.randn(Hq, generator=g)
    for window in (None, 8):
        kk, vv = (x.double().repeat_interleave(Hq // Hkv, 1) for x in (k, v))
        s = torch.einsum("nhd,mhd->hnm", q.double(), kk) * 0.25
        qi, kj = torch.arange(c, c + n)[:, None], torch.arange(c + n)[None]
        visible = (kj <= qi) & ((qi - kj < window) if window else True)
        s = s.masked_fill(~visible, -torch.inf)
        lse = torch.logsumexp(s, -1).t()  # [n, Hq]
        no_sink = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vv)
        full = torch.softmax(torch.cat([s, sinks.double().view(Hq, 1, 1).expand(Hq, n, 1)], -1), -1)[..., :-1]
        want = torch.einsum("hnm,mhd->nhd", full, vv)
        for kv_block in (None, 16):
            meta = AttentionMeta.packed([c + n], kv_block=kv_block)
            qq = torch.cat([torch.zeros(c, Hq, D), q])  # the first c rows are queries too; compare the last n
            got = packed_attention(qq, k, v, meta, 0, 0.25, window, sinks)[c:]
            assert (got.double() - want).abs().max() < 1e-5, (window, kv_block)
        assert (sink_rescale(no_sink, lse, sinks.double()) - want).abs().max() < 1e-6
        assert (no_sink - want).abs().max() > 1e-2  # the sinks matter here


def test_config_refusals_name_the_key(dirs):
    raw = json.loads((dirs["dense"][0] / "config.json").read_text())
    cases = [("quantization_config", {"quant_method": "fp8"}, "quantization_config.quant_method"),
             ("rope_parameters", dict(ROPE, rope_type="linear"), "config.rope_parameters.rope_type"),
             ("sliding_window", None, "config.sliding_window"),
             ("layer_types", [SLIDING, "chunked_attention", FULL], "config.layer_types"),
             ("num_experts_per_tok", 9, "config.num_experts_per_tok")]
    for key, value, field in cases:
        with pytest.raises(LogprobeError) as e:
            gpt_oss_config(dict(raw, **{key: value}))
        assert e.value.field == field, (key, e.value.field)
    bad = dict(ROPE)
    del bad["factor"]
    with pytest.raises(LogprobeError, match="factor"):
        gpt_oss_config(dict(raw, rope_parameters=bad))
    hub = dict(raw)  # the hub's spelling: rope_scaling + rope_theta
    hub["rope_scaling"] = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    hub["rope_theta"] = 10000.0
    del hub["rope_parameters"]
    assert gpt_oss_config(hub).rope_scaling == gpt_oss_config(raw).rope_scaling


def test_router_capture_and_indivisible_tensor_parallel_refused(dirs):
    path, _ = dirs["dense"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 30)), "completion_token_ids": list(range(30, 40))}
    res = scorer.logprobs([seq], capture=[{"at": "blocks.1.router", "positions": "all"}])[0]
    p = res.captures[0].value  # [T, E]: the chosen experts' weights, zero elsewhere
    assert p.shape[1] == 4 and torch.allclose(p.sum(-1), torch.ones(p.shape[0])) and ((p > 0).sum(-1) == 2).all()
    from logprobe.loading.loader import parallel_context
    assert parallel_context(scorer.loaded.model.config, 1, 2).size == 2  # tests/test_tp_families.py
    with pytest.raises(LogprobeError, match="tensor_parallel_size"):
        parallel_context(scorer.loaded.model.config, 0, 3)


KERNEL_SETUP = """
    import json, torch
    from logprobe.kernels.moe import MoeKernelConfig
    from logprobe.kernels.mxfp4 import dequantize_mxfp4, expand_mxfp4, gpt_oss_experts, gpt_oss_experts_reference
    g = torch.Generator().manual_seed(0)
    E, I, H, T, k = 4, 64, 96, 37, 2
    def rnd(out, inner):
        return (torch.randint(0, 256, (E, out, inner // 32, 16), generator=g, dtype=torch.uint8),
                torch.randint(118, 124, (E, out, inner // 32), generator=g, dtype=torch.uint8))
    w13, w2 = rnd(2 * I, H), rnd(H, I)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    d13, d2 = dequantize_mxfp4(*w13), dequantize_mxfp4(*w2)
    cfg = MoeKernelConfig(block_m=16, block_n=32, block_k=64)
    y = gpt_oss_experts(x, ids, w13, b13, w2, b2, 1.702, 1.5, cfg)
    out = {}
"""


def test_mxfp4_kernel_interpreted():
    """The Triton expert kernel under the CPU interpreter (partial tiles on every side: H = 96 with
    block_k 64, T = 37 with block_m 16): packed MXFP4 and dense weights against the PyTorch
    definition on the weights ``dequantize_mxfp4`` gives, and a token's bits the same alone."""
    code = textwrap.dedent(KERNEL_SETUP) + textwrap.dedent("""
        ref = gpt_oss_experts_reference(x.double(), ids, d13.double(), b13.double(), d2.double(), b2.double(),
                                        1.702, 1.5)
        out["scale"] = float(ref.abs().max())
        out["packed"] = float((y.double() - ref).abs().max() / ref.abs().max())
        yd = gpt_oss_experts(x, ids, d13, b13, d2, b2, 1.702, 1.5, cfg)
        out["dense_equal"] = bool(torch.equal(y, yd))
        y16 = gpt_oss_experts(x.half(), ids, w13, b13.half(), w2, b2.half(), 1.702, 1.5, cfg)
        out["half"] = float((y16.double() - ref).abs().max() / ref.abs().max())
        few = gpt_oss_experts(x[:9].clone(), ids[:9].clone(), w13, b13, w2, b2, 1.702, 1.5, cfg)
        out["invariant"] = bool(torch.equal(few, y[: 9 * k]))
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["scale"] > 0.5 and out["packed"] < 1e-6 and out["half"] < 5e-3, out
    assert out["dense_equal"] and out["invariant"], out


@pytest.mark.slow  # Triton's interpreter in a fresh process, four more kernel calls
def test_mxfp4_expansion_interpreted():
    """``expand_mxfp4`` stores exactly ``dequantize_mxfp4``'s values in each float dtype, and the
    experts run a part at a time on their expanded weights (ids minus the part's first expert,
    one ``out`` buffer, every row first NaN) give the packed call's bits."""
    code = textwrap.dedent(KERNEL_SETUP) + textwrap.dedent("""
        out["expanded"] = all(torch.equal(expand_mxfp4(*w, dt), d.to(dt)) for w, d in ((w13, d13), (w2, d2))
                              for dt in (torch.float32, torch.float16, torch.bfloat16))
        runs = torch.full_like(y, float("nan"))
        for first, last in ((0, 1), (1, 3), (3, 4)):
            part = lambda w: expand_mxfp4(w[0][first:last], w[1][first:last], torch.float32)
            gpt_oss_experts(x, ids - first, part(w13), b13[first:last], part(w2), b2[first:last], 1.702, 1.5, cfg,
                            out=runs)
        out["runs_equal"] = bool(torch.equal(runs, y))
        print(json.dumps(out))
    """)
    r = run_interpreted(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"expanded": True, "runs_equal": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_expanded_runs_equal_packed(dtype):
    """A large pass expands the MXFP4 experts first (``GptOssExperts.expand_runs``), in runs when
    they exceed ``STACK_BYTES``: every slot bitwise the packed kernel's, and the dense twin's."""
    from logprobe.layers.moe_gpt_oss import GptOssExperts, GptOssMoeSpec

    g = torch.Generator().manual_seed(3)
    E, inter, H, T, k = 8, 128, 192, 700, 4
    e = GptOssExperts(GptOssMoeSpec(E, k, inter), H)
    for name, out, inner in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
        e.set_packed(name, Mxfp4Experts(torch.randint(0, 256, (E, out, inner // 32, 16), generator=g, dtype=torch.uint8),
                                        torch.randint(118, 124, (E, out, inner // 32), generator=g, dtype=torch.uint8)))
    e.gate_up_proj_bias.copy_(torch.randn(E, 2 * inter, generator=g))
    e.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    e = e.cuda()
    x = torch.randn(T, H, generator=g).to("cuda", dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).cuda()
    e.EXPAND_SLOTS = 10**9
    packed = e.fused(x, ids)
    e.EXPAND_SLOTS = 1
    assert e.expand_runs(dtype, ids.numel()) == [(0, E)]
    whole = e.fused(x, ids)
    e.STACK_BYTES = 3 * (2 * inter * H + H * inter) * dtype.itemsize
    assert len(e.expand_runs(dtype, ids.numel())) == 3
    parts = e.fused(x, ids)
    dense = [e.dense(n, dtype, 0, E) for n in ("gate_up_proj", "down_proj")]
    twin = gpt_oss_experts(x, ids, dense[0], e.gate_up_proj_bias.to(dtype), dense[1], e.down_proj_bias.to(dtype),
                           e.alpha, e.limit)
    assert torch.equal(packed, whole) and torch.equal(packed, parts) and torch.equal(packed, twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_and_packed_equals_dense(dirs):
    """On CUDA (the Triton expert kernel, FlashAttention with the sink rescale in bf16): float32
    within 1e-4 of the CPU, bf16 close to it, MXFP4 packed bitwise its dense twin (the kernel
    decodes to the same bf16 values), and deterministic mode's chunks bitwise a request alone."""
    path, _ = dirs["mxfp4"]
    seqs = _sequences()
    cpu = [r.logprobs for r in Scorer(str(path), device="cpu", dtype="float32", progress=False).logprobs(seqs)]
    got = {}
    for dtype in ("float32", "bfloat16"):
        for weights in ("packed", "dense"):
            scorer = Scorer(load_model(str(path), "cuda", dtype, weights=weights), progress=False)
            got[dtype, weights] = [r.logprobs.cpu() for r in scorer.logprobs(seqs)]
    for a, b in zip(cpu, got["float32", "packed"]):
        assert (a.double() - b.double()).abs().max() < TOL
    for a, b in zip(cpu, got["bfloat16", "packed"]):
        assert (a.double() - b.double()).abs().max() < 0.1
    for dtype in ("float32", "bfloat16"):
        assert all(torch.equal(a, b) for a, b in zip(got[dtype, "packed"], got[dtype, "dense"])), dtype
    loaded = load_model(str(path), "cuda", "bfloat16")
    reqs = _mix(3)
    alone = [Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False)).engine.run([r])[0]
             for r in reqs]
    out = Scorer(loaded, config=EngineConfig(max_batch_tokens=64, deterministic=True)).engine.run(reqs)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, out))

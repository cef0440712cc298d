"""Tensor parallelism for GLM-4 dense, Gemma 4 and gpt-oss: worker processes over gloo on CPU,
TP = 2 against TP = 1, on the tiny random checkpoints of ``test_glm4``, ``test_gemma4`` and
``test_gpt_oss`` (their fixtures, imported).

* GLM-4: 4 query heads, 2 kv heads with q/k/v biases, fused gate_up split at load then cut.
* Gemma 4 text: sliding blocks (head_dim 12, 2 kv heads) beside full blocks (head_dim 16, one kv
  head: replicated at TP = 2) with keys as values, per-layer embeddings (ple_dim 8: 4 columns a
  rank), two KV-shared blocks with double-wide MLPs; the multimodal checkpoint's text tower.
* gpt-oss: 4 query heads with their sinks, biases on q/k/v and o_proj; experts whole on every rank,
  or two of the four a rank (expert_parallel_size 2); float and MXFP4 experts.

Deterministic mode: the raw bits equal TP = 1's (log-probs, entropy, ranks, top-k); default mode
within 1e-5, and TP = 2 within 1e-4 of the float64 transformers forward; chunks and shared
prefixes at TP = 2 bitwise each request alone at TP = 1. A rank reads only its
rows (sinks and biases with their heads, ple columns, kv heads replicated where fewer than the
ranks). Sizes that do not split a piece are refused, naming it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import VOCAB
from test_gemma4 import _reference as gemma4_reference
from test_gemma4 import gemma4_dirs  # noqa: F401  (a fixture)
from test_glm4 import _reference as glm4_reference
from test_glm4 import glm4_dir  # noqa: F401  (a fixture)
from test_gpt_oss import _reference as gpt_oss_reference
from test_gpt_oss import dirs  # noqa: F401  (a fixture)

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading.hf import read_config
from logprobe.loading.loader import default_expert_parallel, parallel_context
from logprobe.models.gemma4 import Gemma4Config
from logprobe.models.glm4 import Glm4Config
from logprobe.models.gpt_oss import GptOssConfig

OPTS = dict(temperature=0.7, top_k=5, entropy=True)
FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")
KINDS = ["glm4", "gemma4_text", "gemma4", "gpt_oss", "gpt_oss_mxfp4", "gpt_oss_ep", "gpt_oss_mxfp4_ep",
         "gpt_oss_mxfp4_ep_heads"]


def _checkpoint(kind, request):
    """(directory, float64 transformers reference model, its log-prob function) of ``kind``."""
    if kind == "glm4":
        path, ref = request.getfixturevalue("glm4_dir")
        return path, ref, glm4_reference
    if kind.startswith("gemma4"):
        path, ref = request.getfixturevalue("gemma4_dirs")[kind]
        return path, ref, gemma4_reference
    path, ref = request.getfixturevalue("dirs")["mxfp4" if "mxfp4" in kind else "dense"]
    return path, ref, gpt_oss_reference


def _seqs() -> list[dict]:
    import random

    rng = random.Random(7)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    shared = tok(40)  # two completions of one prompt: a shared prefix longer than the windows
    return [{"prompt_token_ids": tok(p), "completion_token_ids": tok(c)} for p, c in ((10, 30), (1, 60), (25, 5))] + [
        {"prompt_token_ids": shared, "completion_token_ids": tok(9)},
        {"prompt_token_ids": shared, "completion_token_ids": tok(14)}]


def _bits_equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return len(a) == len(b) and all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


def _worst_vs_float64(got, seqs, ref, reference) -> float:
    """Max |log-prob - float64 transformers| at temperature 1 (``got`` scored without options)."""
    worst = 0.0
    for seq, res in zip(seqs, got):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo = len(seq["prompt_token_ids"]) - 1
        want = reference(ref, ids)[lo:len(ids) - 1].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - want).abs().max().item())
    return worst


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per checkpoint (~15 s each)
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_tp1(kind, request):
    """gpt-oss with expert_parallel_size 1 (every expert on both ranks) and ``*_ep`` with the default,
    2 (two experts a rank; attention data-parallel, ``*_heads``: split by heads)."""
    path, ref, reference = _checkpoint(kind, request)
    seqs = _seqs()
    one = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det)
        want[det] = one.logprobs(seqs, **OPTS)
    ep = {} if kind.endswith("_ep") else dict(expert_parallel_size=1)  # the default: two experts a rank
    if kind.endswith("_heads"):
        ep = dict(attention_parallel="tensor")
    with Scorer(str(path), device="cpu", dtype="float32", progress=False, tensor_parallel_size=2, **ep) as s:
        plain = s.logprobs(seqs)
        for det in (True, False):
            s.config = EngineConfig(deterministic=det)
            got = s.logprobs(seqs, **OPTS)
            if det:
                assert _bits_equal(got, want[det]), kind
            else:
                for x, y in zip(got, want[det]):
                    assert (x.logprobs - y.logprobs).abs().max() <= 1e-5
                    assert (x.entropy - y.entropy).abs().max() <= 1e-5
                    assert torch.equal(x.topk_ids, y.topk_ids)
    worst = _worst_vs_float64(plain, seqs, ref, reference)
    print(f"{kind}: TP = 2 max |delta| vs float64 {worst:.2e}")
    assert worst < 1e-4, kind


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per checkpoint
@pytest.mark.parametrize("kind", ["gemma4_text", "gpt_oss_mxfp4_ep"])
def test_tp2_chunks_and_shared_prefixes_are_bitwise(kind, request):
    """Deterministic mode at TP = 2: requests sharing a 40-token context and long ones cut into
    chunks by small budgets (windows of 12 and KV-shared blocks crossing the cuts; gpt-oss with two
    experts a rank) equal each request alone at TP = 1, bitwise; a capture is the whole hidden width
    on every rank."""
    import random

    path = str(_checkpoint(kind, request)[0])
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    ctx = tok(40)
    seqs = [{"prompt_token_ids": ctx, "completion_token_ids": tok(rng.randint(1, 20))} for _ in range(3)]
    seqs += [{"prompt_token_ids": tok(4), "completion_token_ids": tok(3)},
             {"prompt_token_ids": tok(30), "completion_token_ids": tok(110)}]
    capture = [{"at": "blocks.2.resid_post", "positions": "last"}]
    one = Scorer(path, device="cpu", dtype="float32", config=EngineConfig(deterministic=True, share_prefixes=False,
                                                                            progress=False))
    alone = [one.logprobs([q], capture=capture)[0] for q in seqs]
    for budget in (48, 100):
        cfg = EngineConfig(deterministic=True, share_prefixes=True, max_batch_tokens=budget, progress=False)
        with Scorer(path, device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2,
                    expert_parallel_size=2 if kind.endswith("_ep") else 1) as s:
            got = s.logprobs(seqs, capture=capture)
        for a, b in zip(alone, got):
            assert torch.equal(a.logprobs, b.logprobs), budget
            assert b.captures[0].value.shape == a.captures[0].value.shape
            assert torch.equal(a.captures[0].value, b.captures[0].value)


def _shard(kind, path, rank, experts: int = 1):
    """(whole tensors, rank ``rank`` of 2's tensors) as the loaders read them."""
    from logprobe.loading import gemma4, glm4, gpt_oss

    mod, prefix = {"glm4": (glm4, "glm4"), "gemma4_text": (gemma4, "gemma4"), "gpt_oss": (gpt_oss, "gpt_oss")}[kind]
    cfg = getattr(mod, f"{prefix}_config")(read_config(path))
    whole = dict(getattr(mod, f"{prefix}_tensors")(path, cfg))
    got = dict(getattr(mod, f"{prefix}_shard_tensors")(path, cfg, parallel_context(cfg, rank, 2, experts=experts)))
    assert got.keys() == whole.keys()
    return whole, got


def test_rank_reads_its_rows(glm4_dir, gemma4_dirs, dirs):  # noqa: F811
    """Rank 1 of 2: its heads' q/k/v rows and biases, its rows of o_proj's output (and bias), the
    norms whole; Gemma 4's kv head replicated on full blocks (one kv head), its ple columns, the
    per-layer projection of h_0 whole; gpt-oss's sinks with its heads, the experts whole."""
    whole, got = _shard("glm4", glm4_dir[0], 1)  # 4 heads of 16, 2 kv heads, hidden 64, intermediate 80
    a = "layers.0.self_attn."
    for name, rows in (("q_proj.weight", (32, 64)), ("q_proj.bias", (32, 64)), ("k_proj.bias", (16, 32)),
                       ("v_proj.weight", (16, 32)), ("o_proj.weight", (32, 64))):
        assert torch.equal(got[a + name], whole[a + name][slice(*rows)]), name
    assert torch.equal(got["layers.0.mlp.up_proj.weight"], whole["layers.0.mlp.up_proj.weight"][40:80])
    assert torch.equal(got["layers.0.post_mlp_layernorm.weight"], whole["layers.0.post_mlp_layernorm.weight"])

    whole, got = _shard("gemma4_text", gemma4_dirs["gemma4_text"][0], 1)  # layers S F S S S F, 4 heads
    assert torch.equal(got["layers.0.self_attn.k_proj.weight"], whole["layers.0.self_attn.k_proj.weight"][12:24])
    assert torch.equal(got["layers.1.self_attn.k_proj.weight"], whole["layers.1.self_attn.k_proj.weight"])  # 1 kv head
    assert torch.equal(got["layers.1.self_attn.q_proj.weight"], whole["layers.1.self_attn.q_proj.weight"][32:64])
    assert torch.equal(got["layers.4.mlp.gate_proj.weight"], whole["layers.4.mlp.gate_proj.weight"][64:128])  # wide
    assert torch.equal(got["layers.2.per_layer_input_gate.weight"], whole["layers.2.per_layer_input_gate.weight"][4:8])
    assert torch.equal(got["layers.2.per_layer_projection.weight"], whole["layers.2.per_layer_projection.weight"][24:48])
    assert torch.equal(got["per_layer_model_projection.weight"], whole["per_layer_model_projection.weight"])
    assert got["embed_tokens_per_layer.weight"].shape[0] < whole["embed_tokens_per_layer.weight"].shape[0]

    whole, got = _shard("gpt_oss", dirs["dense"][0], 1)
    a = "layers.1.self_attn."
    assert torch.equal(got[a + "sinks"], whole[a + "sinks"][2:4])
    for name, rows in (("q_proj.bias", (32, 64)), ("k_proj.weight", (16, 32)), ("o_proj.bias", (32, 64))):
        assert torch.equal(got[a + name], whole[a + name][slice(*rows)]), name
    for name in ("layers.1.mlp.router.weight", "layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"):
        assert torch.equal(got[name], whole[name]), name
    for kind in ("dense", "mxfp4"):  # expert parallelism: rank 1 holds experts 2, 3 of 4, every tensor of them
        whole, got = _shard("gpt_oss", dirs[kind][0], 1, experts=2)
        experts = [n for n in whole if ".mlp.experts." in n]
        assert len(experts) == 3 * 4 if kind == "dense" else 3 * 6
        for name in experts:
            assert torch.equal(got[name], whole[name][2:4]), name
        # data-parallel attention (the default with whole experts a rank): attention read whole
        for name in ("layers.1.mlp.router.weight", a + "sinks", a + "q_proj.weight", a + "o_proj.bias"):
            assert torch.equal(got[name], whole[name]), name


def _gemma4(**kw) -> Gemma4Config:
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_layers=4, num_heads=4,
                layer_types=("sliding_attention", "full_attention") * 2, layer_head_dims=(12, 16, 12, 16),
                layer_kv_heads=(2, 1, 2, 1), sliding_window=8, ple_dim=8, num_kv_shared_layers=2,
                rope={"sliding_attention": (100.0, 1.0, 1.0), "full_attention": (1e4, 0.5, 1.0)})
    return Gemma4Config(**{**base, **kw})


def _refused(cfg, size: int, *words: str) -> None:
    with pytest.raises(LogprobeError) as e:
        parallel_context(cfg, 0, size)
    assert e.value.field == "tensor_parallel_size", e.value.field
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_sizes_that_do_not_split_are_refused():
    assert parallel_context(_gemma4(), 1, 2).size == 2 and parallel_context(_gemma4(), 3, 4).size == 4
    _refused(_gemma4(), 3, "attention heads")
    _refused(_gemma4(num_heads=6, layer_kv_heads=(2, 3, 2, 3)), 2, "key/value heads", "layer 1")
    _refused(_gemma4(ple_dim=6), 4, "hidden_size_per_layer_input 6")
    _refused(_gemma4(intermediate_size=66), 4, "intermediate_size 66")
    # a KV-shared block whose producer has other kv heads: its rank would read other heads
    odd = _gemma4(layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
                  num_kv_shared_layers=1)  # layer 3 (head_dim 16, 1 kv head) reads layer 2's (12, 2)
    assert parallel_context(odd, 0, 1).size == 1
    _refused(odd, 2, "KV-shared layer 3", "producer layer 2")

    glm = Glm4Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, attention_bias=True)
    assert parallel_context(glm, 0, 4).size == 4  # 2 kv heads replicated
    _refused(glm, 3, "attention heads")
    _refused(Glm4Config(**{**{f: getattr(glm, f) for f in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                           "num_kv_heads", "head_dim")}, "intermediate_size": 90}),
             4, "intermediate_size 90")

    oss = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=4, top_k=2,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=8)
    assert parallel_context(oss, 1, 2).size == 2
    _refused(oss, 3, "attention heads")
    assert parallel_context(oss, 1, 2, experts=2).experts == 2 and parallel_context(oss, 1, 4, experts=4).size == 4
    # with whole experts a rank attention is data-parallel unless asked by heads; not with every expert on each
    assert [parallel_context(oss, 0, 2, experts=e, attention=a).attention
            for e, a in ((2, None), (2, "tensor"), (1, None))] == ["data", "tensor", "tensor"]
    with pytest.raises(LogprobeError) as e:
        parallel_context(oss, 0, 2, experts=1, attention="data")
    assert e.value.field == "attention_parallel" and "whole experts per rank" in str(e.value)
    assert parallel_context(dataclasses.replace(oss, num_heads=3, num_kv_heads=3), 0, 2, experts=2).data_attention
    assert [default_expert_parallel(oss, n) for n in (1, 2, 4, 8)] == [1, 2, 4, 1]  # whole experts a rank
    for size, experts in ((2, 3), (4, 2)):  # an expert is never split over ranks: 1 or the TP size
        with pytest.raises(LogprobeError) as e:
            parallel_context(oss, 0, size, experts=experts)
        assert e.value.field == "expert_parallel_size" and "whole" in str(e.value)
    with pytest.raises(LogprobeError, match="no experts"):
        parallel_context(glm, 0, 2, experts=2)
    oss.num_heads, oss.num_kv_heads = 6, 3
    _refused(oss, 2, "key/value heads")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kind", ["glm4", "gemma4_text", "gpt_oss_mxfp4_ep", "gpt_oss"])
def test_tp2_on_two_gpus(kind, request):
    """NCCL, bf16: TP = 2 (gpt-oss: with two experts a rank, and with every expert on both) bitwise
    TP = 1 in deterministic mode, within bf16 noise in default mode."""
    path = str(_checkpoint(kind, request)[0])
    seqs = _seqs()
    one = Scorer(path, device="cuda", dtype="bfloat16", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det)
        want[det] = one.logprobs(seqs, **OPTS)
    ep = {} if kind.endswith("_ep") or not kind.startswith("gpt_oss") else dict(expert_parallel_size=1)
    with Scorer(path, device="cuda", dtype="bfloat16", progress=False, tensor_parallel_size=2, **ep) as s:
        for det in (True, False):
            s.config = EngineConfig(deterministic=det)
            got = s.logprobs(seqs, **OPTS)
            if det:
                assert _bits_equal(got, want[det]), kind
            else:
                diff = max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(got, want[det]))
                assert diff < 0.25, (kind, diff)  # bf16 activations: rounding of another sum order


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes
def test_tp2_ep_deterministic_fewer_tokens_than_ranks(request):
    """gpt-oss with two experts a rank, deterministic mode: a pass of one token (fewer tokens than
    ranks: rank 1 combines none of its block) and of three (the last block padded), bitwise TP = 1."""
    path = str(_checkpoint("gpt_oss_mxfp4_ep", request)[0])
    seqs = [{"prompt_token_ids": [5], "completion_token_ids": [7]},
            {"prompt_token_ids": [9, 4], "completion_token_ids": [3, 8]}]
    cfg = EngineConfig(deterministic=True, share_prefixes=False, progress=False)
    one = Scorer(path, device="cpu", dtype="float32", config=cfg)
    want = [one.logprobs([q], **OPTS)[0] for q in seqs]
    with Scorer(path, device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2) as s:
        got = [s.logprobs([q], **OPTS)[0] for q in seqs]
    assert _bits_equal(got, want)



@pytest.mark.slow  # slow tier: two and four gloo processes
@pytest.mark.parametrize("size", [2, 4])
def test_gpt_oss_data_parallel_attention_equals_one_process(size, dirs, tmp_path):  # noqa: F811
    """gpt-oss (MXFP4, top 3 of 4 experts: three terms, so the order they are added in shows in the
    bits) under data-parallel attention at two ranks (two experts each) and four (one each: the
    deterministic sums over ranks a tree of four) (``test_data_attention.ranks_equal_one_process``)."""
    import json
    import shutil

    from test_data_attention import ranks_equal_one_process

    path = tmp_path / "top3"
    shutil.copytree(dirs["mxfp4"][0], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_experts_per_tok": 3}))
    ranks_equal_one_process(str(path), tmp_path, size)

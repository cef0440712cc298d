"""Mixtures of experts over several ranks: tensor parallelism of attention and experts, and expert
parallelism (``layers.moe.Experts.parallel_forward``), gloo worker processes on CPU.

Three tiny random checkpoints saved by transformers: a Qwen3-MoE (8 experts, top-2, 4 heads, 2 kv
heads), a DeepSeek-V3 (latent attention with q_lora, grouped sigmoid routing over 4 groups of 2
keeping 2, a dense first block, a shared expert) and a hybrid Qwen3.5-MoE (Gated DeltaNet and
gated attention blocks, 8 experts, a gated shared expert); GLM-4.5 (grouped sigmoid routing, a
dense block, q/k norm per head) and MiniMax-M2 (q/k norm over the whole projection: gathered over
the ranks, normalised whole, cut back). Each is scored at TP = 1 in one process
and at (TP, EP) = (2, 1) (every expert split in two), (2, 2) (four whole experts per rank) and,
where heads allow, (4, 4) and (4, 2) (two experts per group, each split in two):

* deterministic mode: the raw bits of log-probs, entropy, ranks and top-k equal one process's;
* default mode: within 1e-5 of one process (the attention's and experts' products have other
  shapes), the same top-k ids.

Routing in default mode could flip where two experts' router scores are nearer than the
attention's rounding differences (about 1e-7 here); these seeds leave no such tie (a flip would
show as a difference far above 1e-5, and the test would fail, not pass by luck).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import byte_tokenizer, random_sequences

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.layers.moe import Experts
from logprobe.loading.loader import describe_model, parallel_context
from logprobe.parallel.context import ParallelContext

transformers = pytest.importorskip("transformers")

OPTS = dict(temperature=0.7, top_k=5, entropy=True)
FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")
SIZES = {"qwen3_moe": [(2, 1), (2, 2), (4, 4), (4, 2)], "deepseek_v3": [(2, 1), (2, 2), (4, 4)],
         "qwen3_5_moe": [(2, 1), (2, 2)], "glm4_moe": [(2, 2)], "minimax_m2": [(2, 1)], "qwen3_next": [(2, 2)]}


def _make(kind: str):
    tf = transformers
    if kind == "qwen3_moe":
        from test_moe import moe_config

        return tf.AutoModelForCausalLM.from_config(moe_config("qwen3_moe"), attn_implementation="eager",
                                                   experts_implementation="eager")
    if kind == "deepseek_v3":
        from test_deepseek import make_model

        return make_model("qlora")
    if kind in ("glm4_moe", "minimax_m2"):
        from test_moe_sigmoid_families import make_model

        return make_model(kind)
    from test_qwen3_next import make_model

    return make_model(kind)  # the hybrid mixtures of experts: qwen3_5_moe, qwen3_next


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights near 1, everything else 0.1 N(0, 1) (the gated delta's A_log as its tests set it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                offset = any(k in type(model).__name__.lower() for k in ("qwen3_5", "qwen3next"))  # 1 + w norms
                p.copy_((0.0 if offset else 1.0)
                        + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for i, kind in enumerate(SIZES):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(i)
        model = _make(kind).float().eval()
        _randomise(model, seed=300 + i)
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = d
    return out


def _seqs() -> list[dict]:
    shared = list(range(3, 73))  # two completions of one 70-token prompt: a shared prefix
    return random_sequences(4, seed=11, max_prompt=30, max_completion=40) + [
        {"prompt_token_ids": shared, "completion_token_ids": [9, 10, 11]},
        {"prompt_token_ids": shared, "completion_token_ids": [12, 13]}]


def _bits_equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return len(a) == len(b) and all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


@pytest.mark.slow  # slow tier (pytest -m slow): 2 or 4 gloo worker processes per size (~10-20 s each)
@pytest.mark.parametrize("kind", list(SIZES))
def test_tp_and_ep_equal_one_process(kind, dirs):
    path = str(dirs[kind])
    seqs = _seqs()
    one = Scorer(path, device="cpu", dtype="float32", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det, progress=False)
        want[det] = one.logprobs(seqs, **OPTS)
    for tp, ep in SIZES[kind]:
        with Scorer(path, device="cpu", dtype="float32", progress=False, tensor_parallel_size=tp,
                    expert_parallel_size=ep) as s:
            for det in (True, False):
                s.config = EngineConfig(deterministic=det, progress=False)
                got = s.logprobs(seqs, **OPTS)
                if det:
                    assert _bits_equal(got, want[det]), (kind, tp, ep)
                    continue
                worst = max((x.logprobs - y.logprobs).abs().max().item() for x, y in zip(got, want[det]))
                print(f"{kind} TP={tp} EP={ep} default mode: max |log-prob diff| vs one process {worst:.2e}")
                assert worst <= 1e-5, (kind, tp, ep, worst)
                for x, y in zip(got, want[det]):
                    assert (x.entropy - y.entropy).abs().max() <= 1e-5
                    assert torch.equal(x.topk_ids, y.topk_ids)


@pytest.mark.slow  # slow tier (pytest -m slow): two replicas of two gloo workers
def test_composes_with_data_parallelism(dirs):
    """TP = 2 x EP = 2 (the default: left out) in each of 2 data-parallel replicas: deterministic
    mode's bits equal one process's (each replica packs its share of the requests otherwise: batch
    invariance too)."""
    path = str(dirs["qwen3_moe"])
    seqs = _seqs()
    cfg = EngineConfig(deterministic=True, progress=False)
    want = Scorer(path, device="cpu", dtype="float32", config=cfg).logprobs(seqs, **OPTS)
    with Scorer(path, device="cpu", dtype="float32", config=cfg, tensor_parallel_size=2, data_parallel_size=2) as s:
        assert s.engine.ep == 2
        assert _bits_equal(s.logprobs(seqs, **OPTS), want)


def test_rank_holds_its_experts_and_rows(dirs):
    """Rank 3 of 4 in 2 expert groups holds experts 4..7, of each gate/up rows 16:32 of 32 and down
    rows 32:64 of 64 (its share of the outputs, over the whole intermediate); it reads only those."""
    from logprobe.loading.hf import hf_tensors, native_config, read_config
    from logprobe.loading.sharding import hf_shard_tensors

    path = dirs["qwen3_moe"]
    cfg, _ = native_config(read_config(path))
    whole = dict(hf_tensors(path, cfg))
    got = dict(hf_shard_tensors(path, cfg, parallel_context(cfg, 3, 4, None, 2)))
    assert got.keys() == whole.keys()
    e = "layers.1.mlp.experts."
    assert torch.equal(got[e + "gate_proj"], whole[e + "gate_proj"][4:8, 16:32])
    assert torch.equal(got[e + "up_proj"], whole[e + "up_proj"][4:8, 16:32])
    assert torch.equal(got[e + "down_proj"], whole[e + "down_proj"][4:8, 32:64])
    assert torch.equal(got["layers.1.mlp.gate.weight"], whole["layers.1.mlp.gate.weight"])  # the router: whole
    ep = dict(hf_shard_tensors(path, cfg, parallel_context(cfg, 1, 4, None, 4)))  # experts 2, 3 whole
    assert torch.equal(ep[e + "down_proj"], whole[e + "down_proj"][2:4])


def test_experts_layout_and_neg_zero_identity():
    """The layout of ``Experts`` per rank, and why the buffer is -0.0: it leaves every value's bits,
    +0.0 would turn a -0.0 output into +0.0."""
    x = Experts(8, 64, 32, ParallelContext(2, 4, blocks=4, experts=2))
    assert (x.first_expert, x.num_experts, x.inter_rows, x.hidden_rows) == (4, 4, (0, 16), (0, 32))
    assert tuple(x.gate_proj.shape) == (4, 16, 64) and tuple(x.down_proj.shape) == (4, 32, 32)
    assert x.col_blocks["gate_proj"] == [8, 8] and x.col_blocks["down_proj"] == [16, 16]
    v = torch.tensor([-0.0, 0.0, 1.5, float("inf"), float("nan")])
    same = (v + torch.full_like(v, -0.0)).view(torch.int32) == v.view(torch.int32)
    assert same.all()
    assert torch.signbit(v[:1] + 0.0).item() is False  # +0.0 would lose the sign of -0.0


def test_sizes_are_validated_naming_the_field(dirs):
    cfg = describe_model(str(dirs["qwen3_moe"]), "cpu").model.config
    assert parallel_context(cfg, 1, 2, None, 2).experts == 2
    for tp, ep, text in ((2, 3, "does not divide the 2 ranks"), (1, 2, "does not divide the 1 ranks"),
                         (2, 0, "positive integer")):
        with pytest.raises(LogprobeError) as e:
            parallel_context(cfg, 0, tp, None, ep)
        assert e.value.field == "expert_parallel_size" and text in str(e.value), (tp, ep)
    import dataclasses

    six = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=6))
    with pytest.raises(LogprobeError, match="does not divide the 6 experts") as e:
        parallel_context(six, 0, 4, None, 4)
    assert e.value.field == "expert_parallel_size"
    with pytest.raises(LogprobeError) as e:  # before any process starts
        Scorer(str(dirs["qwen3_moe"]), device="cpu", dtype="float32", progress=False, tensor_parallel_size=2,
               expert_parallel_size=4)
    assert e.value.field == "expert_parallel_size"
    dense = describe_model(str(dirs["qwen3_moe"]), "cpu").model.config
    dense = dataclasses.replace(dense, moe=None)
    with pytest.raises(LogprobeError, match="no experts"):
        parallel_context(dense, 0, 2, None, 2)


def test_default_is_whole_experts_per_rank(dirs):
    """Left out, the expert-parallel size is the rank count where it divides the experts (8 here),
    else 1; models without split experts take 1."""
    from logprobe.loading.loader import default_expert_parallel

    cfg = describe_model(str(dirs["qwen3_moe"]), "cpu").model.config
    assert [default_expert_parallel(cfg, n) for n in (1, 2, 4, 3)] == [1, 2, 4, 1]
    import dataclasses

    assert default_expert_parallel(dataclasses.replace(cfg, moe=None), 4) == 1


def test_cli_takes_expert_parallel_size():
    import argparse

    from logprobe.cli.common import ScorerOptions, model_parser

    args = argparse.ArgumentParser(parents=[model_parser()]).parse_args(["--tp", "4", "--ep", "2"])
    assert ScorerOptions.from_args(args).expert_parallel_size == 2
    args = argparse.ArgumentParser(parents=[model_parser()]).parse_args(["--expert-parallel-size", "4"])
    assert args.expert_parallel_size == 4
    assert argparse.ArgumentParser(parents=[model_parser()]).parse_args([]).expert_parallel_size is None


def _new_weights(kind: str, tmp_path):
    """Another checkpoint of ``kind`` (other random weights): its directory and its tensors."""
    from safetensors.torch import load_file

    d = tmp_path / f"{kind}-b"
    torch.manual_seed(77)
    model = _make(kind).float().eval()
    _randomise(model, seed=777)
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors |= load_file(str(f))
    return d, tensors


@pytest.mark.parametrize("kind", list(SIZES))
def test_split_experts_take_updates_as_loading_reads_them(kind, dirs, tmp_path):
    """Each rank's shard of a split mixture of experts (whole experts per rank, each expert's rows
    split, replicas of a hot expert), updated with whole tensors, holds exactly the parameters
    ``load_shard`` reads for it from the new checkpoint, bit for bit; another rank's experts are
    not written."""
    from logprobe.loading.loader import load_shard
    from logprobe.loading.sharding import expert_placement
    from logprobe.loading.update import update_weights

    b, new = _new_weights(kind, tmp_path)
    cfg = describe_model(str(dirs[kind]), "cpu").model.config
    loads = [9] + [1] * (cfg.moe.num_experts - 1)  # expert 0 hot: rank 1 holds a replica of it
    for size, experts, redundant in ((2, 2, 0), (2, 1, 0), (2, 2, 1)):
        placement = expert_placement(cfg, size, experts, redundant, loads) if redundant else None
        for rank in range(size):
            ctx = dataclasses.replace(parallel_context(cfg, rank, size, None, experts), placement=placement)
            shard = load_shard(str(dirs[kind]), ctx, "cpu", "float32", tokenizer=False).model
            want = load_shard(str(b), ctx, "cpu", "float32", tokenizer=False).model.state_dict()
            update_weights(shard, iter(list(new.items())))
            got = shard.state_dict()
            assert got.keys() == want.keys(), (kind, size, experts)
            assert all(torch.equal(got[k], want[k]) for k in want), (kind, size, experts, redundant, rank)


@pytest.mark.slow  # slow tier: two gloo workers
def test_split_experts_scorer_update(dirs, tmp_path):
    """TP = EP = 2 worker processes: the driver sends each expert to the rank holding it; the scores
    then equal a fresh one-process scorer's on the new weights, bitwise (deterministic mode)."""
    b, new = _new_weights("qwen3_moe", tmp_path)
    seqs = _seqs()
    want = Scorer(str(b), device="cpu", dtype="float32", progress=False, deterministic=True).logprobs(seqs, **OPTS)
    with Scorer(str(dirs["qwen3_moe"]), device="cpu", dtype="float32", progress=False, deterministic=True,
                tensor_parallel_size=2, expert_parallel_size=2) as s:
        assert not _bits_equal(s.logprobs(seqs, **OPTS), want)
        assert s.update_weights(iter(list(new.items()))) == 1
        assert _bits_equal(s.logprobs(seqs, **OPTS), want)


# ---- one MoE block over gloo ranks: the default mode's sum over ranks against float64 ----

LAYER = dict(E=8, k=4, H=64, I=32, T=37)  # T = 37: not a multiple of the rank count (the padded row blocks)


def _layer_weights() -> dict[str, torch.Tensor]:
    """The block's whole float32 weights and input, the same in every process (a fixed seed)."""
    g = torch.Generator().manual_seed(5)
    E, H, inter, T = LAYER["E"], LAYER["H"], LAYER["I"], LAYER["T"]
    def rnd(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)
    return {"router": rnd(E, H, scale=1.0), "gate_proj": rnd(E, inter, H), "up_proj": rnd(E, inter, H),
            "down_proj": rnd(E, H, inter), "x": rnd(T, H, scale=1.0)}


def _layer_block(ctx: ParallelContext, dtype: torch.dtype):
    from logprobe.layers.moe import MoeBlock, MoeSpec

    w = _layer_weights()
    block = MoeBlock(MoeSpec(LAYER["E"], LAYER["k"], LAYER["I"], norm_topk_prob=True), LAYER["H"], "r", ctx=ctx)
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            (e0, e1), (r0, r1) = block.experts.held(name)
            getattr(block.experts, name).copy_(w[name][e0:e1, r0:r1])
    return block.to(dtype), w["x"].to(dtype)


def _numerics(det: bool, size: int):
    from logprobe.config import numerics_for

    return numerics_for(EngineConfig(deterministic=det, progress=False), "cpu", tp_size=size, tp_blocks=8)


class _Recording(ParallelContext):
    """A rank's context that notes each collective's (name, input shape): the traffic of a mode."""

    calls: list

    def all_reduce_sum(self, x):
        self.calls.append(("all_reduce_sum", tuple(x.shape)))
        return super().all_reduce_sum(x)

    def sum_rows(self, x, dtype):
        self.calls.append(("sum_rows", tuple(x.shape)))
        return super().sum_rows(x, dtype)

    def all_gather(self, x):
        self.calls.append(("all_gather", tuple(x.shape)))
        return super().all_gather(x)


def _layer_worker(rank: int, size: int, experts: int, rdv: str, out: str) -> None:
    import torch.distributed as dist

    from logprobe.layers.moe import Experts

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    ctx = _Recording(rank, size, None, blocks=8, experts=experts)
    block, x = _layer_block(ctx, torch.float32)
    fused = Experts.fused_shared_rows
    def noted(self, *a):  # noqa: E306 - the fused halves ran (under TRITON_INTERPRET=1 only)
        ctx.calls.append(("fused_shared_rows", ()))
        return fused(self, *a)
    Experts.fused_shared_rows = noted
    got = {}
    for det in (False, True):
        block.set_numerics(_numerics(det, size))
        ctx.calls = []
        got[det] = (block(x), ctx.calls)
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("tp,ep,interpret", [pytest.param(2, 1, False, marks=pytest.mark.slow), (2, 2, False),
                                            pytest.param(4, 4, False, marks=pytest.mark.slow),
                                            pytest.param(4, 2, False, marks=pytest.mark.slow),
                                            # interpreted: 5 s, slow tier (the fast one stays within 4 minutes)
                                            pytest.param(2, 1, True, marks=pytest.mark.slow),
                                            pytest.param(4, 2, True, marks=pytest.mark.slow)])
def test_block_default_mode_one_sum_of_tokens(tp, ep, interpret, tmp_path, monkeypatch):
    """One MoE block (8 experts, top-4) over ``tp`` gloo ranks in ``ep`` expert groups. Default mode:
    each rank combines its slots and the ranks sum one float32 [T, H] (no [T*k, H] buffer crosses),
    within 1e-5 of one float32 process and of the float64 block; deterministic mode: the [T*k, H]
    -0.0 buffer, one process's bits. ``interpret``: the workers run Triton's CPU interpreter, so an
    expert split P ways (P > 1) takes the fused kernel's two halves in default mode (as on CUDA)."""
    import torch.multiprocessing as mp

    if interpret:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned workers at import

    out = tmp_path / "got.pt"
    mp.spawn(_layer_worker, args=(tp, ep, str(tmp_path / "rdv"), str(out)), nprocs=tp)
    got = torch.load(out)
    T, k, H = LAYER["T"], LAYER["k"], LAYER["H"]
    one, x = _layer_block(ParallelContext(blocks=8), torch.float32)
    ref64, x64 = _layer_block(ParallelContext(blocks=8), torch.float64)
    want64 = ref64(x64)
    one.set_numerics(_numerics(False, 1))
    want = one(x)
    default, calls = got[False]
    assert default.dtype == torch.float32 and default.shape == (T, H)
    d_one, d_64 = (default - want).abs().max().item(), (default.double() - want64).abs().max().item()
    one_64 = (want.double() - want64).abs().max().item()
    print(f"TP={tp} EP={ep}{' (Triton interpreted)' * interpret}: default vs one process {d_one:.2e}, vs float64 {d_64:.2e} (one process {one_64:.2e})")
    assert 0 < d_64 <= 1e-5 and d_one <= 1e-5
    share = [("fused_shared_rows", ())] if interpret else []
    share += [("all_gather", (T * k, LAYER["I"] * ep // tp))] if tp > ep else []  # P > 1: the intermediate
    # one [T, H] float32 sum (T padded to whole row blocks): its reduce-scatter, then the blocks gathered
    per = -(-T // tp)
    assert calls == share + [("sum_rows", (per * tp, H)), ("all_gather", (per, H))], calls
    det, calls = got[True]
    one.set_numerics(_numerics(True, 1))
    assert torch.equal(det, one(x))
    assert ("all_reduce_sum", (T * k, H)) in calls


# ---- data-parallel attention's expert layer in parts (default mode, Triton interpreted) ----

def _parts_worker(rank: int, size: int, rdv: str, out: str, det: bool = False, bounds: tuple | None = None) -> None:
    """One rank of a data-parallel-attention MoE layer owning rows ``bounds`` (default 0:21 | 21:37,
    the second rank's padded), the layer sent whole and in parts; ``det``: deterministic mode, where
    the slots never travel whole (only subtrees' sums: an all-to-all fails the run)."""
    import torch.distributed as dist

    from logprobe.layers.moe import Experts
    from logprobe.parallel.rows import RowSplit

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    ctx = ParallelContext(rank, size, None, blocks=8, experts=size, attention="data")
    block, x = _layer_block(ctx, torch.float32)
    block.set_numerics(_numerics(det, size))
    if det:
        def refused(*a, **k):  # noqa: E306
            raise AssertionError("all_to_all called")
        ParallelContext.all_to_all = refused
    rows = RowSplit(bounds or (0, 21, LAYER["T"]), rank)
    a, b = rows.own
    got = {}
    for name, at_least in (("whole", 10**9), ("parts", 4)):
        Experts.OVERLAP_ROWS = at_least
        got[name] = block(x[a:b], rows=rows)
    torch.save(got, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_experts_in_parts_interpreted(tmp_path, monkeypatch):
    """Default mode under data-parallel attention on two gloo ranks, the fused kernels under
    Triton's interpreter (as on CUDA: ``Experts.owned_in_parts``): a layer's rows sent in two parts,
    so that each part's transfers can run beside the other's experts, agree with the layer sent
    whole to rounding (the fused kernel's tiles hold other rows: its block sizes follow the row
    count) and with the float64 block to 1e-5."""
    import torch.multiprocessing as mp
    from helpers import skip_old_interpreter

    skip_old_interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned workers at import
    out = tmp_path / "got"
    mp.spawn(_parts_worker, args=(2, str(tmp_path / "rdv"), str(out)), nprocs=2)
    got = [torch.load(f"{out}.{r}") for r in (0, 1)]
    ref64, x64 = _layer_block(ParallelContext(blocks=8), torch.float64)
    want64 = ref64(x64)
    whole = torch.cat([g["whole"] for g in got])
    parts = torch.cat([g["parts"] for g in got])
    assert whole.shape == (LAYER["T"], LAYER["H"])
    d_parts, d_whole = ((t.double() - want64).abs().max().item() for t in (parts, whole))
    print(f"parts vs whole {(parts - whole).abs().max().item():.2e}, vs float64 {d_parts:.2e} / {d_whole:.2e}")
    assert 0 < d_parts <= 1e-5 and 0 < d_whole <= 1e-5
    assert (parts - whole).abs().max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kind", list(SIZES))
def test_every_moe_family_on_two_gpus(kind, dirs):
    """NCCL, bf16, each family's tiny checkpoint (the hybrid Qwen3.5-MoE with fla-core's kernels
    where installed): TP = EP = 2 (whole experts a GPU, data-parallel attention where the model
    takes it) bitwise one GPU in deterministic mode, within bf16 rounding of it in default mode
    (router near-ties may flip a route: the bound is loose on purpose, 0.25)."""
    path = str(dirs[kind])
    seqs = _seqs()
    one = Scorer(path, device="cuda", dtype="bfloat16", progress=False)
    want = {}
    for det in (False, True):
        one.config = EngineConfig(deterministic=det, progress=False)
        want[det] = one.logprobs(seqs, **OPTS)
    del one
    with Scorer(path, device="cuda", dtype="bfloat16", progress=False, tensor_parallel_size=2,
                expert_parallel_size=2) as s:
        for det in (True, False):
            s.config = EngineConfig(deterministic=det, progress=False)
            got = s.logprobs(seqs, **OPTS)
            if det:
                assert _bits_equal(got, want[det]), kind
            else:
                worst = max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(got, want[det]))
                print(f"{kind} TP=EP=2 default mode on two GPUs: max |diff| vs one GPU {worst:.3e}")
                assert worst < 0.25, (kind, worst)


@pytest.mark.slow  # slow tier: two gloo processes per checkpoint
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_data_parallel_attention_equals_one_process(kind, dirs, tmp_path):
    """The hybrid mixtures of experts (Qwen3.5-MoE with its vision tower's config, Qwen3-Next with a
    dense block; shared experts) under data-parallel attention, the default with whole experts per
    rank: each sequence's linear-attention state on its own rank
    (``test_data_attention.ranks_equal_one_process``)."""
    from test_data_attention import ranks_equal_one_process

    ranks_equal_one_process(str(dirs[kind]), tmp_path)


@pytest.mark.slow  # slow tier: two gloo workers, two budgets
def test_hybrid_chunks_and_shared_prefixes_by_data_are_bitwise(dirs):
    """Qwen3-Next (MoE) at TP = EP = 2, data-parallel attention (the default): groups sharing a
    70-token context and a long request cut into chunks by small budgets (chunk passes carry
    linear-attention states and run whole on every rank; the others split by sequences) equal each
    request alone on one process in deterministic mode, bitwise; a capture too."""
    from test_hybrid_tp import chunked_groups_bitwise

    chunked_groups_bitwise(str(dirs["qwen3_next"]), "blocks.1.resid_post", attention_parallel="data")

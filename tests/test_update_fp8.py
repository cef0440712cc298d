"""Weight updates of a model held as FP8 blocks (loading.update_fp8): new codes and scales, as an
FP8 block checkpoint stores them, in place and all or nothing.

The reference is a fresh Scorer of a checkpoint of the new weights: after an update its layers
hold the same bits and every number equals it bitwise; after a refused update every number equals
the old ones. Checkpoints: tiny DeepSeek-V3 (MLA, experts one by one, a float module among FP8
ones) in 32 x 32 blocks, and tiny Qwen3 in 48 x 32 blocks (q/k rows permuted for RoPE, partial
blocks), each written twice from different random weights.
"""

from __future__ import annotations

import pytest
import torch
from helpers import byte_tokenizer, random_sequences, tiny_config
from safetensors.torch import load_file, save_file
from test_deepseek import _randomise, make_model
from test_fp8_block import _proj, write_fp8

from logprobe import Scorer
from logprobe.errors import LogprobeError
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear

transformers = pytest.importorskip("transformers")
FP8 = torch.float8_e4m3fn
SEQS = random_sequences(3, seed=5, max_prompt=14, max_completion=14)


def _deepseek(root, seed):
    torch.manual_seed(seed)
    model = make_model("qlora").float().eval()
    _randomise(model, seed=seed)
    model.save_pretrained(str(root / "float"))
    write_fp8(root / "float", root / "fp8", root / "ref", (32, 32), ["model.layers.0.mlp.down_proj"], _proj)


def _qwen3(root, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="eager").float()
    model.save_pretrained(str(root / "float"))
    byte_tokenizer()[0].save_pretrained(str(root / "float"))  # the float model is scored too
    write_fp8(root / "float", root / "fp8", root / "ref", (48, 32), ["lm_head", "model.layers.1.self_attn.o_proj"],
              _proj)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """kind -> (FP8 dir of weights A, FP8 dir of weights B)."""
    out = {}
    for kind, write in (("deepseek", _deepseek), ("qwen3", _qwen3)):
        pair = []
        for seed in (11, 12):
            root = tmp_path_factory.mktemp(f"{kind}-{seed}")
            write(root, seed)
            pair.append(root / "fp8")
        out[kind] = tuple(pair)
    return out


def scorer(path, device="cpu", dtype="float32") -> Scorer:
    return Scorer(str(path), device=device, dtype=dtype, progress=False)


def scores(s: Scorer) -> list[torch.Tensor]:
    return [r.logprobs for r in s.logprobs(SEQS)]


def same(x, y) -> bool:
    return all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


def tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def fp8_buffers(s: Scorer) -> dict[str, torch.Tensor]:
    return {f"{n}.{b}": t for n, m in s.loaded.model.named_modules() if type(m) in (FP8BlockLinear, FP8BlockExperts)
            for b, t in (("qweight", m.qweight.view(torch.uint8)), ("scale", m.scale))}


@pytest.mark.parametrize("kind", ["deepseek", "qwen3"])
def test_fp8_update_equals_fresh_load(kind, fp8_dirs):
    a, b = fp8_dirs[kind]
    s, fresh = scorer(a), scorer(b)
    old, want = scores(s), scores(fresh)
    assert not same(old, want) and fp8_buffers(s)
    assert s.update_weights(iter(list(tensors(b).items()))) == 1  # a stream (staged)
    got = fp8_buffers(s)
    assert all(torch.equal(got[k], v) for k, v in fp8_buffers(fresh).items())
    assert same(scores(s), want)
    assert s.update_weights(tensors(a)) == 2  # a dict, in place: back to A
    assert same(scores(s), old)
    assert s.load_weights(str(b)) == 3  # the FP8 checkpoint directory (two shards, blocks as the model's)
    assert same(scores(s), want)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("kind", ["deepseek", "qwen3"])
def test_fp8_shards_take_updates_as_loading_reads_them(kind, fp8_dirs):
    """Each rank's shard (as under torchrun), updated with the whole FP8 tensors, holds exactly the
    codes, row scales and float weights ``load_shard`` reads for it from the new checkpoint, bit
    for bit: rows that start inside a block, experts whole per rank or split by rows."""
    from logprobe.loading.loader import describe_model, load_shard, parallel_context
    from logprobe.loading.update import update_weights

    a, b = fp8_dirs[kind]
    cfg = describe_model(str(a), "cpu").model.config
    for size, experts in ((2, 2), (2, 1)) if kind == "deepseek" else ((2, 1),):
        for rank in range(size):
            ctx = parallel_context(cfg, rank, size, None, experts)
            shard = load_shard(str(a), ctx, "cpu", "float32", tokenizer=False).model
            want = load_shard(str(b), ctx, "cpu", "float32", tokenizer=False).model.state_dict()
            assert any(t.dtype == FP8 for t in want.values())
            update_weights(shard, iter(list(tensors(b).items())))
            got = shard.state_dict()
            assert got.keys() == want.keys()
            assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want), (kind, size, experts, rank)


@pytest.mark.slow  # slow tier: two gloo workers
def test_fp8_tensor_parallel_scorer_update(fp8_dirs):
    """TP = EP = 2 worker processes of an FP8 DeepSeek-V3: the driver, which holds no weights, checks
    the halves against the checkpoint's FP8 weights (read off its headers) and sends each rank its
    rows; the scores then equal a fresh one-process scorer's, bitwise (deterministic mode)."""
    a, b = fp8_dirs["deepseek"]
    want = Scorer(str(b), device="cpu", dtype="float32", progress=False, deterministic=True).logprobs(SEQS)
    with Scorer(str(a), device="cpu", dtype="float32", progress=False, deterministic=True,
                tensor_parallel_size=2, expert_parallel_size=2) as s:
        new = tensors(b)
        q = "model.layers.1.self_attn.q_b_proj.weight"
        with pytest.raises(LogprobeError, match="as FP8 blocks"):  # checked on the driver: nothing sent
            s.update_weights({**new, q: new[q].float()})
        assert s.update_weights(iter(list(new.items()))) == 1
        assert same([r.logprobs for r in s.logprobs(SEQS)], [r.logprobs for r in want])
        assert s.load_weights(str(a)) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["deepseek", "qwen3"])
def test_fp8_update_equals_fresh_load_cuda(kind, fp8_dirs):
    """On CUDA in bf16 (the FP8 kernels read the codes and scales in place; graphs replay them): an
    updated scorer scores as a fresh one, bitwise, deterministic mode and default."""
    a, b = fp8_dirs[kind]
    for det in (True, False):
        s = Scorer(str(a), device="cuda", dtype="bfloat16", progress=False, deterministic=det)
        fresh = Scorer(str(b), device="cuda", dtype="bfloat16", progress=False, deterministic=det)
        old, want = scores(s), scores(fresh)
        assert not same(old, want)
        s.update_weights(tensors(b))
        assert same(scores(s), want), (kind, det)
        s.close(), fresh.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("in_place", [False, True])
def test_fp8_update_on_two_gpus_by_ipc(in_place, fp8_dirs):
    """TP = EP = 2 on CUDA, the new weights given as CUDA tensors (a weight group's receive buffer
    is one): the driver checks and cuts them on its GPU and hands each worker its slices by CUDA
    IPC (``ParallelEngine.stage_weights``), a stream and in place too; the scores then equal a
    fresh one-GPU scorer's of the new weights, bitwise (deterministic mode). A NaN among them is
    refused there, naming the tensor, with nothing changed."""
    a, b = fp8_dirs["deepseek"]
    fresh = Scorer(str(b), device="cuda", dtype="bfloat16", progress=False, deterministic=True)
    want = scores(fresh)
    fresh.close()
    with Scorer(str(a), device="cuda", dtype="bfloat16", progress=False, deterministic=True,
                tensor_parallel_size=2, expert_parallel_size=2) as s:
        old = scores(s)
        new = {k: v.cuda() for k, v in tensors(b).items()}
        q = "model.layers.1.self_attn.q_b_proj.weight"
        nan = new[q].clone()
        nan.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
        with pytest.raises(LogprobeError, match="non-finite"):
            s.update_weights({**new, q: nan})
        assert same(scores(s), old)
        assert s.update_weights(iter(list(new.items())) if in_place else new, in_place=in_place) == 1
        assert same(scores(s), want) and not same(old, want)


def test_fp8_refusals_change_nothing(fp8_dirs, tmp_path):
    a, b = fp8_dirs["deepseek"]
    s = scorer(a)
    old = scores(s)
    new = tensors(b)
    q = "model.layers.1.self_attn.q_b_proj"
    cases = [  # (the tensors sent, words of the error)
        ({**new, f"{q}.weight": new[f"{q}.weight"].float()}, "as FP8 blocks"),  # a float weight for an FP8 layer
        ({**new, "model.layers.0.mlp.down_proj.weight": new["model.layers.0.mlp.down_proj.weight"].to(FP8)},
         "as a float weight"),  # codes for a module the checkpoint keeps float
        ({k: v for k, v in new.items() if k != f"{q}.weight_scale_inv"}, f"{q}.weight_scale_inv"),  # half missing
        ({k: v for k, v in new.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"},
         "model.layers.1.mlp.experts.2.up_proj.weight"),  # an expert's codes missing, named per expert
        ({**new, f"{q}.weight_scale_inv": new[f"{q}.weight_scale_inv"].repeat(2, 1)}, "shape"),  # other blocks
        ({**new, f"{q}.weight_scale_inv": new[f"{q}.weight_scale_inv"].to(torch.int32)}, "float tensor"),
    ]
    nan = new[f"{q}.weight"].clone()
    nan.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    cases.append(({**new, f"{q}.weight": nan}, "non-finite"))
    for sent, words in cases:
        with pytest.raises(LogprobeError, match=words):
            s.update_weights(sent)
        assert same(scores(s), old) and s.weights_version == 0
    other = tmp_path / "blocks"  # a checkpoint quantized in other blocks than the model's
    other.mkdir()
    cfg = (b / "config.json").read_text().replace("[32, 32]", "[64, 64]")
    (other / "config.json").write_text(cfg)
    save_file(new, str(other / "model.safetensors"))
    with pytest.raises(LogprobeError, match=r"weight_block_size \[64, 64\]"):
        s.load_weights(str(other))
    assert same(scores(s), old)


def test_float_model_refuses_fp8_codes(fp8_dirs):
    """A model loaded from the float checkpoint takes floats only: FP8 codes are named."""
    a, b = fp8_dirs["qwen3"]
    s = scorer(a.parent / "float")
    sent = {k: v for k, v in tensors(b).items() if not k.endswith("_scale_inv")}
    with pytest.raises(LogprobeError, match="as a float weight"):
        s.update_weights(sent)


@pytest.mark.slow
def test_fp8_weights_over_a_collective(fp8_dirs, tmp_path):
    """SGLang's weight sync (gloo): a trainer process broadcasts an FP8 checkpoint's codes (as bytes:
    gloo has no float8 type) and scales in two buckets, after a round holding a NaN that is refused;
    the scores then equal a fresh load's, bitwise."""
    from server_util import free_port
    from test_weight_sync import finished, trainer

    a, b = fp8_dirs["qwen3"]
    new = tensors(b)
    (tmp_path / "b").mkdir()
    save_file(new, str(tmp_path / "b" / "model.safetensors"))  # the trainer reads one file
    s = scorer(a)
    old, want = scores(s), scores(scorer(b))
    names = sorted(new)
    dtypes = [str(new[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(new[n].shape) for n in names]
    assert "float8_e4m3fn" in dtypes and "float32" in dtypes
    half = len(names) // 2
    port = free_port()
    p = trainer("library", port, tmp_path / "b")
    try:
        s.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout=60)
        with pytest.raises(LogprobeError, match=names[1]):  # the trainer's NaN round: refused, nothing changed
            s.update_weights_from_distributed(names, dtypes, shapes)
        assert same(scores(s), old)
        assert s.update_weights_from_distributed(names[:half], dtypes[:half], shapes[:half]) == 0  # held
        assert s.update_weights_from_distributed(names[half:], dtypes[half:], shapes[half:]) == 1
        s.destroy_weights_update_group()
        finished(p)
    finally:
        p.kill()
    assert same(scores(s), want)
    s.close()


@pytest.mark.parametrize("kind", ["deepseek", "qwen3"])
def test_driver_reads_the_fp8_weights_off_the_headers(kind, fp8_dirs):
    """A parallel scorer's driver holds no weights: which of them are FP8 (and their block) it reads
    off the checkpoint's headers, and for a model made at random (``load_format="dummy"``, no
    weights on disk) off the same rule the random maker follows; the two agree."""
    import json

    from logprobe.loading.dummy import held_fp8_random
    from logprobe.loading.loader import describe_model
    from logprobe.loading.update import family

    a, _ = fp8_dirs[kind]
    model = describe_model(str(a), "cpu").model
    held = model.fp8_held()
    block = (32, 32) if kind == "deepseek" else (48, 32)
    assert held and set(held.values()) == {block}
    assert "layers.1.self_attn.q_proj.weight" in held or "layers.1.self_attn.q_b_proj.weight" in held
    assert not any(n.startswith(("lm_head", "embed")) or "norm" in n for n in held)
    raw = json.loads((a / "config.json").read_text())
    assert held_fp8_random(family(model), model.config, raw) == held


@pytest.mark.parametrize("kind", ["deepseek", "qwen3"])
def test_random_checkpoint_updates_a_random_model_into_another(kind, fp8_dirs):
    """``dummy.random_checkpoint``: the checkpoint a random model of seed 1 stands for, tensor by
    tensor as a trainer sends it (FP8 halves, experts one by one, bf16 floats, float32 routers).
    A random model of seed 0 updated with it scores as one made with seed 1, bit for bit: what the
    weight sync of a model larger than a disk is checked by (``bench/gpu_weight_sync.py --random``)."""
    from logprobe.loading.dummy import RandomWeights, random_checkpoint
    from logprobe.loading.update import family, sent_names

    a, _ = fp8_dirs[kind]
    s = Scorer(str(a), device="cpu", dtype="bfloat16", progress=False, load_format=RandomWeights(seed=0))
    want = Scorer(str(a), device="cpu", dtype="bfloat16", progress=False, load_format=RandomWeights(seed=1))
    old, new = scores(s), scores(want)
    assert not same(old, new)
    model = s.loaded.model
    import json

    raw = json.loads((a / "config.json").read_text())
    sent = list(random_checkpoint(family(model), model.config, raw, RandomWeights(seed=1), "cpu", torch.bfloat16,
                                  lambda n: sent_names(model, [n])[0]))
    dtypes = {t.dtype for _, t in sent}
    assert FP8 in dtypes and torch.bfloat16 in dtypes and any(n.endswith("_scale_inv") for n, _ in sent)
    assert s.update_weights(iter(sent)) == 1
    assert same(scores(s), new)

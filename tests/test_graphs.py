"""Small passes as CUDA graph replays (``engine.graphs``), checked on the CPU.

CUDA graphs do not exist on the CPU, so ``EmulatedGraphs`` gives the runner their semantics: a
capture records every aten op with its tensors (static addresses), a replay runs the ops again on
those same tensors, writing into the recorded outputs, and a host read while capturing
(``.item()``, ``.tolist()`` of a tensor) fails the capture as CUDA does. Through it the engine's
padded buckets, the attention run between pieces, cached keys, shared prefixes and chunks give
the eager numbers: bitwise in deterministic mode. tests/test_graphs_gpu.py runs the real capture.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers import make_hf_dir, random_sequences, ref_logprobs
from test_determinism import same
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.graphs import BUCKETS, GraphRunner, graph_bucket
from logprobe.errors import LogprobeError

# (rows, limit) -> bucket
BUCKET_GOLD = [
    (1, 2048, 16), (16, 2048, 16), (17, 2048, 32), (100, 2048, 128), (129, 2048, 192), (193, 2048, 256),
    (257, 2048, 384), (385, 2048, 512), (600, 2048, 768), (1025, 2048, 1536), (2048, 2048, 2048),
    (2049, 2048, None), (0, 2048, None), (40, 32, None), (30, 32, 32), (20, 24, 24), (4096, 4096, 4096),
    (4097, 8192, None),
]


@pytest.mark.parametrize("rows,limit,bucket", BUCKET_GOLD)
def test_bucket_gold(rows, limit, bucket):
    assert graph_bucket(rows, limit) == bucket


def test_buckets_rise():
    assert list(BUCKETS) == sorted(set(BUCKETS))


# what waits for the GPU on CUDA: a value read on the host, or an output sized by the data
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
               torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim.default,
               torch.ops.aten.bincount.default}


def _refuse_host_copy(self, *args, **kwargs):
    raise RuntimeError("operation not permitted when stream is capturing (a host read: tolist / numpy)")


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS or (func is torch.ops.aten.repeat_interleave.Tensor and not (kwargs or {}).get("output_size")) \
                or (func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])):
            raise RuntimeError(f"operation not permitted when stream is capturing (a host read: {func})")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


# allocations: no kernel in a CUDA graph, so a replay leaves their memory as the graph's kernels wrote it
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}


class _Piece:
    def __init__(self) -> None:
        self.ops: list = []
        self.mode = _Recorder(self.ops)

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            if func in _ALLOCATIONS:
                continue
            new = func(*args, **kwargs)
            for o, n in zip(tree_leaves(out), tree_leaves(new)):
                # a view or an in-place result is the recorded memory itself
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() != n.untyped_storage().data_ptr():
                    o.copy_(n)


class EmulatedGraphs:
    """``engine.graphs.CudaGraphs``'s interface with CUDA graph semantics on the CPU (module docstring)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pieces = 0

    @contextlib.contextmanager
    def capturing(self):
        yield

    def begin(self) -> _Piece:
        if self.fail:
            raise RuntimeError("CUDA error: capture refused")
        piece = _Piece()
        piece.mode.__enter__()
        # tolist / numpy read a tensor's memory without a dispatched op: refused as a CUDA read is
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy
        torch.Tensor.tolist = torch.Tensor.numpy = _refuse_host_copy
        self.pieces += 1
        return piece

    def end(self, piece: _Piece) -> _Piece:
        self.abort(piece)
        return piece

    def abort(self, piece: _Piece) -> None:
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        piece.mode.__exit__(None, None, None)


def _graphed(path, limit: int = 2048, backend=None, **kw) -> Scorer:
    s = Scorer(str(path), device="cpu", dtype="float32", progress=False, **kw)
    s.engine.graphs = GraphRunner(s.engine.model, limit, s.engine.device, backend or EmulatedGraphs())
    return s


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, make_hf_dir(path, "llama", seed=11)


def _calls(seqs):
    """Calls of one, two and all the sequences: passes of several sizes in the same buckets."""
    return [seqs[:1], seqs[1:3], seqs]


@pytest.mark.parametrize("deterministic", [True, False])
def test_replay_equals_eager(llama, deterministic):
    path, ref = llama
    seqs = random_sequences(6, seed=4)
    eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=deterministic)
    graphed = _graphed(path, deterministic=deterministic)
    for call in _calls(seqs):
        kw = dict(temperature=0.8, top_k=4, entropy=True)
        for a, b in zip(eager.logprobs(call, **kw), graphed.logprobs(call, **kw)):
            same(a, b, exact=deterministic)
    g = graphed.engine.graphs
    assert g.failed is None and g.replays >= 3 and 1 <= g.captures <= 3
    # the replayed numbers against float64 on the same weights
    s = seqs[2]
    ids = s["prompt_token_ids"] + s["completion_token_ids"]
    want = ref_logprobs(ref, ids)[len(s["prompt_token_ids"]) - 1:-1].gather(
        1, torch.tensor(s["completion_token_ids"])[:, None])[:, 0]
    got = graphed.logprobs([s])[0].logprobs.double()
    assert float((got - want).abs().max()) < 1e-5


def test_cut_per_attention_call(llama):
    """A two-block model is three pieces and two cuts, the cuts in block order."""
    path, _ = llama
    g = _graphed(path)
    g.logprobs(random_sequences(1, seed=2))
    (bucket,) = g.engine.graphs.graphs.values()
    assert len(bucket.pieces) == 3 and [c.call.args[0] for c in bucket.cuts] == [0, 1]  # the layers
    assert bucket.cuts[0].inputs[0].shape[0] == bucket.bucket == bucket.hidden.shape[0]


def test_shared_prefixes_chunks_and_prefix_cache(llama):
    """Segments that read a shared prefix, chunks over a KV cache (budget 24) and requests resumed
    from the prefix cache: bitwise the eager passes in deterministic mode."""
    path, _ = llama
    prompt = list(range(2, 40))
    seqs = [{"prompt_token_ids": prompt, "completion_token_ids": [5 + i, 9, 7 + i]} for i in range(4)]
    long = {"prompt_token_ids": list(range(3, 70)), "completion_token_ids": [4, 5, 6]}
    for kw in (dict(max_batch_tokens=24), dict(prefix_cache=True)):
        eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True, **kw)
        graphed = _graphed(path, deterministic=True, **kw)
        for call in (seqs, [long], seqs[:2], [long]):
            for a, b in zip(eager.logprobs(call), graphed.logprobs(call)):
                same(a, b, exact=True)
        assert graphed.engine.graphs.replays > 0


@pytest.mark.slow
def test_hybrid_states_chunks_and_prefix_cache(hybrid_dirs):
    """The Qwen3.5 / Qwen3-Next hybrids: their linear-attention core is a cut (it scans each
    segment from its state), so chunks over carried states (budget 64) and requests resumed from
    cached states replay bitwise the eager passes in deterministic mode."""
    path = hybrid_dirs["qwen3_5"][0]
    prompt = list(range(2, 130))  # two state-grid blocks of 64 cached
    seqs = [{"prompt_token_ids": prompt, "completion_token_ids": [5 + i, 9, 7 + i]} for i in range(3)]
    long = {"prompt_token_ids": list(range(3, 200)), "completion_token_ids": [4, 5, 6]}
    for kw in (dict(max_batch_tokens=64), dict(prefix_cache=True)):
        eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True, **kw)
        graphed = _graphed(path, deterministic=True, **kw)
        for call in (seqs[:1], seqs[1:], [long], seqs, [long]):
            for a, b in zip(eager.logprobs(call), graphed.logprobs(call)):
                same(a, b, exact=True)
        g = graphed.engine.graphs
        assert g.replays > 0 and g.failed is None


def test_failed_capture_runs_eagerly(llama):
    path, _ = llama
    seqs = random_sequences(3, seed=5)
    eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    graphed = _graphed(path, backend=EmulatedGraphs(fail=True), deterministic=True)
    with pytest.warns(UserWarning, match="CUDA graphs are off for this model"):
        out = graphed.logprobs(seqs)
    for a, b in zip(eager.logprobs(seqs), out):
        same(a, b, exact=True)
    g = graphed.engine.graphs
    assert g.failed is not None and g.captures == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once; later passes do not try again
        graphed.logprobs(seqs)
    assert not g.takes(8, None, None)


def test_host_read_fails_the_capture(llama, monkeypatch):
    """A forward that reads a tensor on the host cannot be captured (CUDA refuses it): the runner
    turns graphs off with a warning and the pass runs eagerly, same bits."""
    path, _ = llama
    graphed = _graphed(path, deterministic=True)
    model = graphed.engine.model
    norm = model.norm
    original = type(norm).forward

    def reads_host(self, x):
        float(x.abs().max())
        return original(self, x)

    monkeypatch.setattr(type(norm), "forward", reads_host)
    seqs = random_sequences(2, seed=8)
    with pytest.warns(UserWarning, match="host read"):
        out = graphed.logprobs(seqs)
    monkeypatch.undo()
    eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    for a, b in zip(eager.logprobs(seqs), out):
        same(a, b, exact=True)


def test_weights_moved_drop_the_graphs(llama):
    """Weights copied in place keep the graphs (update_weights); a weight moved to new memory drops
    them at the next call, and the numbers are the new weights'."""
    path, _ = llama
    seqs = random_sequences(2, seed=6)
    graphed = _graphed(path, deterministic=True)
    graphed.logprobs(seqs)
    g = graphed.engine.graphs
    assert len(g.graphs) == 1
    model = graphed.engine.model
    w = model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w.copy_(w * 1.5)  # in place: the graphs read it where it is
    in_place = graphed.logprobs(seqs)
    assert len(g.graphs) == 1
    w.data = w.data * (1 / 1.5)  # new memory
    moved = graphed.logprobs(seqs)
    assert g.captures == 2
    eager = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)
    for a, b in zip(eager.logprobs(seqs), moved):
        same(a, b, exact=False)
    assert not torch.equal(in_place[0].logprobs, moved[0].logprobs)


def test_warmup_captures_every_bucket(llama):
    """``Scorer.warmup`` (``logprobe warmup``, ``serve --warmup``) captures every bucket up to the
    limit, so a first small request replays at once; its report counts them."""
    path, _ = llama
    s = _graphed(path, limit=100, deterministic=True)
    report = s.warmup()
    g = s.engine.graphs
    # the buckets up to the limit 100: 16, 32, 64 and the limit itself; the rounds' passes took some
    assert sorted(k[0] for k in g.graphs) == [16, 32, 64, 100] and g.captures == 4
    assert 1 <= report["graphs"] <= 4 and "graphs" in report["rounds"]
    assert s.engine.prepare_graphs() == 0  # nothing left
    s.logprobs(random_sequences(2, seed=9, max_prompt=20, max_completion=20))
    assert g.captures == 4 and g.capture_seconds > 0
    # a token budget under the limit: no pass is larger, no bucket past it is captured
    small = _graphed(path, limit=100, max_batch_tokens=40)
    small.engine.prepare_graphs()
    assert sorted(k[0] for k in small.engine.graphs.graphs) == [16, 32, 64]


def test_passes_that_stay_eager(llama):
    path, _ = llama
    g = _graphed(path, limit=32).engine.graphs
    assert g.takes(32, None, None) and not g.takes(33, None, None)
    assert not g.takes(8, object(), None) and not g.takes(8, None, object())
    s = _graphed(path, limit=32)
    s.logprobs([{"prompt_token_ids": list(range(2, 50)), "completion_token_ids": [3]}])
    assert s.engine.graphs.replays == 0  # 49 rows: over the limit
    # on the CPU, and with the limit 0, the engine makes no runner
    assert Scorer(str(path), device="cpu", progress=False).engine.graphs is None
    cfg = EngineConfig(cuda_graph_tokens=0)
    assert GraphRunner.for_engine(s.engine.model, cfg, torch.device("cuda")) is None


def test_families_that_say_no(tmp_path):
    from logprobe.loading import load_model

    make_hf_dir(tmp_path / "l", "llama", seed=1)
    assert load_model(str(tmp_path / "l"), device="cpu").model.cuda_graphs


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2048"])
def test_config_refuses(bad):
    with pytest.raises(LogprobeError, match="cuda_graph_tokens"):
        EngineConfig(cuda_graph_tokens=bad)


# -- every native family ------------------------------------------------------------------------------

from test_deepseek import ds_dirs as ds_dirs  # noqa: E402,F401 (fixtures used by name)
from test_families_gpu import family_dirs as native_family_dirs  # noqa: E402
from test_gemma3 import gemma_dirs as gemma_dirs  # noqa: E402,F401
from test_gemma4 import gemma4_dirs as gemma4_dirs  # noqa: E402,F401
from test_glm4 import glm4_dir as glm4_dir  # noqa: E402,F401
from test_gpt_oss import dirs as gpt_oss_dirs  # noqa: E402,F401
from test_moe import moe_dirs as moe_dirs  # noqa: E402,F401
from test_moe_sigmoid_families import dirs as sigmoid_dirs  # noqa: E402,F401
from test_qwen3_next import float64_reference as float64_reference  # noqa: E402,F401
from test_qwen3_next import hybrid_dirs as hybrid_dirs  # noqa: E402,F401


def family_dirs(request) -> list[tuple[str, object]]:
    """(label, checkpoint dir) of every family the family test files write (tests/test_graphs_gpu.py
    runs the same list on CUDA): tests/test_families_gpu.py's, the Llama-style mixtures of experts,
    gpt-oss and the hybrids."""
    out = native_family_dirs(request)
    out += [(f"moe:{k}", v[0]) for k, v in request.getfixturevalue("moe_dirs").items()]
    out += [(f"gpt_oss:{k}", request.getfixturevalue("gpt_oss_dirs")[k][0]) for k in ("dense", "mxfp4")]
    out += [(f"hybrid:{k}", v[0]) for k, v in request.getfixturevalue("hybrid_dirs").items()]
    return out


def family_requests():
    from logprobe.engine.request import ScoreRequest
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(2, 250, (n,), generator=g).tolist()  # noqa: E731
    ctx = tok(40)
    return [ScoreRequest(ctx + tok(5), 40), ScoreRequest(ctx + tok(9), 40), ScoreRequest(tok(70), 3),
            ScoreRequest(tok(12), 1)]


@pytest.mark.slow
def test_every_family(request):
    """Each native family's tiny checkpoint: the emulated capture replays bitwise its eager passes in
    deterministic mode, or (mixtures of experts: the CPU's expert loop reads each expert's row count
    on the host, which CUDA's fused kernels do not) fails, warns, and runs eagerly, same bits."""
    from logprobe.loading import load_model

    reqs = family_requests()
    from logprobe.layers.moe import MoeBlock

    seen, moe = {}, set()
    for label, path in family_dirs(request):
        loaded = load_model(str(path), "cpu", "float32")
        if any(isinstance(m, MoeBlock) for m in loaded.model.modules()) or "gpt_oss" in label:
            moe.add(label)  # the CPU's expert loop reads counts on the host
        eager = Scorer(loaded, config=EngineConfig(deterministic=True, progress=False)).engine.run(reqs)
        s = Scorer(loaded, config=EngineConfig(deterministic=True, progress=False))
        s.engine.graphs = GraphRunner(loaded.model, 2048, s.engine.device, EmulatedGraphs())
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            out = s.engine.run(reqs)
        for a, b in zip(eager, out):
            assert torch.equal(a.logprobs, b.logprobs), (label, float((a.logprobs - b.logprobs).abs().max()))
        g = s.engine.graphs
        seen[label] = "replayed" if g.failed is None and g.replays else f"eager ({g.failed})"
    print(seen)
    for label, how in seen.items():
        assert how == "replayed" or (label in moe and "host read" in how), (label, how)


def test_cli_option(monkeypatch, capsys):
    """``--cuda-graph-tokens N`` reaches the engine config; a bad value is one line, exit 2, before
    any model loads."""
    import argparse

    from logprobe.cli import main as cli
    from logprobe.cli.common import ScorerOptions, model_parser
    from logprobe.cli.main import main

    args = argparse.ArgumentParser(parents=[model_parser()]).parse_args(["--cuda-graph-tokens", "0"])
    assert ScorerOptions.from_args(args).engine_config().cuda_graph_tokens == 0
    monkeypatch.setattr(cli, "get_scorer", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["score", "a", "b", "--cuda-graph-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("logprobe: error: cuda_graph_tokens")


def test_no_pinned_copy_while_capturing(monkeypatch):
    """A host-to-device copy from a pinned block inside a capture would be replayed from that block
    after it was freed: ``host_values_to`` refuses while the stream captures (the capture then fails
    and the pass runs eagerly); NVFP4's value table is made on the device instead."""
    from logprobe.kernels import host_values_to
    from logprobe.layers.fp4_linear import E2M1, e2m1_table

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="while capturing a CUDA graph"):
        host_values_to([1, 2], torch.long, "cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert e2m1_table(dtype, torch.device("cpu")).tolist() == list(E2M1)

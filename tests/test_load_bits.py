"""Loading keeps every parameter's bits while it copies experts into place as they are read.

Tiny mixtures of experts saved by transformers (``save_pretrained``: one [out, in] matrix per
expert) in float32 and in bfloat16: Qwen3-MoE (native Llama family), Qwen3.5-MoE and Qwen3-Next
(hybrid family), and a Qwen3-MoE checkpoint whose experts are stored fused (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]). Each is loaded in both dtypes and its whole
``state_dict`` compared with ``torch.equal`` against the same tensors stacked on the host first
and cast by the builder (``place=None``: the reading before experts were copied into their
[E, out, in] tensor on the model's device and dtype as each is read); each expert matrix is also
compared with the checkpoint's own matrix cast to the model dtype.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from helpers import VOCAB, byte_tokenizer

from logprobe import LogprobeError
from logprobe.loading import load_model
from logprobe.loading.hf import hf_tensors, native_config, read_config, stack_experts
from logprobe.loading.hybrid import build_hybrid, hybrid_config, hybrid_tensors
from logprobe.loading.llama import build_native

transformers = pytest.importorskip("transformers")

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=0, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32)


def _config(kind: str):
    tf = transformers
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, intermediate_size=96)
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**COMMON, **LINEAR, shared_expert_intermediate_size=48)
    return tf.Qwen3NextConfig(**COMMON, **LINEAR, intermediate_size=96, shared_expert_intermediate_size=48)


def _save(path, kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).to(dtype)
    with torch.no_grad():  # norms initialised to the identity would hide a lost or doubled copy
        for p in model.parameters():
            p.copy_(torch.randn(p.shape).to(dtype))
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))


def _fuse_experts(path) -> None:
    """Rewrite the per-expert matrices as transformers holds them in memory: gate_up [E, 2I, H], down [E, H, I]."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    for layer in range(COMMON["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        mats = {p: torch.stack([state.pop(f"{pre}.{e}.{p}.weight") for e in range(COMMON["num_experts"])])
                for p in ("gate_proj", "up_proj", "down_proj")}
        state[f"{pre}.gate_up_proj"] = torch.cat([mats["gate_proj"], mats["up_proj"]], dim=1)
        state[f"{pre}.down_proj"] = mats["down_proj"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("qwen3_5_moe", False), ("qwen3_next", False)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for kind, fused in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            d = tmp_path_factory.mktemp(f"{kind}{'_fused' * fused}_{str(dtype)[6:]}")
            _save(d, kind, dtype)
            if fused:
                _fuse_experts(d)
            out[kind, fused, dtype] = d
    return out


def _host_stacked(path, dtype: torch.dtype):
    """The model from experts stacked on the host as read, then cast by the builder (``place=None``)."""
    raw, cpu = read_config(path), torch.device("cpu")
    if raw["model_type"] in ("qwen3_5_moe_text", "qwen3_next"):
        cfg = hybrid_config(raw)
        return build_hybrid(cfg, hybrid_tensors(path, cfg, raw), cpu, dtype)
    cfg = native_config(raw)[0]
    return build_native(cfg, hf_tensors(path, cfg, raw), cpu, dtype)


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16], ids=["saved32", "saved16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["load32", "load16"])
@pytest.mark.parametrize("kind,fused", CASES, ids=[k + "_fused" * f for k, f in CASES])
def test_loaded_bits_equal_host_stacked(saved, kind, fused, saved_dtype, dtype):
    path = saved[kind, fused, saved_dtype]
    got = load_model(str(path), device="cpu", dtype=dtype).model.state_dict()
    want = _host_stacked(path, dtype).state_dict()
    assert got.keys() == want.keys()
    differ = [n for n in got if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not differ, differ[:5]
    experts = [n for n in got if ".experts.gate_proj" in n]
    assert experts and all(got[n].dtype == dtype for n in experts)


def test_expert_matrices_are_the_checkpoints(saved):
    """Independent of the loader: expert e of layer 1 is the checkpoint's matrix cast to the model dtype."""
    from safetensors import safe_open

    path = saved["qwen3_moe", False, torch.float32]
    model = load_model(str(path), device="cpu", dtype=torch.bfloat16).model
    experts = model.layers[1].mlp.experts
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        for e in range(COMMON["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                want = st.get_tensor(f"model.layers.1.mlp.experts.{e}.{proj}.weight").to(torch.bfloat16)
                assert torch.equal(getattr(experts, proj)[e], want), (e, proj)


@pytest.mark.parametrize("place", [None, (torch.device("cpu"), torch.float32)], ids=["host", "placed"])
def test_experts_of_two_shapes_refused(place):
    """A checkpoint whose experts disagree in shape is refused by name (``copy_`` would broadcast a
    [1, in] row into every row; ``torch.stack`` raised an unnamed RuntimeError)."""
    cfg = types.SimpleNamespace(moe=types.SimpleNamespace(num_experts=2))
    stream = [("layers.0.mlp.experts.0.up_proj.weight", torch.ones(4, 8)),
              ("layers.0.mlp.experts.1.up_proj.weight", torch.ones(1, 8))]
    with pytest.raises(LogprobeError, match=r"layers\.0\.mlp\.experts\.up_proj: experts of shapes"):
        list(stack_experts(stream, cfg, place=place))


@pytest.mark.slow  # a fresh process loading a model (14 s under load): the fast tier stays within 4 minutes
def test_loading_imports_no_compiler(saved):
    """Building a model on the meta device runs no meta-device arange: its first call imports
    torch._dynamo, about a second of every load."""
    path = saved["qwen3_5_moe", False, torch.bfloat16]
    code = ("import sys; from logprobe.loading import load_model; "
            f"load_model({str(path)!r}, device='cpu', dtype='float32'); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_files_read_ahead_whole_then_thread_ends(tmp_path, monkeypatch):
    """``open_files``'s thread asks the kernel to read every byte of every file (in pieces: one call
    starts at most a readahead window), a file once the reader is at the one before, and ends when
    the reader stops."""
    import threading

    from logprobe.loading import checkpoint

    model = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"))
    model.save_pretrained(str(tmp_path), max_shard_size="200KB")
    files = checkpoint.safetensors_files(tmp_path)
    assert len(files) > 2
    advised: dict[str, list[tuple[int, int]]] = {}
    real = checkpoint.os.posix_fadvise

    def record(fd, offset, length, advice):
        assert advice == checkpoint.os.POSIX_FADV_WILLNEED
        advised.setdefault(checkpoint.os.readlink(f"/proc/self/fd/{fd}"), []).append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(checkpoint.os, "posix_fadvise", record)
    monkeypatch.setattr(checkpoint._Prefetch, "PIECE", 64 << 10)
    ahead = checkpoint._Prefetch(files)
    ahead.reach(0)  # the reader at file 0: files 0 and 1 read ahead, not 2
    ahead.thread.join(timeout=2)
    assert sorted(advised) == [str(f) for f in files[:2]]
    ahead.reach(len(files) - 1)
    ahead.thread.join(timeout=10)
    assert not ahead.thread.is_alive()
    for f in files:
        pieces = sorted(advised[str(f)])
        assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
        assert pieces[-1][0] + pieces[-1][1] >= f.stat().st_size
    reader = checkpoint.open_files(tmp_path)
    assert next(reader)[0] == files[0]
    reader.close()  # the reader stopped after its first file: the thread ends
    for t in [t for t in threading.enumerate() if t.name == "safetensors-prefetch"]:
        t.join(timeout=10)
        assert not t.is_alive()


@pytest.mark.parametrize("slab_bytes", [1, 2 * 4 * 3 * 4, 1 << 20], ids=["expert", "two", "whole"])
def test_split_gate_up_slabs(slab_bytes):
    """Fused [E, 2I, H] split in slabs of whole experts equals the halves cast to the model dtype."""
    from logprobe.loading.hf import split_gate_up

    fused = torch.randn(5, 4, 3)  # E = 5 (an uneven last slab at two per slab), I = 2, H = 3
    gate, up = split_gate_up(fused, (torch.device("cpu"), torch.bfloat16), slab_bytes)
    assert torch.equal(gate, fused[:, :2].to(torch.bfloat16)) and torch.equal(up, fused[:, 2:].to(torch.bfloat16))
    assert gate.is_contiguous() and up.is_contiguous() and gate.data_ptr() != up.data_ptr()
    assert [t.tolist() for t in split_gate_up(fused, None)] == [fused[:, :2].tolist(), fused[:, 2:].tolist()]

"""Checkpoint files and tensor names shared by the Hugging Face readers (``hf``, ``compressed``,
``gptq``, ``awq``, ``sharding``, ``update``): which safetensors files hold the weights, a checkpoint
key's native parameter name, and the rule that a plain parameter is a float held exactly."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..models.llama import LlamaConfig


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise LogprobeError("model", f"{path} is missing weight shards: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LogprobeError("model", f"{path} has no *.safetensors weights",
                            "save the model with safe_serialization=True")
    return files


def open_files(path: Path, prefetch: bool = True) -> Iterator[tuple[Path, object]]:
    """(file, open ``safe_open`` handle) of each safetensors file of ``path``, in order, each opened
    once. ``prefetch``: while file i is read, a background thread asks the kernel to read files i
    and i + 1 into the page cache (``_Prefetch``), so a first load reads at the disk's queue depth
    rather than one readahead window per page fault on the memory map (a 1.6 GB bf16 checkpoint,
    cold, the kernel's default 128 KiB readahead: Scorer 2.49 -> 1.96 s, warm 1.36 s). Off for a
    rank that reads part of each file (``get_slice``): the other ranks' bytes would be read too."""
    from safetensors import safe_open

    files = safetensors_files(path)
    ahead = _Prefetch(files) if prefetch and hasattr(os, "posix_fadvise") else None
    try:
        for i, f in enumerate(files):
            if ahead is not None:
                ahead.reach(i)
            with safe_open(str(f), framework="pt") as st:
                yield f, st
    finally:
        if ahead is not None:
            ahead.stop()


class _Prefetch:
    """A daemon thread issuing ``posix_fadvise(WILLNEED)`` over files[j] once the reader is at file
    j - 1 or later, in pieces: the kernel starts (asynchronously) at most its readahead window
    (``max(read_ahead_kb, max_sectors_kb)``, 128 KiB by default) of one call, so the whole file
    takes many calls. The page cache is the only thing touched: no byte read here is used, none can
    differ."""

    PIECE = 128 << 10

    def __init__(self, files: list[Path]) -> None:
        self.files, self.reached, self.stopped = files, -1, False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="safetensors-prefetch", daemon=True)
        self.thread.start()

    def reach(self, i: int) -> None:
        with self.cond:
            self.reached = i
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def _run(self) -> None:
        for j, f in enumerate(self.files):
            with self.cond:
                self.cond.wait_for(lambda j=j: self.stopped or self.reached >= j - 1)
                if self.stopped:
                    return
            try:
                self._advise(f)
            except OSError:  # a hint only: the reader reads the file anyway
                pass

    def _advise(self, f: Path) -> None:
        fd = os.open(f, os.O_RDONLY)
        try:
            for offset in range(0, os.fstat(fd).st_size, self.PIECE):
                if self.stopped:
                    return
                os.posix_fadvise(fd, offset, self.PIECE, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


# dtypes a float model holds exactly; anything else (float8, int, bool) is a quantized or foreign tensor
_EXACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# safetensors dtype codes the transformers backend would cast to float with no scale
def check_plain_dtype(key: str, value: torch.Tensor, where: str) -> None:
    """A tensor loaded as a plain float parameter must be a float the model holds exactly: casting
    float8 codes or integers to the model dtype drops the scale or packing they need."""
    if value.dtype not in _EXACT_DTYPES:
        raise LogprobeError("model", f"tensor {key!r} in {where} is {str(value.dtype).removeprefix('torch.')}, "
                            "and no quantization scheme logprobe reads says how to expand it: casting it to the "
                            "model dtype would give a silently wrong model",
                            "give float32/float16/bfloat16 weights, or a checkpoint format logprobe reads "
                            "(compressed-tensors W4A16/W8A16, GGUF)")


_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_param_name(key: str, cfg: LlamaConfig, where: str) -> str | None:
    """A checkpoint key -> the native model's parameter name (None: not a weight we load)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    if key.startswith("model."):
        name = key[len("model."):]
        if ".block_sparse_moe." in name:  # Mixtral: gate = router, experts.{e}.w1/w3/w2 = gate/up/down
            name = name.replace(".block_sparse_moe.", ".mlp.")
            parts = name.split(".")
            if len(parts) == 7 and parts[5] in _MIXTRAL:  # layers.N.mlp.experts.E.w1.weight
                parts[5] = _MIXTRAL[parts[5]]
            name = ".".join(parts)
        return name
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def check_weights_match(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every parameter of ``model`` (built on the meta device from the config) present in ``state``,
    nothing more, each with the shape the config implies: else one error naming the tensors."""
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise LogprobeError("model", f"weights do not match the config: missing {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}")
    for name, w in state.items():
        want = model.get_parameter(name).shape
        if tuple(w.shape) != tuple(want):
            raise LogprobeError("model", f"tensor {name} has shape {tuple(w.shape)}, the config implies {tuple(want)}")


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


SKIP = "skip"  # a ``cut`` answer: a tensor this rank does not hold (another rank's experts), not read


def mapped_tensors(path: Path, param_name, cut=None, unmapped=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(native name, tensor) of every safetensors tensor of ``path`` that ``param_name(key, file)``
    maps (None: skipped, and ``unmapped(key)`` told; it raises for a key it refuses), float dtypes
    checked. ``cut(name)``: None (read whole), ``SKIP`` (not read) or a function of the safetensors
    slice giving a rank's part (only those bytes read; ``loading.sharding.rank_cut``)."""
    for f, st in open_files(path, prefetch=cut is None):
        for key in st.keys():
            name = param_name(key, f.name)
            if name is None:
                if unmapped is not None:
                    unmapped(key)
                continue
            how = None if cut is None else cut(name)
            if how is SKIP:
                continue
            value = st.get_tensor(key) if how is None else how(st.get_slice(key))
            check_plain_dtype(key, value, f.name)
            yield name, value


def tower_skipping_tensors(path: Path, param_name, towers: tuple[str, ...], what: str,
                           log) -> Iterator[tuple[str, torch.Tensor]]:
    """``mapped_tensors``, the unmapped keys under ``towers`` (a multimodal checkpoint's vision or
    audio parts, which text scoring does not use) counted in one warning saying ``what`` they are."""
    skipped: list[str] = []
    yield from mapped_tensors(path, param_name, unmapped=lambda key: key.startswith(towers) and skipped.append(key))
    if skipped:
        log.warning("%s: skipped %d tensors not used to score text (%s)", path.name, len(skipped), what)


def named_plain_tensors(path: Path, param_name, log, cut=None) -> Iterator[tuple[str, torch.Tensor]]:
    """``mapped_tensors``; skipped decoder layers (multi-token-prediction layers past
    ``num_hidden_layers``) are named in one warning."""
    skipped: set[int] = set()

    def unmapped(key: str) -> None:
        m = _LAYER_KEY.match(key)
        if m is not None:
            skipped.add(int(m.group(1)))

    yield from mapped_tensors(path, param_name, cut, unmapped)
    if skipped:
        log.warning("%s: skipped multi-token-prediction layer%s %s (not used to score text)", path.name,
                    "s" * (len(skipped) > 1), ", ".join(map(str, sorted(skipped))))

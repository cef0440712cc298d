"""Run-time configuration, passed down explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LogprobeError, check_positive_ints

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LogprobeError("device", f"{device!r} is not a device", "use cpu, cuda, cuda:N or auto") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LogprobeError("device", "CUDA was asked for but torch sees no GPU", "use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise LogprobeError("dtype", f"{dtype} is not supported", "use float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise LogprobeError("dtype", f"{dtype!r} is not a dtype", "use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches and scores.

    max_batch_tokens: token budget (rows) of one packed forward pass. A request whose inputs
        exceed it is split into chunks of that many rows that see the earlier chunks through a
        KV cache (native models; others run such a request whole, alone). None (default): chosen
        when the engine starts, from the device and the memory the weights left free
        (``engine.budget``: 8192 on CPU, up to 32768 on CUDA); ``Scorer.config`` shows the value.
    head_token_chunk / head_vocab_chunk: tile of the log-prob head; peak extra memory of the head is
        about 4 * head_token_chunk * head_vocab_chunk * 4 bytes, whatever T and V are.
    progress: None = a progress bar on long jobs when stderr is a terminal; True/False force it.
    share_prefixes / min_shared_prefix: requests whose inputs share at least that many leading
        token ids run the prefix once, as a tree (native models). 16 keeps the saving above the
        per-segment overhead; shared or not, results agree (bitwise in deterministic mode).
    deterministic: every per-token number is bitwise the same whatever else is in the batch, the
        order of requests, the budget, chunking and prefix sharing: matrix products in fixed
        tiles of ``invariant_tile`` rows (``cuda_invariant_tile`` on CUDA), attention in
        ``attention_block`` tiles with a fixed KV split, the head in padded token chunks (native
        models; see docs/perf.md for the cost). Off: equal within float32 rounding.
    invariant_matmul: how a deterministic product without column blocks (``tp_invariant=False``)
        runs on CUDA. "cublas" (default): cuBLAS on row tiles of one fixed shape; a fixed shape
        pins cuBLAS's kernel and a GEMM never reduces across rows, so a row's bits do not depend
        on its companions. "triton": logprobe's fixed-tile Triton matmul (``kernels.matmul``),
        invariant by construction; it is what every product runs with ``tp_invariant`` on CUDA.
    tp_invariant: deterministic mode's numbers are also the same bits for every tensor-parallel
        size dividing the model's column block count (``parallel.shard.num_blocks``; 8 for
        Llama-3-8B): every product is computed in fixed column blocks (the Triton fixed-tile
        matmul on CUDA, invariant by construction), and row-parallel layers gather their input
        and compute each output over the whole inner dimension (``layers.parallel_linear``), so
        no sum is split by the TP size. Costs the Triton matmul's speed against cuBLAS at every
        TP size, TP = 1 included (docs/perf.md); False keeps deterministic mode batch-invariant
        at the TP size in use only, on cuBLAS row tiles. Models that are never split
        (mixture-of-experts today) skip it: there is no other TP size to match.
    overlap_host: a batch's results are read after the next batch is launched, so that the host
        plans and packs while the device computes (one device-to-host copy per batch, ``engine.host``).
        False reads each batch before launching the next (for measuring what the overlap gives);
        the numbers are the same bits either way.
    """

    max_batch_tokens: int | None = None
    head_token_chunk: int = 512
    head_vocab_chunk: int = 8192
    progress: bool | None = None
    deterministic: bool = False
    invariant_tile: int = 128
    cuda_invariant_tile: int = 2048
    invariant_matmul: str = "cublas"
    attention_block: int = 64
    share_prefixes: bool = True
    min_shared_prefix: int = 16
    tp_invariant: bool = True
    overlap_host: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_tokens is not None:
            check_positive_ints(self, ("max_batch_tokens",))
        check_positive_ints(self, ("head_token_chunk", "head_vocab_chunk", "invariant_tile",
                                   "cuda_invariant_tile", "attention_block", "min_shared_prefix"))
        if self.invariant_matmul not in ("cublas", "triton"):
            raise LogprobeError("invariant_matmul", f"must be cublas or triton, got {self.invariant_matmul!r}",
                                "cublas: fixed-shape cuBLAS row tiles (fast); triton: logprobe's fixed-tile kernel")

    @property
    def batch_invariant(self) -> bool:
        """The old name of ``deterministic``."""
        return self.deterministic

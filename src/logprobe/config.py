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


@dataclass(frozen=True, slots=True)
class Deterministic:
    """Deterministic mode's settings: ``EngineConfig(deterministic=Deterministic(...))``, or
    ``deterministic=True`` for these defaults. Every per-token number is then bitwise the same
    whatever else is in the batch, the order of requests, the budget, chunking and prefix sharing.

    tile: matrix products in fixed tiles of this many rows (the last one zero-padded); also the
        head's token chunk. ``cuda_tile``: the products' row tile on CUDA.
    matmul: how a product without column blocks (``tp_invariant=False``) runs on CUDA. "cublas"
        (default): cuBLAS on row tiles of one fixed shape; a fixed shape pins cuBLAS's kernel and
        a GEMM never reduces across rows, so a row's bits do not depend on its companions.
        "triton": logprobe's fixed-tile Triton matmul (``kernels.matmul``), invariant by
        construction; it is what every product runs with ``tp_invariant`` on CUDA.
    attention_block: attention in tiles of this many queries and keys, with a fixed KV split.
    tp_invariant: the numbers are also the same bits for every tensor-parallel size dividing the
        model's column block count (``parallel.shard.num_blocks``; 8 for Llama-3-8B): every
        product is computed in fixed column blocks (the Triton fixed-tile matmul on CUDA), and
        row layers gather their input and compute each output over the whole inner dimension
        (``layers.parallel_linear``), so no sum is split by the TP size. Costs the Triton
        matmul's speed against cuBLAS at every TP size, TP = 1 included (docs/perf.md); False
        keeps the mode batch-invariant at the TP size in use only, on cuBLAS row tiles. Every
        native family, mixtures of experts included, computes its products this way.

        >>> EngineConfig(deterministic=True).deterministic
        Deterministic(tile=128, cuda_tile=2048, matmul='cublas', attention_block=64, tp_invariant=True)
        >>> EngineConfig(deterministic=Deterministic(tp_invariant=False)).deterministic.tile
        128
        >>> EngineConfig(deterministic=False).deterministic is None
        True
    """

    tile: int = 128
    cuda_tile: int = 2048
    matmul: str = "cublas"
    attention_block: int = 64
    tp_invariant: bool = True

    def __post_init__(self) -> None:
        for name in ("tile", "cuda_tile", "attention_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LogprobeError(f"deterministic.{name}", f"must be a positive integer, got {value!r}")
        if self.matmul not in ("cublas", "triton"):
            raise LogprobeError("deterministic.matmul", f"must be cublas or triton, got {self.matmul!r}",
                                "cublas: fixed-shape cuBLAS row tiles (fast); triton: logprobe's fixed-tile kernel")


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches and scores.

    max_batch_tokens: token budget (rows) of one packed forward pass. A request whose inputs
        exceed it is split into chunks of that many rows that see the earlier chunks through a
        KV cache (native models; others run such a request whole, alone). None (default): chosen
        when the engine starts, from the device and the memory the weights left free
        (``engine.budget``: 8192 on CPU, up to 32768 on CUDA, 65536 for mixtures of experts; under
        data-parallel attention over N ranks N times a rank's share); ``Scorer.config`` shows the
        value. Given or chosen, it counts the rows of one pass, all ranks together.
    head_token_chunk / head_vocab_chunk: tile of the log-prob head; peak extra memory of the head is
        about 4 * head_token_chunk * head_vocab_chunk * 4 bytes, whatever T and V are.
    progress: None = a progress bar on long jobs when stderr is a terminal; True/False force it.
    share_prefixes / min_shared_prefix: requests whose inputs share at least that many leading
        token ids run the prefix once, as a tree (native models). 16 keeps the saving above the
        per-segment overhead; shared or not, results agree (bitwise in deterministic mode).
    deterministic: None (off, the default): equal within float32 rounding. A ``Deterministic``
        (``True`` stands for ``Deterministic()``, ``False`` for None, here and in ``replace``):
        every per-token number is bitwise the same whatever else is in the batch, the order of
        requests, the budget, chunking and prefix sharing (native models; see ``Deterministic``
        and docs/perf.md for the cost). Test it as a truth value: ``if cfg.deterministic:``.
    overlap_host: a batch's results are read after the next batch is launched, so that the host
        plans and packs while the device computes (one device-to-host copy per batch, ``engine.host``).
        False reads each batch before launching the next (for measuring what the overlap gives);
        the numbers are the same bits either way.
    micro_batch_rows: under data-parallel attention (mixtures of experts over several GPUs) a pass
        runs as two micro-batches of sequences whose blocks are launched in turn, so that one's
        expert transfers run beside the other's attention and experts, when every rank's halves
        hold at least this many rows; 0: one batch. Deterministic mode's bits are the same either way.
    cuda_graph_tokens: on CUDA a pass of at most this many rows replays CUDA graphs captured once
        per row-count bucket (``engine.graphs``: the host's kernel launches, which leave the GPU
        idle on small passes, replaced by one replay between attention calls), on families that
        can be captured; the same numbers (bitwise in deterministic mode). 0: every pass eager.
    tuning_cache: where autotuned kernels' choices persist between processes on CUDA
        (``kernels.tuning``): True (default) ``~/.cache/logprobe/kernels`` (``$LOGPROBE_CACHE/kernels``
        when set), a folder, or False (the tables shipped with logprobe only, nothing written). A
        kernel tuned once on a GPU is not tuned again by the next process.
    """

    max_batch_tokens: int | None = None
    head_token_chunk: int = 512
    head_vocab_chunk: int = 8192
    progress: bool | None = None
    deterministic: Deterministic | None = None
    share_prefixes: bool = True
    min_shared_prefix: int = 16
    overlap_host: bool = True
    micro_batch_rows: int = 2048
    tuning_cache: bool | str = True
    cuda_graph_tokens: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.tuning_cache, (bool, str)) or self.tuning_cache == "":
            raise LogprobeError("tuning_cache", f"must be True, False or a folder, got {self.tuning_cache!r}",
                                "True keeps kernel tunings in ~/.cache/logprobe/kernels")
        if self.max_batch_tokens is not None:
            check_positive_ints(self, ("max_batch_tokens",))
        if not isinstance(self.micro_batch_rows, int) or isinstance(self.micro_batch_rows, bool) \
                or self.micro_batch_rows < 0:
            raise LogprobeError("micro_batch_rows", f"must be a non-negative integer, got {self.micro_batch_rows!r}",
                                "0 runs each pass as one batch")
        if not isinstance(self.cuda_graph_tokens, int) or isinstance(self.cuda_graph_tokens, bool) \
                or self.cuda_graph_tokens < 0:
            raise LogprobeError("cuda_graph_tokens", f"must be a non-negative integer, got {self.cuda_graph_tokens!r}",
                                "0 runs every pass without CUDA graphs")
        check_positive_ints(self, ("head_token_chunk", "head_vocab_chunk", "min_shared_prefix"))
        if self.deterministic is True:
            self.deterministic = Deterministic()
        elif self.deterministic is False:
            self.deterministic = None
        elif self.deterministic is not None and not isinstance(self.deterministic, Deterministic):
            raise LogprobeError("deterministic", f"must be True, False, None or a Deterministic, got "
                                f"{self.deterministic!r}", "e.g. Deterministic(tp_invariant=False)")


@dataclass(frozen=True, slots=True)
class Numerics:
    """How the layers compute: one object, derived from an ``EngineConfig`` and the device by
    ``numerics_for`` (the only place the mode's settings become layer choices). The engine hands
    it to the model (``layers.numerics.NumericsUser.set_numerics``); layers read ``self.numerics``.

    deterministic: the mode is on (RMSNorm's row-wise kernel on CUDA whatever ``triton`` says,
        the head in padded chunks of a fixed vocabulary grid, combined in grid order).
    row_tile: products in fixed tiles of this many rows (None: one product, the fastest).
    matmul: ``Deterministic.matmul``. column_blocks: products in the layer's column blocks
        (``Deterministic.tp_invariant`` on a model that can be split).
    attention_block: attention's query/key tile (None: the fastest kernel).
    head_token_chunk / head_vocab_chunk: the log-prob head's tile.
    triton: RMSNorm, rotary, SiLU(gate) * up, the MoE MLP and the hybrid models' short conv as
        Triton passes on CUDA (the default); False: PyTorch ops, a benchmark's baseline
        (``LlamaModel.use_triton_elementwise``).
    micro_batch_rows: ``EngineConfig.micro_batch_rows`` (a schedule, not a rounding: the bits of
        deterministic mode do not depend on it).
    collective_sms: multiprocessors the fixed-tile matmul's persistent grid leaves to the
        collectives that run beside it across GPUs (``COLLECTIVE_SMS`` on CUDA where they overlap
        the compute by design: data-parallel attention, the experts' exchange beside the other
        micro-batch; else 0, where a collective and a product never run at once; which program
        computes a tile, not the bits).

        >>> numerics_for(EngineConfig(deterministic=True), "cpu").row_tile
        128
        >>> numerics_for(EngineConfig(), "cpu") == Numerics()
        True
    """

    deterministic: bool = False
    row_tile: int | None = None
    matmul: str = "cublas"
    column_blocks: bool = False
    attention_block: int | None = None
    head_token_chunk: int = 512
    head_vocab_chunk: int = 8192
    triton: bool = True
    micro_batch_rows: int = 2048
    collective_sms: int = 0


# SMs left to NCCL beside the fixed-tile matmul across GPUs: on two H200s its products beside an
# all-gather and a reduce-scatter ran 1.49-1.50x their time alone with a program on every SM,
# 1.05-1.09x with 16 left free (bench/gpu_matmul_nccl.py; docs/perf.md, "Mixtures of experts")
COLLECTIVE_SMS = 16


def check_tp_invariance(config: EngineConfig, tp_size: int, tp_blocks: int) -> None:
    """Refuse a TP-invariant deterministic ``config`` at a TP size that does not divide the model's
    column block count (``parallel.shard.num_blocks``): checked when a parallel scorer starts
    (a server's fixed config then fails at its start, not at its first request) and again when a
    config is set.

    >>> check_tp_invariance(EngineConfig(deterministic=True), 2, 4)
    >>> check_tp_invariance(EngineConfig(deterministic=True), 8, 4)
    Traceback (most recent call last):
    ...
    logprobe.errors.LogprobeError: tensor_parallel_size: deterministic mode keeps its numbers equal across TP sizes that divide the model's 4 column blocks; 8 does not; use such a TP size, or EngineConfig(deterministic=Deterministic(tp_invariant=False))
    """
    det = config.deterministic
    if det is not None and det.tp_invariant and tp_size > 1 and tp_blocks % tp_size:
        raise LogprobeError("tensor_parallel_size", f"deterministic mode keeps its numbers equal across TP sizes "
                            f"that divide the model's {tp_blocks} column blocks; {tp_size} does not",
                            "use such a TP size, or EngineConfig(deterministic=Deterministic(tp_invariant=False))")


def numerics_for(config: EngineConfig, device: str | torch.device, *, splittable: bool = True,
                 tp_size: int = 1, tp_blocks: int = 1, overlapped: bool = False) -> Numerics:
    """The ``Numerics`` of ``config`` on ``device``. ``splittable``: the model can be split by
    tensor parallelism (column blocks mean something); ``tp_size`` / ``tp_blocks``: its TP size
    and column block count, checked here (a TP-invariant run needs a size dividing the blocks);
    ``overlapped``: collectives run beside the products (``ParallelContext.data_attention``)."""
    det = config.deterministic
    if det is None:
        return Numerics(head_token_chunk=config.head_token_chunk, head_vocab_chunk=config.head_vocab_chunk,
                        micro_batch_rows=config.micro_batch_rows)
    check_tp_invariance(config, tp_size, tp_blocks)
    cuda = torch.device(device).type == "cuda"
    # the head's token chunk is ``tile`` on every device: its bits were pinned that way
    return Numerics(deterministic=True, row_tile=det.cuda_tile if cuda else det.tile, matmul=det.matmul,
                    column_blocks=det.tp_invariant and splittable, attention_block=det.attention_block,
                    head_token_chunk=det.tile, head_vocab_chunk=config.head_vocab_chunk,
                    micro_batch_rows=config.micro_batch_rows,
                    collective_sms=COLLECTIVE_SMS if cuda and overlapped else 0)

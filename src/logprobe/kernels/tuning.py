r"""Autotuned Triton kernels without tuning at first use: tables of chosen configurations, shipped
with logprobe for the GPUs it was measured on and kept in a persistent cache written by the first
process that tunes.

The autotuned kernels logprobe runs are fla-core's (the gated delta rule of Qwen3.5 / Qwen3-Next);
its own kernels take fixed configurations. Triton's ``Autotuner`` times every candidate
configuration the first time it meets a tuning key (the values of its ``key`` arguments and the
dtypes of its tensor arguments), compiling each candidate: tens of seconds on a Qwen3.5 model,
in every new process, for choices that depend only on the GPU, the library versions and the
model's shapes. Here a choice is recorded as

    table["kernels"][kernel][key] = {"kwargs": {...}, "num_warps": 4, "num_stages": 2, ...}

with ``kernel`` the function's ``module.qualname`` and ``key`` the tuning key as JSON text, and
put back into the autotuner's own cache (``Autotuner.cache``) before it runs, so Triton skips the
timing and compiles the chosen configuration only. A table is valid for one ``identity``: the
GPU's name and the Triton and fla-core versions; a table of another identity is stale and
ignored. A choice whose configuration the kernel no longer offers is ignored too.

    >>> key = (4, 128, 128, 64, True, "torch.bfloat16")
    >>> key_text(key)
    '[4, 128, 128, 64, true, "torch.bfloat16"]'
    >>> key_from_text(key_text(key)) == key
    True
    >>> t = TuningTable({"device": "GPU", "triton": "3.6.0", "fla": "0.6.0"})
    >>> t.put("fla.ops.k.kernel", key_text(key), {"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 2})
    True
    >>> t.put("fla.ops.k.kernel", key_text(key), {"kwargs": {"BV": 32}, "num_warps": 4, "num_stages": 2})
    False
    >>> TuningTable.from_json(t.to_json(), t.identity).get("fla.ops.k.kernel", key_text(key))["kwargs"]
    {'BV': 64}

Files: the shipped tables under ``kernels/tuned/*.json`` (read only) and the cache file
``<cache dir>/<identity>.json`` (``KernelTuning``): read at start, written atomically (a
temporary file renamed over it) when a run tuned something new. A corrupt cache file is a
warning and a re-tune, never an error; a cache that cannot be written is a warning once.

Deterministic mode never times. A timed choice can differ between two fresh processes (or between
a process that tuned and one that read another machine's table), and a configuration can change
bits, so in deterministic mode every autotuned kernel runs one configuration per kernel, the same
for every key, in every process, whatever the tables, the cache or fla's own config files say:

    pinned = PINS[kernel] if the kernel offers that configuration, else the kernel's first one

``PINS`` holds the shipped H200 table's choices (Qwen3.5-4B shapes: H 16, HV 32, K = V = 128), so
an H200 runs deterministic mode at the tuned speed there. Worked example, fla's output kernel with
the configurations it lists on Hopper, then the list of a GPU without the pinned one:

    >>> import triton
    >>> o = "fla.ops.common.chunk_o.chunk_fwd_kernel_o"
    >>> hopper = [triton.Config({"BK": 128, "BV": 128}, num_warps=8, num_stages=3),
    ...           triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=3),
    ...           triton.Config({"BK": 32, "BV": 32}, num_warps=2, num_stages=3)]
    >>> pinned_config(o, hopper).kwargs
    {'BK': 64, 'BV': 64}
    >>> pinned_config(o, hopper[2:]).kwargs
    {'BK': 32, 'BV': 32}

Why a whole configuration and not a class of equivalent ones: of a Triton config's parameters only
``num_stages`` (software pipelining: the same operations in the same order) leaves every value's
reduction order alone. A block over a reduced dimension splits its sum (``BK`` below); ``num_warps``
sets the thread layout that ``tl.sum`` / ``tl.cumsum`` reduce along and, on Hopper, the MMA
instruction of a ``tl.dot`` (``mma.sync`` under 4 warps, ``wgmma`` from 4); a block over
independent columns (``BV`` of the state kernel) sums nothing across blocks but changes the MMA's
tile. Timing among configurations that differ in ``num_stages`` alone would save little, so none
is timed. The autotuned kernels logprobe runs, all fla-core 0.6.0's (logprobe's own take fixed
configurations; its L2 norm, autotuned per token count in fla, is ours: ``kernels.qk_norm``):

===================================================  =========================  ======================
kernel (fla.ops.)                                    what its configs vary      pinned (H200 table)
===================================================  =========================  ======================
utils.cumsum.chunk_local_cumsum_scalar_kernel        num_warps (the scan's      num_warps 2, stages 3
                                                     tree)
gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_   BK (k·kᵀ's sum over K),    BK 64, warps 1,
fwd_kkt_solve_kernel                                 num_warps                  stages 3
gated_delta_rule.wy_fast.recompute_w_u_fwd_kernel    num_warps, num_stages      warps 4, stages 2
common.chunk_delta_h.chunk_gated_delta_rule_fwd_     BV (state columns),        BV 32, warps 4,
kernel_h_blockdim64                                  num_warps, num_stages      stages 4
common.chunk_o.chunk_fwd_kernel_o                    BK (q·h and q·kᵀ over K),  BK 64, BV 64, warps 4,
                                                     BV, num_warps              stages 3
===================================================  =========================  ======================

How: ``bind_pins`` gives each autotuner a ``PinnableCache`` (its ``Autotuner.cache``, the dict the
tables seed and harvest); inside ``pinned()`` that cache holds every key, with the pinned
configuration, so Triton's ``run`` times nothing and records nothing, and outside it is the plain
dict again (default mode tunes as before, from the same tables). The engine enters ``pinned`` around
each deterministic forward pass (``KernelTuning.mode``); a context variable, so another thread's
engine in default mode is not affected. A pinned configuration that does not compile for a shape
fails loudly (Triton's error), never silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

FORMAT = 1
SHIPPED = Path(__file__).resolve().parent / "tuned"
PACKAGES = ("fla.", "logprobe.")  # modules whose autotuners are bound to the tables
_SCALARS = (bool, int, float, str, type(None))


def key_text(key: tuple) -> str | None:
    """A tuning key as JSON text; None when it holds anything but numbers, strings, booleans and
    None (nested tuples allowed), which could not come back equal from JSON."""

    def plain(v) -> bool:
        return isinstance(v, _SCALARS) or (isinstance(v, tuple) and all(plain(x) for x in v))

    return json.dumps(list(key)) if all(plain(v) for v in key) else None


def key_from_text(text: str) -> tuple:
    """The tuning key back from ``key_text`` (JSON lists become tuples, as Triton builds keys)."""

    def back(v):
        return tuple(back(x) for x in v) if isinstance(v, list) else v

    return back(json.loads(text))


def config_record(config) -> dict:
    """A ``triton.Config`` as plain data: its kwargs and launch options (``None`` ones left out)."""
    out = {"kwargs": dict(config.kwargs)}
    for name in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        value = getattr(config, name, None)
        if value is not None:
            out[name] = value
    return out


def matching_config(configs: Iterable, record: dict):
    """The configuration among ``configs`` that ``record`` describes, or None."""
    for config in configs:
        if config_record(config) == record:
            return config
    return None


class TuningTable:
    """Chosen configurations of one identity: ``kernels[kernel][key text] = config record``."""

    __slots__ = ("identity", "kernels")

    def __init__(self, identity: dict, kernels: dict | None = None) -> None:
        self.identity = dict(identity)
        self.kernels: dict[str, dict[str, dict]] = kernels if kernels is not None else {}

    def get(self, kernel: str, key: str) -> dict | None:
        return self.kernels.get(kernel, {}).get(key)

    def put(self, kernel: str, key: str, record: dict) -> bool:
        """Add a choice; False (and nothing changed) when the table already has one for the key."""
        entries = self.kernels.setdefault(kernel, {})
        if key in entries:
            return False
        entries[key] = record
        return True

    def merge(self, other: TuningTable) -> int:
        """Add ``other``'s choices for keys this table lacks; returns how many were added."""
        return sum(self.put(k, key, rec) for k, entries in other.kernels.items() for key, rec in entries.items())

    def __len__(self) -> int:
        return sum(len(v) for v in self.kernels.values())

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "identity": self.identity, "kernels": self.kernels}, indent=1,
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str, identity: dict) -> TuningTable | None:
        """The table in ``text``; None when it is of another identity (stale). ``ValueError``
        naming what is wrong when it is not a table of this format."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} tuning table")
        if not isinstance(data.get("identity"), dict) or not isinstance(data.get("kernels"), dict):
            raise ValueError("no identity or kernels")
        if data["identity"] != identity:
            return None
        for kernel, entries in data["kernels"].items():
            if not isinstance(entries, dict):
                raise ValueError(f"kernel {kernel}: not a mapping of keys")
            for key, rec in entries.items():
                key_from_text(key)  # ValueError when not JSON
                if not isinstance(rec, dict) or not isinstance(rec.get("kwargs"), dict):
                    raise ValueError(f"kernel {kernel}, key {key}: not a configuration")
        return cls(identity, data["kernels"])


def read_table(path: Path, identity: dict) -> TuningTable | None:
    """The table in ``path`` for ``identity``: None when the file is missing or stale; a warning
    and None when it is corrupt (the kernels are then tuned again and the file rewritten)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"logprobe: cannot read the kernel tuning cache {path}: {e}", stacklevel=2)
        return None
    try:
        return TuningTable.from_json(text, identity)
    except ValueError as e:  # json.JSONDecodeError is one
        warnings.warn(f"logprobe: the kernel tuning cache {path} is corrupt ({e}); ignored: the kernels are "
                      "tuned again and the file rewritten", stacklevel=2)
        return None


def write_table(path: Path, table: TuningTable) -> None:
    """Write ``table`` to ``path`` atomically: a reader sees the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(table.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shipped_table(identity: dict, folder: Path | None = None) -> TuningTable:
    """Every shipped table of ``identity`` merged (the ``kernels/tuned`` folder, or ``folder``;
    ``LOGPROBE_SHIPPED_TUNING`` names another folder: a benchmark's "nothing shipped" run)."""
    folder = folder or Path(os.environ.get("LOGPROBE_SHIPPED_TUNING") or SHIPPED)
    out = TuningTable(identity)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        table = read_table(path, identity)
        if table is not None:
            out.merge(table)
    return out


def identity_of(device_name: str) -> dict:
    """The identity of this process's tables on a GPU named ``device_name``: the Triton and
    fla-core versions (None when fla-core is not installed)."""
    import triton

    try:
        fla = importlib.metadata.version("fla-core")
    except Exception:  # not installed (or no metadata): fla's kernels are not run
        fla = None
    return {"device": device_name, "triton": triton.__version__, "fla": fla}


def cache_file(folder: Path, identity: dict) -> Path:
    """``folder/<device>-triton<v>-fla<v>.json`` (one file per identity, so GPUs of several kinds
    sharing a home directory keep their own)."""
    name = f"{identity['device']}-triton{identity['triton']}-fla{identity['fla']}"
    return folder / (re.sub(r"[^A-Za-z0-9.+-]+", "_", name) + ".json")


def find_autotuners(prefixes: tuple[str, ...] = PACKAGES) -> dict[str, object]:
    """The Triton autotuners defined in the loaded modules under ``prefixes``, by ``module.qualname``
    of the tuned function (a ``heuristics`` wrapper around one is looked through)."""
    from triton.runtime.autotuner import Autotuner

    found: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # heuristics(autotune(jit(fn))): look through the wrappers
                if isinstance(value, Autotuner):
                    fn = value.base_fn
                    found[f"{fn.__module__}.{fn.__qualname__}"] = value
                    break
                value = getattr(value, "fn", None)
                if value is None:
                    break
    return found


def seed(autotuners: dict[str, object], table: TuningTable) -> int:
    """Put the table's choices into the autotuners' caches (keys they do not hold yet); returns
    how many were put."""
    put = 0
    for name, tuner in autotuners.items():
        for text, record in table.kernels.get(name, {}).items():
            key = key_from_text(text)
            config = matching_config(tuner.configs, record)
            # the entries themselves (a PinnableCache holds every key while pinned)
            if config is not None and not dict.__contains__(tuner.cache, key):
                tuner.cache[key] = config
                put += 1
    return put


def harvest(autotuners: dict[str, object], table: TuningTable) -> int:
    """Record the autotuners' choices that ``table`` lacks or holds otherwise (a choice the kernel
    no longer offers, re-tuned); returns how many were recorded."""
    added = 0
    for name, tuner in autotuners.items():
        for key, config in list(tuner.cache.items()):
            text, record = key_text(key), config_record(config)
            if text is not None and table.get(name, text) != record:
                table.kernels.setdefault(name, {})[text] = record
                added += 1
    return added


# The H200 table's choices (kernels/tuned/NVIDIA_H200-*.json, Qwen3.5-4B shapes): deterministic
# mode's configuration of each kernel, for every key (see the module docstring)
PINS: dict[str, dict] = {
    "fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel":
        {"kwargs": {}, "num_warps": 2, "num_stages": 3, "num_ctas": 1},
    "fla.ops.gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel":
        {"kwargs": {"BK": 64}, "num_warps": 1, "num_stages": 3, "num_ctas": 1},
    "fla.ops.gated_delta_rule.wy_fast.recompute_w_u_fwd_kernel":
        {"kwargs": {}, "num_warps": 4, "num_stages": 2, "num_ctas": 1},
    "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64":
        {"kwargs": {"BV": 32}, "num_warps": 4, "num_stages": 4, "num_ctas": 1},
    "fla.ops.common.chunk_o.chunk_fwd_kernel_o":
        {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1},
}
# whether this thread's (context's) autotuned calls run pinned: set by ``pinned`` only. A context
# variable because the autotuners are fla's module globals, shared by every engine of the process.
_PINNED: ContextVar[bool] = ContextVar("logprobe_pinned_autotuning", default=False)


def pinned_config(kernel: str, configs: list, pins: dict[str, dict] = PINS):
    """The configuration deterministic mode runs ``kernel`` with, for every key: its ``pins``
    record when ``configs`` offer it, else the first of ``configs`` (the module docstring's
    example). Depends on the kernel's name and configuration list only, so every process of one
    GPU kind and library versions pins the same."""
    record = pins.get(kernel)
    found = matching_config(configs, record) if record is not None else None
    return found if found is not None else configs[0]


class PinnableCache(dict):
    """An autotuner's ``cache`` (key -> config, what the tables seed and harvest) that, inside
    ``pinned()``, holds every key with the pinned configuration: Triton's ``Autotuner.run`` asks
    only ``key in cache`` and ``cache[key]``, so it times and records nothing there."""

    def __init__(self, pin, entries: dict) -> None:
        super().__init__(entries)
        self.pin = pin

    def __contains__(self, key) -> bool:
        return _PINNED.get() or super().__contains__(key)

    def __getitem__(self, key):
        return self.pin if _PINNED.get() else super().__getitem__(key)


def bind_pins(autotuners: dict[str, object], pins: dict[str, dict] = PINS) -> int:
    """Give each autotuner a ``PinnableCache`` (its entries kept); returns how many were bound."""
    bound = 0
    for name, tuner in autotuners.items():
        if not isinstance(tuner.cache, PinnableCache):
            tuner.cache = PinnableCache(pinned_config(name, tuner.configs, pins), tuner.cache)
            bound += 1
    return bound


@contextmanager
def pinned(on: bool = True) -> Iterator[None]:
    """Within: the bound autotuners (``bind_pins``) run their pinned configurations (``on``),
    or tune and read their caches as usual (not ``on``), in this thread only."""
    token = _PINNED.set(on)
    try:
        yield
    finally:
        _PINNED.reset(token)


def default_cache_dir() -> Path:
    """``$LOGPROBE_CACHE/kernels``, else ``$XDG_CACHE_HOME/logprobe/kernels``, else
    ``~/.cache/logprobe/kernels`` (``LOGPROBE_CACHE`` also holds GGUF models' tokenizers)."""
    root = os.environ.get("LOGPROBE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "logprobe"
    return Path(root) / "kernels"


class KernelTuning:
    """The tables bound to this process's autotuners on one GPU (``Engine`` holds one on CUDA).

    ``start()`` imports the modules a model declares (``preload``: their autotuners must exist
    before the first pass) and seeds every autotuner found from the shipped tables and the cache
    file; ``after_run()`` seeds autotuners of modules loaded since, records what the run tuned
    and, when that is new, writes the cache file. ``cache_dir`` None: the shipped tables only,
    nothing written."""

    def __init__(self, device_name: str, cache_dir: Path | None, preload: tuple[str, ...] = (),
                 shipped: Path | None = None, packages: tuple[str, ...] = PACKAGES) -> None:
        self.identity = identity_of(device_name)
        self.path = cache_file(cache_dir, self.identity) if cache_dir is not None else None
        self.table = shipped_table(self.identity, shipped)
        self.shipped = len(self.table)
        cached = read_table(self.path, self.identity) if self.path is not None else None
        self.cached = self.table.merge(cached) if cached is not None else 0
        self.preload = preload
        self.packages = packages
        self.seeded = 0  # choices put into autotuners' caches
        self.tuned = 0  # choices recorded from autotuners (tuned here, or found there)
        self._modules = -1  # len(sys.modules) at the last scan
        self._autotuners: dict[str, object] = {}
        self._warned = False

    def start(self) -> KernelTuning:
        for name in self.preload:
            try:
                importlib.import_module(name)
            except Exception:  # an optional extra that is not installed: its kernels are not run
                pass
        self._scan()
        return self

    def _scan(self) -> None:
        if len(sys.modules) != self._modules:
            self._modules = len(sys.modules)
            self._autotuners = find_autotuners(self.packages)
            bind_pins(self._autotuners)
            self.seeded += seed(self._autotuners, self.table)

    @contextmanager
    def mode(self, deterministic: bool) -> Iterator[None]:
        """Around a forward pass: the autotuners found (those of modules loaded since, too) run
        their pinned configurations when ``deterministic``, else tune as the tables allow."""
        self._scan()
        with pinned(deterministic):
            yield

    def after_run(self) -> int:
        """Record the run's new choices (written to the cache file); returns how many."""
        self._scan()
        added = harvest(self._autotuners, self.table)
        self.tuned += added
        if added and self.path is not None:
            self.save()
        return added

    def save(self) -> None:
        """Write the table (merged with what another process wrote meanwhile) to the cache file;
        a failure is one warning, and the run goes on."""
        try:
            other = read_table(self.path, self.identity)
            if other is not None:
                self.table.merge(other)
            write_table(self.path, self.table)
        except OSError as e:
            if not self._warned:
                warnings.warn(f"logprobe: cannot write the kernel tuning cache {self.path}: {e} (set "
                              "LOGPROBE_CACHE to a writable folder, or tuning_cache=False)", stacklevel=2)
                self._warned = True

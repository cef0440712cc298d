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
from collections.abc import Iterable
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
            if config is not None and key not in tuner.cache:
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
            self.seeded += seed(self._autotuners, self.table)

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

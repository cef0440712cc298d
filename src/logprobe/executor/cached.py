"""A persistent result cache: ``CachedExecutor`` answers the requests it has seen before from a
SQLite file (``ResultCache``) and forwards the others to the real executor, storing their results
as they complete. ``Scorer(cache=DIR)``, ``--cache DIR`` and ``logprobe cache stats|clear`` use it.

What a stored result is keyed by (sha256 of all of it):

    model   the weights (``weights_fingerprint``: sha256 over every parameter's and buffer's name,
            shape, dtype and bytes, computed once per weights version: at the first cached run,
            again after each update_weights / load_weights), the model's config (its repr: rope,
            norm eps, window, ...), the tokenizer (its serialized vocabulary, merges and BOS
            handling), the backend, the compute dtype, the device kind (cpu / cuda), the
            deterministic mode (``EngineConfig.deterministic``, tp_invariant included) and the
            tensor-parallel size
    request the token ids, score_begin, temperature, top_k, entropy, each image's digest (its
            pixel values and grid: ``ImageInputs.keys``), and any further option a ScoreRequest
            carries away from its default when it is a plain scalar (e.g. route); any other (e.g.
            forced experts) makes the request uncached

Not in the key: the batch budget, what else shares a batch, chunking. Outside deterministic mode
these move numbers in the last bits; a hit returns the numbers of the run that stored them.
Requests with ``steer`` or ``capture`` are never cached (hidden-state work is not repeated
evaluation); they always run. A parallel scorer (worker processes hold the weights) keys its
weights by the checkpoint files (names, sizes, mtimes) and stops caching after an update_weights
/ load_weights it cannot hash (it holds no weights in this process).

Storage: one SQLite database ``DIR/results.sqlite`` in WAL mode; every write is a transaction, so
a writer killed mid-write (SIGKILL) leaves the entries it committed and none half-written, and
several processes may read and write one cache at once (``busy_timeout``: a writer waits for the
lock). Numbers are stored as the raw bytes of their tensors (float32 as float32; ids and ranks as
int32 when they fit) and come back bitwise equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig
from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError

DB_NAME = "results.sqlite"
SCHEMA_VERSION = 1
FLUSH_EVERY = 256  # results buffered before one write transaction (and at the end of every run)
_KEYED = ("tokens", "score_begin", "temperature", "top_k", "entropy")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key BLOB PRIMARY KEY, model TEXT NOT NULL, meta TEXT NOT NULL, data BLOB NOT NULL, created REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS results_model ON results(model);
CREATE TABLE IF NOT EXISTS models (model TEXT PRIMARY KEY, description TEXT NOT NULL, first_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


# -- fingerprints ---------------------------------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes (host copy, any dtype)."""
    t = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy())


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's and buffer's name, shape, dtype and bytes (in module order)."""
    h = hashlib.sha256()
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name in seen:
            continue
        seen.add(name)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\n".encode())
        if t.device.type != "meta":
            h.update(tensor_bytes(t))
    return h.hexdigest()


def files_fingerprint(path: str) -> str:
    """sha256 over the relative names, sizes and mtimes of the files at ``path`` (a file or a tree)."""
    p = Path(path)
    h = hashlib.sha256(str(p.resolve()).encode())
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(p) if f != p else f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialized form (vocabulary, merges, normalizers) and BOS handling."""
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(hf.get_vocab().items()))
    extra = f"|{getattr(tokenizer, 'add_bos', None)}|{getattr(tokenizer, 'bos_id', None)}|{getattr(tokenizer, 'eos_id', None)}"
    return hashlib.sha256((text + extra).encode()).hexdigest()


class ModelIdentity:
    """The model part of every key: ``key(config)`` -> (hex key, description) or None (do not cache).

    ``loaded``: the LoadedModel (its ``model`` holds the weights when ``in_process``); ``version()``
    the scorer's weights version, +1 per successful update: the weights are hashed again then."""

    def __init__(self, loaded: Any, in_process: bool, version: Callable[[], int], tensor_parallel_size: int = 1,
                 expert_parallel_size: int = 1, attention: str = "tensor", placement=None):
        self.loaded, self.in_process, self.version, self.tp = loaded, in_process, version, tensor_parallel_size
        self.ep = expert_parallel_size  # default mode's bits depend on it (keys without it: 1)
        self.attention = attention  # and on the attention layout (keys without it: "tensor")
        self.placement = placement  # and on which rank computes each slot (replicas of experts; keys without: none)
        self._weights: tuple[int, str | None] | None = None
        self._tokenizer: str | None = None
        self.hash_seconds = 0.0  # time the last weights hash took

    def weights(self) -> str | None:
        v = self.version()
        if self._weights is None or self._weights[0] != v:
            t0 = time.perf_counter()
            if self.in_process:
                fp = "w:" + weights_fingerprint(self.loaded.model)
            elif v == 0 and self.loaded.info.path and os.path.exists(self.loaded.info.path):
                fp = "f:" + files_fingerprint(self.loaded.info.path)
            else:
                fp = None  # updated weights held by worker processes: nothing here to hash
            self.hash_seconds = time.perf_counter() - t0
            self._weights = (v, fp)
        return self._weights[1]

    def key(self, config: EngineConfig) -> tuple[str, dict] | None:
        w = self.weights()
        if w is None:
            return None
        if self._tokenizer is None:
            self._tokenizer = tokenizer_fingerprint(self.loaded.tokenizer)
            # the architecture's numbers (rope, eps, window, ...), which no weight holds
            self._arch = hashlib.sha256(repr(getattr(self.loaded.model, "config", None)).encode()).hexdigest()
        info = self.loaded.info
        desc = {"name": info.name, "path": info.path, "backend": info.backend, "dtype": str(info.dtype),
                "device": str(info.device).split(":")[0], "deterministic": repr(config.deterministic),
                "tensor_parallel_size": self.tp, "weights": w, "tokenizer": self._tokenizer, "config": self._arch,
                "schema": SCHEMA_VERSION}
        if self.ep != 1:
            desc["expert_parallel_size"] = self.ep
        if self.attention != "tensor":
            desc["attention_parallel"] = self.attention
        if self.placement is not None:
            desc["expert_replicas"] = [list(h) for h in self.placement.held]
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest(), desc


def request_key(model: str, r: ScoreRequest) -> bytes | None:
    """The key of one request under ``model``; None when it is not cacheable (steer, capture, or an
    option that is not a plain scalar)."""
    if r.steer or r.capture:
        return None
    h = hashlib.sha256(model.encode())
    h.update(struct.pack("<qdq?", r.score_begin, float(r.temperature), r.top_k, bool(r.entropy)))
    for f in fields(r):  # options added to ScoreRequest later join the key (or turn caching off)
        if f.name in _KEYED or f.name in ("steer", "capture"):
            continue
        v = getattr(r, f.name)
        if f.name == "images" and v is not None:  # what the images are: each one's digest
            h.update(f"|images={','.join(v.keys)}".encode())
            continue
        if v is f.default or (isinstance(v, (bool, int, float, str)) and v == f.default):
            continue  # at its default: the request asks what it asked before the option existed
        if v is not None and not isinstance(v, (bool, int, float, str)):
            return None
        h.update(f"|{f.name}={v!r}".encode())
    h.update(b"|tokens|")
    h.update(struct.pack(f"<{len(r.tokens)}q", *r.tokens))
    return h.digest()


# -- results as bytes -----------------------------------------------------------------------------

def encode_result(res: RequestResult) -> tuple[str, bytes] | None:
    """(meta JSON, bytes) of a result's tensors; None if it holds something else (not cached)."""
    meta, parts, offset = [], [], 0
    for f in fields(res):
        v = getattr(res, f.name)
        if v is None or f.name == "cached_tokens":  # how the prefix cache served it, not a result: not stored
            continue
        if not isinstance(v, torch.Tensor):
            return None
        t = v.detach().cpu().contiguous()
        stored = t
        if t.dtype == torch.int64 and (t.numel() == 0 or (t.min() >= -2**31 and t.max() < 2**31)):
            stored = t.to(torch.int32)  # ids and ranks: exact in int32, half the bytes
        b = bytes(tensor_bytes(stored)) if stored.numel() else b""
        meta.append([f.name, str(t.dtype).removeprefix("torch."), str(stored.dtype).removeprefix("torch."),
                     list(t.shape), offset, len(b)])
        parts.append(b)
        offset += len(b)
    return json.dumps(meta, separators=(",", ":")), b"".join(parts)


def decode_result(meta: str, data: bytes) -> RequestResult:
    kw = {}
    for name, dtype, stored, shape, offset, size in json.loads(meta):
        st = getattr(torch, stored)
        if size:
            t = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=st)
        else:
            t = torch.empty(0, dtype=st)
        kw[name] = t.reshape(shape).to(getattr(torch, dtype))
    return RequestResult(**kw)


# -- the database ---------------------------------------------------------------------------------

def _switch_to_wal(db: sqlite3.Connection, tries: int = 200) -> None:
    """``PRAGMA journal_mode = WAL``, retried: two processes opening a new database at once can get
    "database is locked" from it at once, whatever the busy timeout (the switch takes an exclusive
    lock that SQLite does not wait for)."""
    for attempt in range(tries):
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == tries - 1:
                raise
            time.sleep(0.05)


class ResultCache:
    """One cache directory (``DIR/results.sqlite``); safe to share between threads and processes."""

    def __init__(self, directory: str | os.PathLike, create: bool = True) -> None:
        self.directory = Path(directory).expanduser()
        self.path = self.directory / DB_NAME
        if not create and not self.path.exists():
            raise LogprobeError("--cache", f"{str(self.directory)!r} holds no logprobe cache ({DB_NAME})",
                                "give the directory that --cache wrote")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=60.0, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 60000")
            _switch_to_wal(self._db)
            self._db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
            with self._transaction():
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    self._db.execute(stmt)
        except (sqlite3.Error, OSError) as e:
            raise LogprobeError("--cache", f"cannot open {str(self.path)!r}: {e}",
                                "give a writable directory (a local disk: SQLite locking needs one)") from e
        self._lock = threading.Lock()

    def _transaction(self):
        db = self._db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, exc_type, *rest):
                db.execute("COMMIT" if exc_type is None else "ROLLBACK")
                return False

        return _Tx()

    def close(self) -> None:
        self._db.close()

    def get(self, keys: list[bytes]) -> dict[bytes, RequestResult]:
        out = {}
        with self._lock:
            for s in range(0, len(keys), 500):
                chunk = keys[s:s + 500]
                rows = self._db.execute(f"SELECT key, meta, data FROM results WHERE key IN "
                                        f"({','.join('?' * len(chunk))})", chunk).fetchall()
                for key, meta, data in rows:
                    out[bytes(key)] = decode_result(meta, data)
        return out

    def put(self, model: str, description: dict, entries: list[tuple[bytes, str, bytes]],
            hits: int = 0, misses: int = 0) -> None:
        """Store ``(key, meta, data)`` entries (the first writer of a key wins) and count hits/misses,
        in one transaction."""
        now = time.time()
        with self._lock, self._transaction():
            self._db.execute("INSERT OR IGNORE INTO models VALUES (?, ?, ?)",
                             (model, json.dumps(description, sort_keys=True), now))
            self._db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?)",
                                 [(k, model, m, d, now) for k, m, d in entries])
            for name, n in (("hits", hits), ("misses", misses)):
                if n:
                    self._db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                                     "value = value + excluded.value", (name, n))

    def stats(self) -> dict:
        with self._lock:
            db = self._db
            entries, data = db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data) + LENGTH(meta)), 0) "
                                       "FROM results").fetchone()
            counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
            models = []
            for model, desc, first, n in db.execute(
                    "SELECT m.model, m.description, m.first_seen, (SELECT COUNT(*) FROM results r "
                    "WHERE r.model = m.model) FROM models m ORDER BY m.first_seen").fetchall():
                d = json.loads(desc)
                models.append({"model": model[:16], "name": d.get("name"), "dtype": d.get("dtype"),
                               "device": d.get("device"), "deterministic": d.get("deterministic"),
                               "weights": (d.get("weights") or "")[:18], "entries": n,
                               "first_seen": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(first))})
        size = sum(f.stat().st_size for f in self.directory.glob(DB_NAME + "*") if f.is_file())
        return {"path": str(self.path), "entries": entries, "data_bytes": data, "file_bytes": size,
                "hits": counters.get("hits", 0), "misses": counters.get("misses", 0), "models": models}

    def clear(self, model: str | None = None) -> int:
        """Delete every entry (``model``: those of models whose key starts with it or whose name or
        path equals it); returns how many. The file shrinks (VACUUM) when everything went."""
        with self._lock:
            with self._transaction():
                if model is None:
                    n = self._db.execute("DELETE FROM results").rowcount
                    self._db.execute("DELETE FROM models")
                    self._db.execute("DELETE FROM counters")
                else:
                    keys = [m for m, desc in self._db.execute("SELECT model, description FROM models")
                            if m.startswith(model) or model in (json.loads(desc).get("name"),
                                                                json.loads(desc).get("path"))]
                    n = 0
                    for m in keys:
                        n += self._db.execute("DELETE FROM results WHERE model = ?", (m,)).rowcount
                        self._db.execute("DELETE FROM models WHERE model = ?", (m,))
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            if model is None:
                self._db.execute("VACUUM")
        return n


# -- the executor ---------------------------------------------------------------------------------

class CachedExecutor:
    """An ``Executor`` over another: cached requests are answered here (no forward pass), the rest
    run on ``inner`` and are stored as they complete. Every other attribute is the inner one's
    (read and written: ``fault_hook``, ``oom_count``, ...)."""

    _OWN = frozenset({"inner", "cache", "identity"})

    def __init__(self, inner: Any, cache: ResultCache, identity: ModelIdentity) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "identity", identity)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    @property
    def config(self) -> EngineConfig:
        return self.inner.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.inner.config = config

    @property
    def per_request_errors(self) -> bool:
        return self.inner.per_request_errors

    @property
    def in_process(self) -> bool:
        return self.inner.in_process

    def close(self) -> None:
        self.inner.close()
        self.cache.close()

    def run(self, requests: list[ScoreRequest], on_result: Callable[[int, RequestResult], None] | None = None,
            progress: bool | None = None, *, on_error: Callable[[int, Exception], None] | None = None,
            stop: Callable[[], bool] | None = None,
            cancelled: Callable[[int], bool] | None = None) -> list[RequestResult]:
        if self.weights_refusal is not None:  # not even a hit: the weights are not the cached version's
            raise self.weights_refusal
        ident = self.identity.key(self.inner.config)
        if ident is None:
            return self.inner.run(requests, on_result, progress, on_error=on_error, stop=stop, cancelled=cancelled)
        model, desc = ident
        keys = [request_key(model, r) for r in requests]
        found = self.cache.get(list({k for k in keys if k is not None}))
        results: list[Any] = [None] * len(requests)
        miss = []
        hits = 0
        for i, k in enumerate(keys):
            if k is not None and k in found:
                if cancelled is not None and cancelled(i):
                    continue
                results[i] = found[k]
                hits += 1
                if on_result is not None:
                    on_result(i, found[k])
            else:
                miss.append(i)
        pending: list[tuple[bytes, str, bytes]] = []
        counts = {"hits": hits, "misses": 0}  # not yet written

        def flush() -> None:
            if pending or counts["hits"] or counts["misses"]:
                self.cache.put(model, desc, pending, **counts)
                counts.update(hits=0, misses=0)
                pending.clear()

        def got(j: int, res: RequestResult) -> None:
            i = miss[j]
            k = keys[i]
            if k is not None:
                enc = encode_result(res)
                if enc is not None:
                    pending.append((k, *enc))
                    counts["misses"] += 1
                    if len(pending) >= FLUSH_EVERY:
                        flush()
            if on_result is not None:
                on_result(i, res)

        if not miss:
            flush()
            return results
        try:
            sub = self.inner.run(
                [requests[i] for i in miss], got, progress,
                on_error=None if on_error is None else (lambda j, e: on_error(miss[j], e)), stop=stop,
                cancelled=None if cancelled is None else (lambda j: cancelled(miss[j])))
        finally:
            flush()  # what completed is kept, even when the run stops or fails
        for j, res in enumerate(sub):
            results[miss[j]] = res
        return results


def with_cache(engine: Any, loaded: Any, directory: str | os.PathLike, version: Callable[[], int],
               tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
               attention: str = "tensor") -> CachedExecutor:
    """``engine`` behind the cache at ``directory`` (a Scorer's ``cache=``)."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise LogprobeError("cache", f"must be a directory path, got {directory!r}")
    if engine.in_process and tensor_parallel_size != 1:
        # torchrun: each rank holds a shard; ranks must run the same passes, which a hit on one
        # rank and a miss on another would break
        raise LogprobeError("cache", "is not supported under torchrun (each rank holds a shard)",
                            "use tensor_parallel_size with library-owned workers, or no cache")
    return CachedExecutor(engine, ResultCache(directory),
                          ModelIdentity(loaded, engine.in_process, version, tensor_parallel_size,
                                        expert_parallel_size, attention, getattr(engine, "placement", None)))

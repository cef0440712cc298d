"""Models by Hugging Face hub id: ``ORG/NAME[@REVISION]`` or ``ORG/NAME[@REVISION]:FILE.gguf``.

``hub_path(spec)`` is None for anything that is not a hub id (a known name, an existing path);
otherwise the local directory (a snapshot of the repo's config, tokenizer and safetensors files)
or the local ``.gguf`` file. The cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when called) is tried first; only when the files are not there
and ``HF_HUB_OFFLINE`` is not set is anything downloaded. Every failure is a ``LogprobeError``
naming the id and the cache directory.

>>> parse_hub_id("Qwen/Qwen3-0.6B@main"), parse_hub_id("org/repo:model-Q4_K_M.gguf")
(('Qwen/Qwen3-0.6B', 'main', None), ('org/repo', None, 'model-Q4_K_M.gguf'))
>>> parse_hub_id("./models/x") is None, parse_hub_id("model.gguf") is None
(True, True)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import LogprobeError

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w./-]+?))?(?::(?P<file>[^:@]+\.gguf))?$")
# what a model directory needs: config, tokenizer files and safetensors weights (no .bin, .gguf, .pt)
SNAPSHOT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.py"]


def parse_hub_id(spec: str) -> tuple[str, str | None, str | None] | None:
    """``(repo_id, revision, gguf_file)`` of a hub id, or None when ``spec`` is not one."""
    m = _ID.match(spec)
    if m is None or spec.startswith((".", "/", "~")):
        return None
    return m.group("repo"), m.group("rev"), m.group("file")


def hub_cache() -> str:
    """The hub cache directory, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


class IncompleteSnapshot(Exception):
    """A cached (or downloaded) snapshot with its config but without weight files."""

    def __init__(self, path: str, missing: list[str]) -> None:
        super().__init__(f"{path} lacks {', '.join(missing)}")
        self.path, self.missing = path, missing


def download_command(repo: str, revision: str | None = None, gguf_file: str | None = None) -> str:
    """The ``hf download`` line that fetches exactly what the id names.

    >>> download_command("org/name", "v2.0"), download_command("org/name-GGUF", None, "m-Q4_0.gguf")
    ('hf download org/name --revision v2.0', 'hf download org/name-GGUF m-Q4_0.gguf')
    """
    return f"hf download {repo}" + (f" {gguf_file}" if gguf_file else "") + (f" --revision {revision}" if revision else "")


def missing_weights(path: Path) -> list[str]:
    """The weight files a model directory lacks: the shards its index lists that are not there,
    or ``*.safetensors`` when it has no index and no safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            return []  # not ours to judge: the loader reports a bad index
        return [s for s in shards if not (path / s).exists()]
    return [] if any(path.glob("*.safetensors")) else ["*.safetensors"]


def hub_path(spec: str) -> Path | None:
    """The local path of hub id ``spec`` (downloaded if missing and allowed), or None if not a hub id."""
    if Path(spec).expanduser().exists():
        return None
    parsed = parse_hub_id(spec)
    if parsed is None:
        return None
    repo, revision, gguf_file = parsed
    cache = hub_cache()
    download = download_command(repo, revision, gguf_file)
    try:
        return Path(_fetch(repo, revision, gguf_file, cache, local_only=True))
    except IncompleteSnapshot as e:  # config and tokenizer cached, weights not: a cut-off download
        if offline():
            raise LogprobeError("model", f"{spec!r}: the cached snapshot {e.path} is incomplete: it has the config "
                                f"but not the weight files ({', '.join(e.missing)}); HF_HUB_OFFLINE is set",
                                f"download the weight files: run `{download}` while online, or unset "
                                "HF_HUB_OFFLINE") from None
        first = e
    except Exception as e:  # not cached (or partly): go online unless told not to
        if offline():
            raise LogprobeError("model", f"{spec!r} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE "
                                "is set", f"run `{download}` while online, or unset HF_HUB_OFFLINE") from None
        first = e
    try:
        return Path(_fetch(repo, revision, gguf_file, cache, local_only=False))
    except IncompleteSnapshot as e:
        raise LogprobeError("model", f"{spec!r}: the snapshot {e.path} has the config but no weight files "
                            f"({', '.join(e.missing)}) after downloading",
                            "check that the repo holds *.safetensors weights (logprobe does not read .bin), or "
                            f"delete the snapshot and run `{download}`") from None
    except Exception as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise LogprobeError("model", f"{spec!r}: not in the Hugging Face cache {cache} ({type(first).__name__}), "
                            f"and the download failed: {reason}",
                            "check the id (ORG/NAME[@REVISION][:FILE.gguf]), the network, or HF_TOKEN") from None


def _fetch(repo: str, revision: str | None, gguf_file: str | None, cache: str, local_only: bool) -> str:
    import huggingface_hub as hh

    if gguf_file is not None:
        return hh.hf_hub_download(repo, gguf_file, revision=revision, cache_dir=cache, local_files_only=local_only)
    path = hh.snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=local_only,
                                allow_patterns=SNAPSHOT_FILES)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{repo} has no config.json (a GGUF repo? give ORG/NAME:FILE.gguf)")
    missing = missing_weights(Path(path))
    if missing:
        raise IncompleteSnapshot(path, missing)
    return path

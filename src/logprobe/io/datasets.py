"""Rows of a dataset through the ``datasets`` library: a hub name (the local cache first), a
local dataset directory (``save_to_disk`` output, or data files laid out like a hub repo), or a
data file.

Offline (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) with nothing cached is a
``LogprobeError`` naming the dataset and the cache directory, never a traceback.

>>> import tempfile, os, json
>>> d = tempfile.mkdtemp(); f = os.path.join(d, "test.jsonl")
>>> _ = open(f, "w").write(json.dumps({"text": "a b"}) + "\\n")
>>> [r.data["text"] for r in dataset_rows(d, None, "test", None)]        # doctest: +SKIP
['a b']
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import LogprobeError
from .tables import Row


def _offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_split(name: str, config: str | None, split: str):
    """The ``split`` of dataset ``name`` (config ``config``) as a ``datasets.Dataset``."""
    try:
        import datasets
    except ImportError as e:
        raise LogprobeError("--dataset", "needs the datasets package", "pip install datasets") from e
    path = Path(name).expanduser()
    saved = path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())
    try:
        if saved:
            ds = datasets.load_from_disk(str(path))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, config, split=split)
    except KeyError:
        raise LogprobeError("--split", f"{name!r} has no split {split!r}", "give one of its splits") from None
    except Exception as e:  # the datasets library raises many kinds; the reason goes on one line
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        where = f" (config {config!r})" if config else ""
        if path.exists():
            raise LogprobeError("--dataset", f"cannot read {name!r}{where}: {reason}",
                                "give a saved dataset directory, a directory of data files, or a data file") from None
        cache = datasets.config.HF_DATASETS_CACHE
        fix = ("it is not in the cache and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set: download it once online, "
               "or give a local directory") if _offline() else "check the name, config and split"
        raise LogprobeError("--dataset", f"cannot load {name!r}{where}, split {split!r} (cache {cache}): {reason}",
                            fix) from None


def dataset_rows(name: str, config: str | None, split: str, num_samples: int | None) -> Iterator[Row]:
    """The first ``num_samples`` rows (all when None) of a dataset split, as table ``Row``s."""
    ds = load_split(name, config, split)
    n = len(ds) if num_samples is None else min(num_samples, len(ds))
    for index in range(n):
        yield Row(index, f"row {index + 1}", ds[index])

"""Steering vectors: read them (inline, safetensors, GGUF control vectors), write them, train them.

A vector source maps layers to directions. Layer ``l``'s direction belongs to
``blocks.{l}.resid_post``, the point llama.cpp's ``--control-vector`` adds ``direction.{l}`` to
(after block ``l``; llama.cpp never steers block 0's output, logprobe can).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from .points import resolve_points

ANY = "*"  # key of a vector that applies at every point of ``at``


def as_vector(value, hidden: int, field: str) -> torch.Tensor:
    """A list of numbers or a 1-D tensor of width ``hidden`` -> float32 [H], all finite."""
    if isinstance(value, torch.Tensor):
        v = value.detach().to("cpu", torch.float32)
    elif isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  for x in value):
        v = torch.tensor(value, dtype=torch.float32)
    else:
        raise LogprobeError(field, "must be a list of numbers, a 1-D tensor, a {layer: vector} object or the "
                            "path of a .safetensors / .gguf file")
    if v.ndim != 1 or v.numel() != hidden:
        raise LogprobeError(field, f"has width {v.numel() if v.ndim == 1 else tuple(v.shape)}, the model's "
                            f"hidden size is {hidden}", f"give {hidden} numbers")
    if not torch.isfinite(v).all():
        raise LogprobeError(field, "has a NaN or infinite entry")
    return v


def _key(key, num_layers: int, field: str) -> str:
    """A layer number (int or digits) or a hook-point name -> a canonical point name."""
    try:
        return _key_point(key, num_layers, field)
    except LogprobeError as e:
        if e.field == field:
            raise
        raise LogprobeError(field, e.problem, e.fix) from None


def _key_point(key, num_layers: int, field: str) -> str:
    if isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and re.fullmatch(r"-?\d+", key):
        return resolve_points(f"blocks.{int(key)}.resid_post", num_layers)[0]
    if isinstance(key, str):
        m = re.fullmatch(r"direction\.(\d+)", key)
        if m:
            return resolve_points(f"blocks.{m.group(1)}.resid_post", num_layers)[0]
        points = resolve_points(key, num_layers)
        if len(points) == 1:
            return points[0]
    raise LogprobeError(field, f"key {key!r} is not a layer number or a single hook point")


def load_vectors(source, hidden: int, num_layers: int, field: str = "vector") -> dict[str, torch.Tensor]:
    """One vector for every point (``{"*": v}``) or ``{canonical point: v}`` from a per-layer source."""
    if isinstance(source, (str, Path)):
        return read_vector_file(Path(source), hidden, num_layers, field)
    if isinstance(source, dict):
        if not source:
            raise LogprobeError(field, "is an empty object", "give {layer: vector} entries")
        return {_key(k, num_layers, field): as_vector(v, hidden, f"{field}[{k}]") for k, v in source.items()}
    return {ANY: as_vector(source, hidden, field)}


def read_vector_file(path: Path, hidden: int, num_layers: int, field: str = "vector") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise LogprobeError(field, f"{path} is not a file", "give an existing .safetensors or .gguf file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except Exception as e:
            raise LogprobeError(field, f"{path} is not a readable safetensors file ({e})") from e
    elif path.suffix == ".gguf":
        tensors = _read_gguf(path, field)
    else:
        raise LogprobeError(field, f"{path} is neither .safetensors nor .gguf")
    if not tensors:
        raise LogprobeError(field, f"{path} holds no vectors")
    return {_key(k, num_layers, f"{field} ({path.name})"): as_vector(v.flatten(), hidden, f"{field} ({path.name}: {k})")
            for k, v in tensors.items()}


def _read_gguf(path: Path, field: str) -> dict[str, torch.Tensor]:
    import gguf
    import numpy as np

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise LogprobeError(field, f"{path} is not a readable GGUF file ({e})") from e
    out = {}
    for t in reader.tensors:
        if not re.fullmatch(r"direction\.\d+", t.name):
            raise LogprobeError(field, f"{path.name} holds tensor {t.name!r}, not a control vector",
                                "a control-vector GGUF holds direction.{layer} tensors only")
        if int(t.tensor_type) != 0:
            raise LogprobeError(field, f"{path.name}: {t.name} is {t.tensor_type.name}, control vectors are F32")
        out[t.name] = torch.from_numpy(np.array(t.data, dtype=np.float32, copy=True))
    return out


def write_gguf(path: str | Path, directions: dict[int, torch.Tensor], model_hint: str = "llama") -> Path:
    """A control-vector GGUF (``controlvector`` architecture, ``direction.{l}`` F32 tensors), the file
    llama.cpp's ``--control-vector`` and repeng read. Layer 0 is refused: llama.cpp cannot apply it."""
    import gguf

    path = Path(path)
    if 0 in directions:
        raise LogprobeError("layers", "llama.cpp control vectors cannot hold layer 0",
                            "train on layers >= 1, or save as safetensors")
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", model_hint)
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer in sorted(directions):
        writer.add_tensor(f"direction.{layer}", directions[layer].detach().cpu().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_safetensors(path: str | Path, directions: dict[int, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file({str(k): v.detach().cpu().float().contiguous() for k, v in directions.items()}, str(path))
    return Path(path)


class SteeringVector:
    """Per-layer directions (``{layer: [H]}``) for ``blocks.{layer}.resid_post``."""

    def __init__(self, directions: dict[int, torch.Tensor], method: str = "") -> None:
        self.directions = {int(k): v.float() for k, v in directions.items()}
        self.method = method

    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    def steer(self, coeff: float | dict = 1.0, positions="all", op: str = "add") -> dict:
        """A ``steer`` entry for ``Scorer.score(..., steer=[...])``."""
        return {"at": "blocks.*.resid_post", "vector": dict(self.directions), "coeff": coeff,
                "positions": positions, "op": op}

    def save_gguf(self, path: str | Path, model_hint: str = "llama") -> Path:
        return write_gguf(path, self.directions, model_hint)

    def save_safetensors(self, path: str | Path) -> Path:
        return write_safetensors(path, self.directions)


def direction_from_states(pos: torch.Tensor, neg: torch.Tensor, method: str) -> torch.Tensor:
    """pos, neg [n, H] float (row i of each is a contrasting pair) -> a direction [H] float32.

    mean_diff: mean(pos) - mean(neg).
    pca_diff:  first principal direction of the pair differences pos_i - neg_i, uncentred (the
               unit direction with the largest mean squared projection of the differences: centring
               would remove the shift they share), signed so positives project above negatives.
    """
    pos, neg = pos.double(), neg.double()
    if method == "mean_diff":
        return (pos.mean(0) - neg.mean(0)).float()
    diffs = pos - neg  # [n, H]
    d = torch.linalg.svd(diffs, full_matrices=False).Vh[0]  # [H]
    d = d / d.norm().clamp_min(1e-30)
    if float(((pos - neg) @ d).mean()) < 0:
        d = -d
    return d.float()


def check_method(method: str) -> None:
    if method not in ("pca_diff", "mean_diff"):
        raise LogprobeError("method", f"unknown method {method!r}", "use pca_diff or mean_diff")


def is_zero(v: torch.Tensor) -> bool:
    return not bool(v.abs().max() > 0) if v.numel() else True


def finite(x: float) -> bool:
    return math.isfinite(x)

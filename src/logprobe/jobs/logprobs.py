"""Logprobs rows (RL): ``prompt_token_ids`` + ``completion_token_ids`` -> one log-prob per
completion token.

Optional per-row fields override the job's options: ``temperature``, ``top_k``, ``entropy``,
``steer``, ``capture``; ``id`` is echoed (null when absent). Captures with ``reduce: none``
(``[n, H]`` each) go to ``capture_dir/INDEX.safetensors`` side files, referenced from the row.

    {"prompt_token_ids": [1, 504], "completion_token_ids": [3575, 282], "id": "a"}
 -> {"index": 0, "id": "a", "logprobs": [-9.1, -0.7], "sum_logprob": -9.8, "is_greedy": [false, true]}

With ``images_column`` (a model with a vision tower), that column holds the prompt's images
(``jobs.images``): ``prompt_token_ids`` has the image token once per image, or expanded.

>>> LogprobsRows().float32_columns >= {"logprobs", "entropy", "top_k_logprobs"}
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import LogprobeError
from ..io.tables import Row
from ..scoring.options import HeadOptions, HookSpecs
from ..scoring.sequences import sequence_request, sequence_result
from ..scoring.work import Job, ScoringContext
from . import fields
from .base import RowWork, row_head
from .images import rename_image_field, row_images


@dataclass(slots=True)
class LogprobsRows:
    options: HeadOptions = HeadOptions()
    hooks: HookSpecs = HookSpecs()
    capture_dir: str = "captures"
    keep: tuple[str, ...] = ()
    images_column: str | None = None  # a column of the prompt's images (jobs.images), e.g. "image"
    base_dir: str = ""  # where relative image paths start: the table file's folder
    float32_columns = frozenset({"logprobs", "entropy", "top_k_logprobs"})

    def head(self, row: Row) -> dict:
        return row_head(row, self.keep, echo_id=True, images_column=self.images_column)

    def result_types(self, names=()) -> dict[str, str]:
        """The result columns every output row has (null in a failed row), as ``io.parquet.arrow_type``
        tags; ``names``: the input's columns (a ``top_k`` or ``entropy`` column turns those on per row).

        >>> list(LogprobsRows(HeadOptions(top_k=2)).result_types())
        ['logprobs', 'sum_logprob', 'is_greedy', 'top_k_ids', 'top_k_logprobs']
        """
        out = {"logprobs": "list<float32>", "sum_logprob": "float64", "is_greedy": "list<bool>"}
        if self.options.entropy or "entropy" in names:
            out["entropy"] = "list<float32>"
        if self.options.top_k or "top_k" in names:
            out.update(top_k_ids="list<list<int64>>", top_k_logprobs="list<list<float32>>")
        return out

    def work(self, row: Row, context: ScoringContext) -> RowWork:
        data, index, opts = row.data, row.index, self.options
        get = lambda k, default: default if fields.missing(data.get(k)) else data[k]  # noqa: E731
        head = HeadOptions(fields.number(get("temperature", opts.temperature), "temperature", float),
                           fields.number(get("top_k", opts.top_k), "top_k", int),
                           fields.flag(get("entropy", opts.entropy), "entropy")).checked()
        seq = {k: fields.id_list(data.get(k), k) if not fields.missing(data.get(k)) else None
               for k in ("prompt_token_ids", "completion_token_ids")}
        images = row_images(data.get(self.images_column), self.images_column, self.base_dir) \
            if self.images_column else None
        if images is not None:
            seq["images"] = images
        try:
            caps, steers = context.hook_specs(HookSpecs(
                fields.json_value(get("capture", self.hooks.capture), "capture"),
                fields.json_value(get("steer", self.hooks.steer), "steer")))
            req = sequence_request(context, seq, index, head, caps, steers)
        except LogprobeError as e:  # "sequences[i].completion_token_ids[3]" -> "completion_token_ids[3]"
            field = e.field.removeprefix(f"sequences[{index}]").lstrip(".").lstrip(": ") or "line"
            raise LogprobeError(rename_image_field(field, self.images_column) if images else field,
                                e.problem, e.fix) from e

        def finish(results) -> dict:
            res = sequence_result(req, results[0], caps)
            out = res.to_dict()
            if res.captures is not None:
                out["captures"] = capture_records(res.captures, self.capture_dir, index)
            return out

        return RowWork(index, self.head(row), Job([req], finish))


def capture_records(captures, capture_dir: str, index: int) -> list[dict]:
    """Small captures inline; ``reduce: none`` ones ([n, H]) in ``capture_dir/INDEX.safetensors``,
    referenced by file and key (written before the row, so a row never points to nothing)."""
    from safetensors.torch import save_file

    recs, side = [], {}
    for k, c in enumerate(captures):
        if c.reduce == "none":
            key = f"{k}:{c.at}"
            side[key] = c.value.contiguous()
            recs.append({"at": c.at, "positions": c.positions, "reduce": c.reduce,
                         "file": os.path.join(capture_dir, f"{index}.safetensors"), "key": key,
                         "shape": list(c.value.shape)})
        else:
            recs.append(c.to_dict())
    if side:
        try:
            os.makedirs(capture_dir, exist_ok=True)
            save_file(side, os.path.join(capture_dir, f"{index}.safetensors"))
        except OSError as e:
            raise LogprobeError("--capture-dir", f"cannot write {capture_dir!r}: {e.strerror or e}") from e
    return recs

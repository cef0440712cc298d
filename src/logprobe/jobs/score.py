"""Score rows: ``prompt`` + ``continuation`` (one) or ``continuations`` (a list) -> log-probs.

The output columns follow the input: with ``continuation`` they are scalars per row, with
``continuations`` lists (one entry per continuation, in the row's order). The CLI's join rule
applies (``join`` between prompt and continuation unless either side has whitespace there). A row
with ``messages`` (a chat) scores its final assistant message instead (``jobs.chat``).

    {"prompt": "The capital of France is", "continuation": "Paris"}
 -> {"index": 0, "continuation": " Paris", "log_prob": -0.2581, "num_tokens": 1, "is_greedy": true,
     "token_logprobs": [-0.2581]}

With ``images_column`` (a model with a vision tower), that column holds the prompt's images
(``jobs.images``), one placeholder each in ``prompt`` (Qwen3.5: ``<|image_pad|>``).

>>> ScoreRows().float32_columns >= {"token_logprobs", "entropy"}
True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LogprobeError
from ..io.tables import Row
from ..scoring.continuations import score_job
from ..scoring.options import HeadOptions
from ..scoring.work import Job, ScoringContext
from . import fields
from .base import RowWork, row_head
from .chat import chat_row_job
from .images import rename_image_field, row_images

SCORE_COLUMNS = ("continuation", "log_prob", "num_tokens", "is_greedy", "token_logprobs", "entropy", "top_k_ids",
                 "top_k_logprobs")


def join_continuation(prompt: str, continuation: str, join: str) -> str:
    """``join + continuation`` unless the prompt ends or the continuation starts with whitespace.

    >>> join_continuation("The capital of France is", "Paris", " "), join_continuation("a ", "b", " ")
    (' Paris', 'b')
    """
    if not prompt or not continuation or prompt[-1].isspace() or continuation[0].isspace():
        return continuation
    return join + continuation


@dataclass(slots=True)
class ScoreRows:
    """Options shared by every row: the head's (temperature, top-k, entropy), the join, kept columns."""

    options: HeadOptions = HeadOptions()
    join: str = " "
    keep: tuple[str, ...] = ()
    images_column: str | None = None  # a column of the prompt's images (jobs.images), e.g. "image"
    base_dir: str = ""  # where relative image paths start (the column's, chat parts'): the table file's folder
    float32_columns = frozenset({"token_logprobs", "entropy", "top_k_logprobs"})

    def head(self, row: Row) -> dict:
        return row_head(row, self.keep, images_column=self.images_column)

    def result_types(self, names=()) -> dict[str, str]:
        """The result columns every output row has (null in a failed row), as ``io.parquet.arrow_type``
        tags. Their shape follows the input: scalars for ``continuation``, lists for ``continuations``
        (none declared when the input has both columns or neither: a row decides).

        >>> ScoreRows().result_types({"prompt", "continuations"})["log_prob"]
        'list<float64>'
        >>> ScoreRows().result_types({"messages"})["log_prob"]   # a chat per row: scalars
        'float64'
        """
        chats = "messages" in names and not {"continuation", "continuations"} & set(names)
        if ("continuation" in names) == ("continuations" in names) and not chats:
            return {}
        one = {"continuation": "string", "log_prob": "float64", "num_tokens": "int64", "is_greedy": "bool",
               "token_logprobs": "list<float32>"}
        if self.options.entropy:
            one["entropy"] = "list<float32>"
        if self.options.top_k:
            one.update(top_k_ids="list<list<int64>>", top_k_logprobs="list<list<float32>>")
        return one if "continuation" in names or chats else {k: f"list<{t}>" for k, t in one.items()}

    def work(self, row: Row, context: ScoringContext) -> RowWork:
        data = row.data
        if not fields.missing(data.get("messages")):  # a chat: its last assistant message (jobs.chat)
            chat = chat_row_job(data["messages"], context, self.options, self.base_dir)
            return RowWork(row.index, self.head(row),
                           Job(chat.requests, lambda results: score_columns(chat.finish(results))))
        prompt = fields.text(data.get("prompt"), "prompt")
        many = not fields.missing(data.get("continuations"))
        if many:
            conts = fields.text_list(data["continuations"], "continuations")
        elif "continuation" in data and data["continuation"] is not None:
            conts = [fields.text(data["continuation"], "continuation")]
        else:
            raise LogprobeError("continuation", "is missing", "give a continuation or continuations column")
        conts = [join_continuation(prompt, c, self.join) for c in conts]
        images = row_images(data.get(self.images_column), self.images_column, self.base_dir) \
            if self.images_column else None
        try:
            job = score_job(context, prompt, conts, self.options, images=images)
        except LogprobeError as e:  # the library's "images[1]" is the table's "image[1]"
            raise LogprobeError(rename_image_field(e.field, self.images_column) if images else e.field,
                                e.problem, e.fix) from e

        def finish(results) -> dict:
            cols = [score_columns(s) for s in job.finish(results)]
            return cols[0] if not many else {k: [c[k] for c in cols] for k in cols[0]}

        return RowWork(row.index, self.head(row), Job(job.requests, finish))


def score_columns(s) -> dict:
    """The table columns of one ``ContinuationScore``."""
    out = {"continuation": s.continuation, "log_prob": s.log_prob, "num_tokens": s.num_tokens,
           "is_greedy": s.is_greedy, "token_logprobs": s.token_logprobs}
    if s.entropy is not None:
        out["entropy"] = s.entropy
    if s.top_k is not None:
        out["top_k_ids"] = [[i for i, _, _ in alts] for alts in s.top_k]
        out["top_k_logprobs"] = [[lp for _, _, lp in alts] for alts in s.top_k]
    return out

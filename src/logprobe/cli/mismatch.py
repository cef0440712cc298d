"""``logprobe compare --logprobs-from FILE``: how far another engine's per-token log-probs (a
rollout engine's, a trainer's) are from logprobe's exact ones on the same tokens
(``scoring.mismatch``).

FILE is JSONL, CSV or Parquet, in one of three row layouts (``row_sequences``), told apart by
their keys:

* logprobe's: ``prompt_token_ids``, ``completion_token_ids`` (as for ``logprobe logprobs``) and the
  other engine's log-prob of each completion token in ``--logprobs-column`` (default ``logprobs``;
  a list of floats, or JSON text of one in CSV);
* TRL's rollout output (what a GRPO ``rollout_func`` returns, one row per completion):
  ``prompt_ids``, ``completion_ids``, ``logprobs``: per token a float, or a list whose first entry
  is the sampled token's (vLLM's rank-sorted list with ``logprobs=0``, as TRL keeps it);
* vLLM's ``RequestOutput`` as JSON: ``prompt_token_ids`` and ``outputs``, a list of completions each
  with ``token_ids`` and ``logprobs`` (per token a dict from token id to ``{"logprob": x, ...}`` or to
  x); each completion is one sequence, the log-prob of its own token taken from the dict.

A row that cannot be read is an error naming its line: a report on some of the rows would be a
different report. A null log-prob (vLLM's NaN, which TRL stores as None) is refused with its row.
"""

from __future__ import annotations

import argparse
import json

from ..errors import LogprobeError
from ..io.tables import read_rows, table_format
from ..jobs.fields import id_list, json_value
from ..scorer import Scorer
from ..scoring.compare import kl_plot_html
from ..scoring.mismatch import MismatchReport, mismatch


def add_mismatch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training-inference mismatch (instead of --reference)")
    g.add_argument("--logprobs-from", default=None, metavar="FILE",
                   help="JSONL/CSV/Parquet of sequences (prompt_token_ids, completion_token_ids) with another "
                        "engine's per-token log-probs: report max/mean |Δ|, the k1/k2/k3 KL estimators and the "
                        "fraction of importance ratios outside --ratio-range, per sequence and overall")
    g.add_argument("--logprobs-column", default="logprobs", metavar="NAME",
                   help="the column holding the other engine's log-probs (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="the temperature the other engine's log-probs are at (default: %(default)s)")
    g.add_argument("--ratio-range", default="0.8,1.25", metavar="LOW,HIGH",
                   help="importance ratios p/q outside it are counted (default: %(default)s)")
    g.add_argument("--output", default=None, metavar="FILE.json",
                   help="write the report with one entry per sequence as JSON")


def read_sequences(path: str, column: str) -> tuple[list[dict], list[list[float]]]:
    """The file's sequences (as ``Scorer.logprobs`` takes them) and their log-prob lists."""
    fmt = table_format(path, None, "--logprobs-from", ("jsonl", "csv", "parquet"))
    seqs, theirs = [], []
    for row in read_rows(path, fmt):
        if row.problem is not None:
            raise LogprobeError("--logprobs-from", f"{row.where}: {row.problem}", "fix or remove that row")
        try:
            for seq, values in row_sequences(row.data, column):
                seqs.append(seq)
                theirs.append(values)
        except LogprobeError as e:
            raise LogprobeError("--logprobs-from", f"{row.where}: {e}", "fix or remove that row") from e
    if not seqs:
        raise LogprobeError("--logprobs-from", f"{path} holds no rows", "give a file of sequences")
    return seqs, theirs


def row_sequences(d: dict, column: str = "logprobs") -> list[tuple[dict, list[float]]]:
    """The sequences of one row, with the other engine's log-prob of each completion token, in any
    of the three layouts of the module docstring.

    >>> row_sequences({"prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [[-0.5, -0.9], [-1.5]]})
    [({'prompt_token_ids': [1, 2], 'completion_token_ids': [3, 4]}, [-0.5, -1.5])]
    >>> row_sequences({"prompt_token_ids": [1], "outputs": [{"token_ids": [7, 8],
    ...     "logprobs": [{"7": {"logprob": -0.1, "rank": 1}}, {"9": -0.2, "8": -2.0}]}]})
    [({'prompt_token_ids': [1], 'completion_token_ids': [7, 8]}, [-0.1, -2.0])]
    """
    if "outputs" in d and "prompt_token_ids" in d:  # vLLM RequestOutput
        outputs = json_value(d["outputs"], "outputs")
        if not isinstance(outputs, list) or not outputs:
            raise LogprobeError("outputs", "must be a non-empty list of completions", "vLLM's RequestOutput.outputs")
        prompt = id_list(d["prompt_token_ids"], "prompt_token_ids")
        return [_vllm_completion(prompt, o, k) for k, o in enumerate(outputs)]
    if "prompt_ids" in d and "completion_ids" in d and "prompt_token_ids" not in d:  # TRL rollout output
        seq = {"prompt_token_ids": id_list(d["prompt_ids"], "prompt_ids"),
               "completion_token_ids": id_list(d["completion_ids"], "completion_ids")}
        values = json_value(d.get("logprobs"), "logprobs")
        if not isinstance(values, list):
            raise LogprobeError("logprobs", "must be a list", "one log-prob (or rank-sorted list) per completion token")
        return [(seq, [_number(v[0] if isinstance(v, list) and v else v, f"logprobs[{t}]")
                       for t, v in enumerate(values)])]
    seq = {"prompt_token_ids": id_list(d.get("prompt_token_ids"), "prompt_token_ids"),
           "completion_token_ids": id_list(d.get("completion_token_ids"), "completion_token_ids")}
    values = json_value(d.get(column), column)
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        raise LogprobeError(column, "must be a list of numbers", "one log-prob per completion token")
    return [(seq, [float(v) for v in values])]


def _vllm_completion(prompt: list[int], out, k: int) -> tuple[dict, list[float]]:
    if not isinstance(out, dict):
        raise LogprobeError(f"outputs[{k}]", "must be an object with token_ids and logprobs", "vLLM's CompletionOutput")
    ids = id_list(out.get("token_ids"), f"outputs[{k}].token_ids")
    steps = out.get("logprobs")
    if not isinstance(steps, list) or len(steps) != len(ids):
        raise LogprobeError(f"outputs[{k}].logprobs", f"must be a list of {len(ids)} per-token dicts",
                            "generate with logprobs=0 (or more) so every token carries its log-prob")
    values = []
    for t, (tok, step) in enumerate(zip(ids, steps)):
        entry = step.get(str(tok), step.get(tok)) if isinstance(step, dict) else None
        if entry is None:
            raise LogprobeError(f"outputs[{k}].logprobs[{t}]", f"has no entry for its token {tok}",
                                "each position's dict holds the sampled token")
        values.append(_number(entry.get("logprob") if isinstance(entry, dict) else entry,
                              f"outputs[{k}].logprobs[{t}]"))
    return {"prompt_token_ids": prompt, "completion_token_ids": ids}, values


def _number(v, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise LogprobeError(field, f"is {v!r}, not a number",
                            "a null log-prob (the engine's NaN) has no comparison: leave the row out")
    return float(v)


def ratio_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise LogprobeError("--ratio-range", f"{text!r} is not LOW,HIGH", "e.g. 0.8,1.25") from None
    return low, high


def cmd_mismatch(args: argparse.Namespace, scorer: Scorer) -> int:
    low, high = ratio_range(args.ratio_range)
    seqs, theirs = read_sequences(args.logprobs_from, args.logprobs_column)
    ours = [r.logprobs for r in scorer.logprobs(seqs, temperature=args.temperature)]
    rep = mismatch(ours, theirs, low, high)
    write_outputs(args, rep, ours, theirs)
    print(json.dumps(rep.overall.to_dict()) if args.json else rep.report())
    return 0


def write_outputs(args: argparse.Namespace, rep: MismatchReport, ours, theirs) -> None:
    if args.output is not None:
        _write(args.output, json.dumps(rep.to_dict()) + "\n", "--output")
    if args.plot is not None:
        deltas = [abs(float(a) - b) for o, t in zip(ours, theirs) for a, b in zip(o.tolist(), t)]
        page = kl_plot_html(deltas, f"|Δ log p| against {args.logprobs_from}", rep.report(),
                            label="|log p - log q|")
        _write(args.plot, page, "--plot")


def _write(path: str, text: str, option: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise LogprobeError(option, f"cannot write {path}: {e.strerror}", "give a writable path") from e

"""``logprobe compare --logprobs-from FILE``: how far another engine's per-token log-probs (a
rollout engine's, a trainer's) are from logprobe's exact ones on the same tokens
(``scoring.mismatch``).

FILE is JSONL, CSV or Parquet with one sequence a row: ``prompt_token_ids``,
``completion_token_ids`` (as for ``logprobe logprobs``) and the other engine's log-prob of each
completion token in ``--logprobs-column`` (default ``logprobs``; a list of floats, or JSON text of
one in CSV). A row that cannot be read is an error naming its line: a report on some of the rows
would be a different report.
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
        d = row.data
        try:
            seqs.append({"prompt_token_ids": id_list(d.get("prompt_token_ids"), "prompt_token_ids"),
                         "completion_token_ids": id_list(d.get("completion_token_ids"), "completion_token_ids")})
            values = json_value(d.get(column), column)
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
                raise LogprobeError(column, "must be a list of numbers", "one log-prob per completion token")
        except LogprobeError as e:
            raise LogprobeError("--logprobs-from", f"{row.where}: {e}", "fix or remove that row") from e
        theirs.append([float(v) for v in values])
    if not seqs:
        raise LogprobeError("--logprobs-from", f"{path} holds no rows", "give a file of sequences")
    return seqs, theirs


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

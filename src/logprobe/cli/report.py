"""``--html FILE`` for ``score``, ``perplexity`` and ``compare``: run the command's job once, with
per-token ranks and top-k alternatives, turn the results into ``report`` segments, write the page.

The page's numbers and the printed ones come from the same pass: the command's job
(``Scorer.score_job`` / ``perplexity_job``) runs once on the engine with the page's ``top_k``
and ``entropy`` switched on (per-request options, which never change a log-prob); the printed
results keep only the top-k and entropy the command asked for.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import LogprobeError
from ..report import Segment, kl_page, locate_targets, surprisal_page
from ..report.tokens import Token, result_tokens, stream_tokens
from ..scoring.continuations import score_job
from ..scoring.options import HeadOptions, HookSpecs, Windows
from ..scoring.perplexity import perplexity_job

DEFAULT_TOP_K = 5


def add_html_option(p: argparse.ArgumentParser) -> None:
    """``--html FILE`` and ``--html-top-k K`` on a subcommand."""
    p.add_argument("--html", default=None, metavar="FILE.html",
                   help="also write a self-contained page: the text coloured per token, hover for numbers")
    p.add_argument("--html-top-k", type=int, default=DEFAULT_TOP_K, metavar="K",
                   help="alternatives shown per token on the --html page (default: %(default)s)")


def write_page(path: str, page: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise LogprobeError("--html", f"cannot write {path!r}: {e.strerror or e}", "give a writable path") from e


def _top_k(args: argparse.Namespace) -> int:
    k = args.html_top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise LogprobeError("--html-top-k", f"must be an integer >= 0, got {k!r}")
    return k


def _model_rows(scorer) -> list[tuple[str, str]]:
    i = scorer.info
    return [("model", f"{i.name} ({i.backend}, {i.device}, {i.dtype})")]


def _window_tokens(scorer, req, res, top_k: int | None = None) -> list[Token]:
    """A request's scored tokens with their log-prob, rank, entropy and (the first ``top_k``) top
    alternatives."""
    tok = scorer.tokenizer
    ids = req.tokens[req.score_begin:]
    top = None
    if res.topk_ids is not None:
        k = res.topk_ids.shape[1] if top_k is None else min(top_k, res.topk_ids.shape[1])
        texts = tok.token_texts(res.topk_ids[:, :k].flatten().tolist())
        top = [list(zip(texts[r * k:(r + 1) * k], row[:k])) for r, row in enumerate(res.topk_logprobs.tolist())]
    return result_tokens(tok.token_texts(ids), res.logprobs.tolist(), res.ranks.tolist(), top,
                         None if res.entropy is None else res.entropy.tolist())


def _plural(n: int, word: str) -> str:
    """``n word``, plural unless n is 1.

    >>> _plural(1, "token"), _plural(2, "token")
    ('1 token', '2 tokens')
    """
    return f"{n} {word}{'s' * (n != 1)}"


def score_page(scorer, prompt: str, continuations: list[str], args: argparse.Namespace,
               options: HeadOptions = HeadOptions(), hooks: HookSpecs = HookSpecs()) -> tuple[str, list]:
    """One segment per continuation: its prompt tokens (grey) then its scored tokens. Returns the
    page and the continuations' scores under ``options`` (one engine pass serves both)."""
    k = _top_k(args)
    page_options = HeadOptions(options.temperature, max(k, options.top_k), True)
    job = score_job(scorer.context, prompt, continuations, page_options, hooks)
    results = scorer.executor.run(job.requests)
    scores = job.finish(results)
    segments = []
    for req, res, sc in zip(job.requests, results, scores, strict=True):
        ctx = [Token(t) for t in scorer.tokenizer.token_texts(req.tokens[:req.score_begin])]
        segments.append(Segment(f"{sc.continuation!r}: log-prob {sc.log_prob:.4f}, {_plural(sc.num_tokens, 'token')}, "
                                f"{'greedy' if sc.is_greedy else 'not greedy'}", ctx + _window_tokens(scorer, req, res, k)))
    rows = _model_rows(scorer) + [("prompt", repr(prompt)), ("continuations", str(len(continuations)))]
    asked = [dataclasses.replace(sc, top_k=[alts[:options.top_k] for alts in sc.top_k] if options.top_k else None,
                                 entropy=sc.entropy if options.entropy else None) for sc in scores]
    return surprisal_page(segments, "logprobe score", rows), asked


def perplexity_page(scorer, text: str, args: argparse.Namespace, windows: Windows = Windows(),
                    hooks: HookSpecs = HookSpecs()) -> tuple[str, object]:
    """The text's tokens, each scored one coloured, as ``Scorer.perplexity`` windows score them.
    Returns the page and the ``PerplexityResult`` of the same pass."""
    k = _top_k(args)
    job = perplexity_job(scorer.context, text, windows, hooks)
    requests = [dataclasses.replace(r, top_k=k, entropy=True) for r in job.requests]
    results = scorer.executor.run(requests)
    res = job.finish(results)
    stream = scorer.tokenizer.encode(text)
    if windows.max_tokens is not None:
        stream = stream[:windows.max_tokens]
    starts = locate_targets(stream, [(r.tokens, r.tokens[r.score_begin:]) for r in requests])
    tokens = stream_tokens(scorer.tokenizer.token_texts(stream), starts,
                           [_window_tokens(scorer, q, r) for q, r in zip(requests, results, strict=True)])
    windows = f"{res.num_windows} window{'s' * (res.num_windows != 1)}"
    segment = Segment(f"{_plural(res.num_tokens, 'token')} scored in {windows} (policy {res.policy}, "
                      f"context {res.context_length}" + (f", stride {res.stride})" if res.stride else ")"), tokens)
    if segment.num_scored != res.num_tokens:
        raise LogprobeError("--html", f"page shows {segment.num_scored} scored tokens, perplexity scored "
                            f"{res.num_tokens}", "this is a bug: report it with the command line")
    rows = _model_rows(scorer) + [("perplexity", f"{res.perplexity:.4f} ± {res.perplexity_stderr:.4f}"),
                                  ("mean NLL", f"{res.nll_mean:.4f} nats")]
    return surprisal_page([segment], "logprobe perplexity", rows), res


def compare_page(q, r, text: str, res, windows: Windows = Windows()) -> str:
    """Tokens coloured by KL(R || Q) (``res.token_kl``, the compare result's own numbers), each with
    both models' log-probs, Δp and (when the compare ran with ``top_k``) both models' alternatives,
    with the KL histogram and the text report. ``windows``: the window options ``compare`` was given."""
    if res.token_kl is None:
        raise LogprobeError("--html", "the compare result has no per-token KL", "compare with return_token_stats")
    job = perplexity_job(q.context, text, windows)  # the windows compare ran: tokenizing only
    stream = q.tokenizer.encode(text)
    if windows.max_tokens is not None:
        stream = stream[:windows.max_tokens]
    starts = locate_targets(stream, [(w.tokens, w.tokens[w.score_begin:]) for w in job.requests])
    n = len(res.token_kl)
    lq = res.token_logprobs_q or [None] * n
    lr = res.token_logprobs_r or [None] * n

    def alternatives(top) -> list[list[tuple[str, float]]]:
        if top is None:
            return [[] for _ in range(n)]
        texts = iter(q.tokenizer.token_texts([i for alts in top for i, _ in alts]))
        return [[(next(texts), lp) for _, lp in alts] for alts in top]

    top_q, top_r = alternatives(res.token_top_q), alternatives(res.token_top_r)
    i = iter(range(n))
    scored = [[Token(t, lq[k], kl=res.token_kl[k], top=top_q[k], logprob_r=lr[k], top_r=top_r[k])
               for t, k in zip(q.tokenizer.token_texts(w.tokens[w.score_begin:]), i)] for w in job.requests]
    tokens = stream_tokens(q.tokenizer.token_texts(stream), starts, scored)
    rows = [("Q", q.info.name), ("R", r.info.name), ("mean KL", f"{res.kl_mean:.6f} ± {res.kl_stderr:.6f}"),
            ("PPL(Q)/PPL(R)", f"{res.ppl_ratio:.6f} ± {res.ppl_ratio_stderr:.6f}")]
    return kl_page([Segment(f"{_plural(res.num_tokens, 'token')}, coloured by KL(R || Q)", tokens)],
                   "logprobe compare", rows, res.report())


# -- the hooks the commands call (one line each in cli/score.py, cli/perplexity.py, cli/compare.py) --


def check_html(args: argparse.Namespace) -> None:
    """Refuse what ``--html`` cannot show, before any model is loaded."""
    if getattr(args, "html", None) is None:
        return
    _top_k(args)
    if getattr(args, "input", None) is not None:
        raise LogprobeError("--html", "shows one text (or one prompt's continuations), not the rows of --input",
                            "drop --html, or give PROMPT CONT... / --text-file")


def window_options(args: argparse.Namespace) -> Windows:
    """The window options of ``perplexity`` / ``compare`` (``add_window_args``, ``--no-prefix``) as one record."""
    return Windows(args.context_length, args.stride, args.policy, False if args.no_prefix else None, args.max_tokens)


def score_html(args: argparse.Namespace, scorer, continuations: list[str], steer=None, capture=None) -> list:
    """``logprobe score``: the continuations scored (``Scorer.score``); with ``--html FILE`` the
    page is written from the same engine pass."""
    options = HeadOptions(args.temperature, args.top_k, args.entropy)
    if getattr(args, "html", None) is None:
        return scorer.score(args.prompt, continuations, temperature=options.temperature, top_k=options.top_k,
                            entropy=options.entropy, steer=steer, capture=capture)
    page, scores = score_page(scorer, args.prompt, continuations, args, options, HookSpecs(capture, steer))
    write_page(args.html, page)
    return scores


def perplexity_html(args: argparse.Namespace, scorer, text: str, steer=None, capture=None):
    """``logprobe perplexity --text-file F``: the text's ``PerplexityResult``; with ``--html FILE``
    the page is written from the same engine pass."""
    w = window_options(args)
    if getattr(args, "html", None) is None:
        return scorer.perplexity(text, context_length=w.context_length, stride=w.stride, policy=w.policy,
                                 prefix=w.prefix, max_tokens=w.max_tokens, steer=steer, capture=capture)
    page, res = perplexity_page(scorer, text, args, w, HookSpecs(capture, steer))
    write_page(args.html, page)
    return res


def compare_top_k(args: argparse.Namespace) -> int:
    """The alternatives ``compare`` computes per token: ``--html-top-k`` with ``--html``, else none."""
    return _top_k(args) if getattr(args, "html", None) is not None else 0


def compare_html(args: argparse.Namespace, q, r, text: str, res) -> None:
    """``logprobe compare ... --html FILE``: tokens coloured by KL, the KL histogram, the report."""
    if getattr(args, "html", None) is not None:
        write_page(args.html, compare_page(q, r, text, res, window_options(args)))

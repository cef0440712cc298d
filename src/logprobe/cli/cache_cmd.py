"""``logprobe cache stats|clear --cache DIR``: what a result cache (``--cache DIR``,
``executor.cached``) holds, and emptying it (all of it, or one model's entries)."""

from __future__ import annotations

import argparse
import json

from ..executor.cached import ResultCache


def add_cache_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or empty a result cache (--cache DIR)",
                       description="The result cache that --cache DIR keeps (SQLite, DIR/results.sqlite).")
    act = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    st = act.add_parser("stats", help="entries, bytes, hits/misses and the models seen")
    st.add_argument("--cache", required=True, metavar="DIR", help="the cache directory")
    st.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    st.set_defaults(func=cmd_stats)
    cl = act.add_parser("clear", help="delete every entry, or one model's (--model)")
    cl.add_argument("--cache", required=True, metavar="DIR", help="the cache directory")
    cl.add_argument("--model", default=None, metavar="MODEL",
                    help="only this model's entries: its name or path as loaded, or a prefix of its key "
                         "(as `cache stats` lists it)")
    cl.set_defaults(func=cmd_clear)


def cmd_stats(args: argparse.Namespace) -> int:
    cache = ResultCache(args.cache, create=False)
    try:
        s = cache.stats()
    finally:
        cache.close()
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['path']}: {s['entries']} entries, {s['data_bytes']} bytes of results, {s['file_bytes']} bytes on disk")
    total = s["hits"] + s["misses"]
    rate = f" ({100 * s['hits'] / total:.1f}% hits)" if total else ""
    print(f"hits {s['hits']}, misses {s['misses']}{rate}")
    for m in s["models"]:
        print(f"  {m['model']}  {m['name']}  {m['dtype']} {m['device']}  deterministic={m['deterministic']}  "
              f"weights {m['weights']}  {m['entries']} entries  since {m['first_seen']}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    cache = ResultCache(args.cache, create=False)
    try:
        n = cache.clear(args.model)
    finally:
        cache.close()
    print(f"deleted {n} entries" + (f" of {args.model}" if args.model else ""))
    return 0

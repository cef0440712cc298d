"""Every relative link of the README and of the pages under docs/ reaches a file that exists and,
where it names an anchor (``page.md#section``), a heading of that page: a page split or a section
renamed cannot leave a link behind. Anchors are GitHub's: the heading lower-cased, everything but
letters, digits, spaces, ``-`` and ``_`` dropped, spaces turned into ``-``, repeats numbered
(``perf.md#first-score``; ``## 2026-11-22, commit 0336498: perplexity`` ->
``#2026-11-22-commit-0336498-perplexity``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """>>> slug("2026-11-22, commits b1a1286 → a2f4017, one H100: `jsonable_encoder` skipped")
    '2026-11-22-commits-b1a1286--a2f4017-one-h100-jsonable_encoder-skipped'"""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slug_examples():
    import doctest

    assert doctest.run_docstring_examples(slug, {"slug": slug}) is None
    assert slug("First score") == "first-score"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)

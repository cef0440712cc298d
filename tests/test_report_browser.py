"""The surprisal page in a real headless browser: Debian's Chromium (``apt-get install chromium``)
driven by Playwright for Python (``executable_path``; no browser download). Skips, saying why,
where either is missing.

Checks: the page loads with no console errors or page errors; the token count shown equals the
tokens scored (and the coloured spans); hovering a token shows its log-prob, equal to the
scorer's; a PNG screenshot is written (``docs/img/surprisal.png`` was made this way)."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from logprobe.cli.report import perplexity_page
from logprobe.scoring.options import Windows

CHROMIUM = os.environ.get("LOGPROBE_CHROMIUM", "/usr/bin/chromium")
TEXT = ("The river rises in the hills north of the town and runs south through a wide valley. In spring "
        "the water is high and fast; by late summer it is slow.")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; or set LOGPROBE_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


def test_surprisal_page_in_chromium(browser, default_scorer, tmp_path):
    options = dict(context_length=32, stride=8)
    path = tmp_path / "surprisal.html"
    path.write_text(perplexity_page(default_scorer, TEXT, argparse.Namespace(html_top_k=5), Windows(**options))[0],
                    encoding="utf-8")
    ref = default_scorer.perplexity(TEXT, return_token_nlls=True, **options)
    page = browser.new_page(viewport={"width": 1000, "height": 600})
    problems = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    assert int(page.inner_text("#token-count")) == ref.num_tokens == page.locator(".tok").count()
    assert not page.is_visible("#tip")
    for i in (0, 7, ref.num_tokens - 1):
        tok = page.locator(".tok").nth(i)
        tok.hover()
        tip = page.inner_text("#tip")
        shown = float(re.search(r"log-prob (-?\d+\.\d{4})", tip).group(1))
        want = -ref.token_nlls[0][i]
        assert abs(shown - want) <= 0.5e-4 + 1e-12, (i, tip)
        assert float(tok.get_attribute("data-logprob")) == want
        assert re.search(r"rank \d+", tip) and "top alternatives" in tip
    shot = tmp_path / "surprisal.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    page.close()
    assert problems == []

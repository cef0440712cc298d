"""Render ``Segment`` lists as one self-contained HTML page (inline CSS and JS, no network).

Each scored token is a ``<span class="tok">`` coloured by its surprisal -log p (nats; white at 0,
yellow, red at ``scale`` and above) or, on compare pages, by KL(R || Q). Its exact numbers are
in ``data-*`` attributes (``data-logprob`` is Python's ``repr`` of the float); hovering shows a
tooltip with the token, its log-prob, probability, rank, entropy and the top alternatives (on
compare pages: each model's log-prob, Δp = p_Q - p_R, KL(R || Q) and each model's alternatives).
``#token-count`` holds the number of scored tokens.

    page = surprisal_page([Segment("text", tokens)], title="SmolLM2 on wiki.txt",
                          summary=[("perplexity", "17.9")])
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence

from .tokens import Segment, Token

SURPRISAL_SCALE = 10.0  # nats: -log p at which the colour saturates (p = 4.5e-5)
KL_SCALE = 1.0  # nats of KL(R || Q) at which the colour saturates

CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.3em}table.summary td{padding:1px 10px 1px 0}table.summary td:first-child{color:#666}
.seg{margin:1em 0;border-top:1px solid #ddd;padding-top:.5em}.label{color:#666;font-size:.85em;margin-bottom:.3em}
.text{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;line-height:1.7;font-size:14px}
.ctx{color:#999}.tok{border-radius:2px;cursor:default}.tok:hover{outline:2px solid #1f5fbf}
#tip{position:fixed;display:none;background:#fff;border:1px solid #888;border-radius:4px;padding:6px 8px;
 font-size:12px;box-shadow:0 2px 8px rgba(0,0,0,.2);pointer-events:none;z-index:10;max-width:420px}
#tip table{border-collapse:collapse}#tip td{padding:0 6px 0 0;font-family:ui-monospace,monospace}
#tip .bar{display:inline-block;height:8px;background:#1f5fbf}.legend{display:flex;align-items:center;gap:8px;
 font-size:.85em;color:#555}.legend .grad{width:240px;height:12px;border:1px solid #ccc}
.hist{margin:1em 0}
"""

JS = """
(function(){
  var data = JSON.parse(document.getElementById('token-data').textContent);
  var tip = document.getElementById('tip');
  function esc(s){return s.replace(/[&<>"]/g,function(c){return {'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c];});}
  function fmt(x){return x===null||x===undefined?'n/a':x.toFixed(4);}
  function show(ev){
    var el = ev.target.closest('.tok'); if(!el){tip.style.display='none';return;}
    var d = data[+el.dataset.i], rows = [];
    rows.push('<b>token</b> <code>'+esc(JSON.stringify(d.t))+'</code>');
    if(d.lpr!==undefined){
      rows.push('<b>log-p Q</b> <span class="lp">'+fmt(d.lp)+'</span>'+(d.lp===null?'':' (p = '+Math.exp(d.lp).toPrecision(4)+')'));
      rows.push('<b>log-p R</b> <span class="lpr">'+fmt(d.lpr)+'</span>'+(d.lpr===null?'':' (p = '+Math.exp(d.lpr).toPrecision(4)+')'));
      rows.push('<b>&Delta;p</b> <span class="dp">'+fmt(d.dp)+'</span>');
    } else if(d.lp!==null){
      rows.push('<b>log-prob</b> <span class="lp">'+fmt(d.lp)+'</span> (p = '+Math.exp(d.lp).toPrecision(4)+')');
      if(d.r!==null) rows.push('<b>rank</b> '+d.r+(d.r===0?' (greedy)':''));
    }
    if(d.h!==null) rows.push('<b>entropy</b> '+fmt(d.h));
    if(d.kl!==null) rows.push('<b>KL(R || Q)</b> <span class="kl">'+fmt(d.kl)+'</span>');
    var html = rows.join('<br>');
    function alts(title, list){
      if(!list || !list.length) return;
      html += '<table><tr><td colspan=3><b>'+title+'</b></td></tr>';
      list.forEach(function(a){
        var w = a[1]===null?0:Math.round(80*Math.exp(a[1]));
        html += '<tr><td><code>'+esc(JSON.stringify(a[0]))+'</code></td><td>'+fmt(a[1])+'</td><td><span class="bar" style="width:'+w+'px"></span></td></tr>';
      });
      html += '</table>';
    }
    alts(d.lpr!==undefined?'top alternatives (Q)':'top alternatives', d.top);
    alts('top alternatives (R)', d.topr);
    tip.innerHTML = html; tip.style.display='block';
    var x = Math.min(ev.clientX+12, window.innerWidth-tip.offsetWidth-8), y = ev.clientY+16;
    if(y+tip.offsetHeight > window.innerHeight) y = ev.clientY-tip.offsetHeight-8;
    tip.style.left = x+'px'; tip.style.top = y+'px';
  }
  document.addEventListener('mouseover', show);
  document.addEventListener('mousemove', function(ev){ if(tip.style.display==='block') show(ev); });
})();
"""


def surprisal_color(surprisal: float, scale: float = SURPRISAL_SCALE) -> str:
    """White (0 nats) through yellow to red (``scale`` and above): ``surprisal_color(0.0)`` is
    ``'hsl(60,100%,100%)'``, ``surprisal_color(10.0)`` is ``'hsl(0,100%,60%)'``."""
    t = min(max(surprisal / scale, 0.0), 1.0) if math.isfinite(surprisal) else 1.0
    return f"hsl({60 * (1 - t):.0f},100%,{100 - 40 * t:.0f}%)"


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None  # JSON has no inf / nan


def _token_record(t: Token) -> dict:
    rec = {"t": t.text, "lp": _finite(t.logprob), "r": t.rank, "h": _finite(t.entropy), "kl": _finite(t.kl),
           "top": [[a, _finite(b)] for a, b in t.top]}
    if t.logprob_r is not None:  # compare pages: the reference's numbers and Δp = p_Q - p_R
        dp = math.exp(t.logprob) - math.exp(t.logprob_r) if t.logprob is not None else None
        rec.update(lpr=_finite(t.logprob_r), dp=dp, topr=[[a, _finite(b)] for a, b in t.top_r])
    return rec


def _spans(segment: Segment, records: list[dict], color) -> str:
    out = []
    for t in segment.tokens:
        text = html.escape(t.text)
        if not t.scored:
            out.append(f'<span class="ctx">{text}</span>')
            continue
        attrs = f' data-i="{len(records)}"'
        if t.logprob is not None:
            attrs += f' data-logprob="{t.logprob!r}"'
        if t.kl is not None:
            attrs += f' data-kl="{t.kl!r}"'
        out.append(f'<span class="tok"{attrs} style="background:{color(t)}">{text}</span>')
        records.append(_token_record(t))
    return "".join(out)


def _page(title: str, summary: Sequence[tuple[str, str]], segments: Sequence[Segment], color, legend: str,
          extra: str = "") -> str:
    records: list[dict] = []
    body = "".join(f'<div class="seg"><div class="label">{html.escape(s.label)}</div>'
                   f'<div class="text">{_spans(s, records, color)}</div></div>' for s in segments)
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary)
    data = json.dumps(records, ensure_ascii=True).replace("</", "<\\/")  # safe inside <script>
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<table class="summary">{rows}<tr><td>tokens scored</td><td><span id="token-count">{len(records)}'
            f"</span></td></tr></table>{legend}{extra}{body}<div id=\"tip\"></div>"
            f'<script type="application/json" id="token-data">{data}</script><script>{JS}</script></body></html>\n')


def _legend(label: str, scale: float) -> str:
    return (f'<div class="legend">{html.escape(label)}: 0 <span class="grad" style="background:linear-gradient('
            f'to right,{surprisal_color(0, 1)},{surprisal_color(0.5, 1)},{surprisal_color(1, 1)})"></span> '
            f"&ge; {scale:g} nats &mdash; hover a token for its numbers</div>")


def surprisal_page(segments: Sequence[Segment], title: str, summary: Sequence[tuple[str, str]] = (),
                   scale: float = SURPRISAL_SCALE) -> str:
    """Tokens coloured by surprisal -log p; ``summary`` rows (label, value) above the text."""
    return _page(title, summary, segments, lambda t: surprisal_color(-t.logprob, scale),
                 _legend("surprisal -log p", scale))


def kl_histogram_svg(kl: Sequence[float], bins: int = 24) -> str:
    """Inline SVG: how many tokens fall in each log10-spaced KL bin (from 1e-6 nats, the first bin
    holding everything below, the last everything above 10 nats)."""
    lo, hi = -6.0, 1.0
    counts = [0] * bins
    for v in kl:
        x = min(max(math.log10(v), lo), hi) if v > 0 else lo  # inf / nan land in the last bin
        x = hi if x != x else x
        counts[min(bins - 1, int((x - lo) / (hi - lo) * bins))] += 1
    W, H, pad = 760, 200, 36
    bw = (W - 2 * pad) / bins
    top = max(counts) or 1
    bars = "".join(
        f'<rect x="{pad + i * bw:.1f}" y="{H - pad - (H - 2 * pad) * c / top:.1f}" width="{bw - 1:.1f}" '
        f'height="{(H - 2 * pad) * c / top:.1f}" fill="#1f5fbf"><title>{c} tokens</title></rect>'
        for i, c in enumerate(counts))
    ticks = "".join(f'<text x="{pad + (e - lo) / (hi - lo) * (W - 2 * pad):.1f}" y="{H - pad + 14}" font-size="11" '
                    f'text-anchor="middle">1e{e}</text>' for e in range(int(lo), int(hi) + 1))
    return (f'<svg class="hist" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}">'
            f'<text x="{pad}" y="16" font-size="12">KL(R || Q) per token, log10 bins ({len(kl)} tokens, '
            f'tallest bar {top})</text>{bars}<line x1="{pad}" x2="{W - pad}" y1="{H - pad}" y2="{H - pad}" '
            f'stroke="#888"/>{ticks}</svg>')


def kl_page(segments: Sequence[Segment], title: str, summary: Sequence[tuple[str, str]] = (), report: str = "",
            scale: float = KL_SCALE) -> str:
    """Tokens coloured by KL(R || Q), a histogram of the per-token KL, and ``report`` (preformatted)."""
    kl = [t.kl for s in segments for t in s.tokens if t.kl is not None]
    extra = kl_histogram_svg(kl) + (f"<pre>{html.escape(report)}</pre>" if report else "")
    return _page(title, summary, segments, lambda t: surprisal_color(t.kl, scale), _legend("KL(R || Q)", scale), extra)

"""One self-contained HTML page: the pieces ``report.html`` and ``fbt-probe view`` share.

Everything a page needs is inside it (styles, scripts, figures as data URIs), so it opens
offline, from a file, in any browser: no CDN, no server. Tables with the class ``sortable``
sort by a column when its header is clicked; any element with a ``data-tip`` shows that text
in a tooltip on hover (the ``title`` attribute carries it too, for a page read without
scripts). Heatmap cells are coloured here, in Python, so a page is readable before its script
runs.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from fbt_probe.util.files import atomic_write

# cividis (perceptually uniform, colour-blind safe: the PNG figures' map) at five stops
CIVIDIS = (
    (0.0, (0, 32, 77)),
    (0.25, (65, 77, 107)),
    (0.5, (124, 123, 120)),
    (0.75, (188, 175, 111)),
    (1.0, (255, 234, 70)),
)

STYLE = """
body{font:15px/1.5 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd}
code{background:#f3f3f3;padding:0 .25em;border-radius:3px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left}
table.sortable th{cursor:pointer;background:#f6f6f6;user-select:none}
table.sortable th[data-dir=asc]::after{content:" \\25B2"}
table.sortable th[data-dir=desc]::after{content:" \\25BC"}
table.heat td.cell{text-align:center;min-width:3.2em;font-variant-numeric:tabular-nums}
table.heat th{background:#fafafa;font-weight:normal}
figure{margin:1em 0}figure img{max-width:100%}figcaption{font-size:12px;color:#555}
.heatmap{display:inline-block;vertical-align:top;margin-right:2em;max-width:100%;overflow-x:auto}
.heatmap h3{font-size:14px;margin:.5em 0 0}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:4px 8px;
 border-radius:4px;font-size:12px;white-space:pre;display:none;z-index:10}
.tokens span{display:inline-block;padding:1px 3px;margin:1px;border:1px solid #ddd;
 border-radius:3px;font-family:monospace;cursor:default}
.tokens span.sel{outline:2px solid #c00}
select,button{font:inherit;margin-right:.5em}
"""

SCRIPT = r"""
(function(){
const tip=document.getElementById('tip');
document.addEventListener('mouseover',e=>{const t=e.target.closest('[data-tip]');
  if(!t){tip.style.display='none';return;}tip.textContent=t.dataset.tip;tip.style.display='block';});
document.addEventListener('mousemove',e=>{const w=tip.offsetWidth||0;
  tip.style.left=Math.max(0,Math.min(e.clientX+14,window.innerWidth-w-8))+'px';tip.style.top=(e.clientY+14)+'px';});
function key(td){const s=td.dataset.sort!==undefined?td.dataset.sort:td.textContent;
  const m=s.replace(/,/g,'').match(/-?\d+(\.\d+)?/);return m?parseFloat(m[0]):null;}
window.fbtSortable=function(root){root.querySelectorAll('table.sortable').forEach(tb=>{
  tb.querySelectorAll('th').forEach((th,i)=>th.addEventListener('click',()=>{
    const dir=th.dataset.dir==='asc'?'desc':'asc';tb.querySelectorAll('th').forEach(h=>delete h.dataset.dir);
    th.dataset.dir=dir;const body=tb.tBodies[0];const rows=[...body.rows];
    rows.sort((a,b)=>{const x=a.cells[i],y=b.cells[i];if(!x||!y)return 0;
      const p=key(x),q=key(y);let c;
      if(p!==null&&q!==null)c=p-q;else if(p!==null)c=-1;else if(q!==null)c=1;
      else c=x.textContent.localeCompare(y.textContent);return dir==='asc'?c:-c;});
    rows.forEach(r=>body.appendChild(r));}));});};
window.fbtSortable(document);
})();
"""


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def colour(x: float, lo: float = 0.0, hi: float = 1.0) -> tuple[str, str]:
    """The cividis background for ``x`` on [lo, hi] and a text colour readable on it."""
    t = 0.0 if hi <= lo or x != x else min(1.0, max(0.0, (x - lo) / (hi - lo)))
    for (a, ca), (b, cb) in zip(CIVIDIS, CIVIDIS[1:], strict=False):
        if t <= b:
            f = (t - a) / (b - a)
            rgb = [round(u + f * (v - u)) for u, v in zip(ca, cb, strict=True)]
            break
    light = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140
    return "#" + "".join(f"{c:02x}" for c in rgb), "#000" if light else "#fff"


def inline(text: str) -> str:
    """Markdown's inline marks this project writes: `code`, **bold**, *italic*; escaped."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:
            out.append(f"<code>{esc(part[1:-1])}</code>")
            continue
        s = esc(part)
        s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
        out.append(re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", s))
    return "".join(out)


def table_html(rows: list[list[str]], sortable: bool = True) -> str:
    """A header row and body rows of cell texts (markdown inline) as a table."""
    head = "".join(f"<th>{inline(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    cls = ' class="sortable"' if sortable else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def image_uri(path: Path) -> str:
    kind = "svg+xml" if path.suffix == ".svg" else path.suffix.lstrip(".").lower()
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def markdown_html(text: str, image: Callable[[str, str], str]) -> str:
    """The markdown this project's reports are made of (headings, paragraphs, lists, pipe
    tables, images on a line of their own) as HTML; ``image(alt, path)`` renders an image."""
    out, para, lines = [], [], text.splitlines()

    def flush():
        if para:
            out.append(f"<p>{inline(' '.join(para))}</p>")
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        if m := re.fullmatch(r"(#{1,4}) (.*)", line):
            flush()
            n = len(m.group(1))
            out.append(f"<h{n}>{inline(m.group(2))}</h{n}>")
        elif m := re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip()):
            flush()
            out.append(image(m.group(1), m.group(2)))
        elif line.startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i].strip()):
                    rows.append(_cells(lines[i]))
                i += 1
            out.append(table_html(rows))
            continue
        elif line.startswith("- "):
            flush()
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif not line.strip():
            flush()
        else:
            para.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)


def heatmap(
    title: str,
    rows: list,
    cols: list,
    cell: Callable,
    *,
    lo: float,
    hi: float,
    row_name: str = "",
    col_name: str = "",
    attrs: str = "",
) -> str:
    """A heatmap as a table: ``cell(r, c)`` gives (value, tooltip text), or (shade, tooltip,
    text) where the colour follows another scale than the number shown (a log scale), or None
    for no cell. Colours run from ``lo`` (the darkest) to ``hi``; every cell's tooltip says
    what it holds."""
    head = f"<th>{esc(row_name)} \\ {esc(col_name)}</th>" + "".join(
        f"<th>{esc(c)}</th>" for c in cols
    )
    body = []
    for r in rows:
        tds = [f"<th>{esc(r)}</th>"]
        for c in cols:
            got = cell(r, c)
            if got is None:
                tds.append("<td></td>")
                continue
            v, tip, *text = got
            bg, fg = colour(v, lo, hi)
            shown = text[0] if text else f"{v:.2f}"
            tds.append(
                f'<td class="cell" style="background:{bg};color:{fg}" data-value="{v:.4f}" '
                f'data-tip="{esc(tip)}" title="{esc(tip)}">{esc(shown)}</td>'
            )
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (
        f'<div class="heatmap"{attrs}><h3>{esc(title)}</h3><table class="heat"><thead><tr>'
        f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def page(title: str, body: str, *, data: dict | None = None, script: str = "") -> str:
    """A whole page: ``body`` HTML, ``data`` as a JSON script block (``FBT_DATA``) that
    ``script`` can read, and the shared styles and scripts."""
    blob = ""
    if data is not None:
        # "</" cannot close the script block early inside JSON written this way
        payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
        blob = f'<script id="fbt-data" type="application/json">{payload}</script>\n'
        blob += "<script>const FBT_DATA=JSON.parse(document.getElementById('fbt-data').textContent);</script>"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n<body>\n{body}\n"
        f'<div id="tip"></div>\n{blob}<script>{SCRIPT}</script>\n'
        f"{f'<script>{script}</script>' if script else ''}\n</body></html>\n"
    )


def write_page(path: Path, text: str) -> Path:
    """Write a page whole or not at all."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def value_tip(r, what: str, metric: str) -> str:
    return (
        f"{what}\n{metric} {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (95 % CI)\n"
        f"n = {int(r.n)} examples"
    )


def rows_grid(g: pd.DataFrame, rows: list, cols: list, title: str, what, metric: str) -> str:
    """A heatmap of ``g``'s ``value`` on [0, 1], one row of ``g`` per (row, col) cell."""
    by = {(r.row, r.col): r for r in g.itertuples(index=False)}

    def cell(a, b):
        r = by.get((a, b))
        return None if r is None else (r.value, value_tip(r, what(a, b), metric))

    return heatmap(title, rows, cols, cell, lo=0.0, hi=1.0)

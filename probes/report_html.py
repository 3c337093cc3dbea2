"""``report.html``: the report as one page that works offline.

The same text and tables as ``report.md`` (tables sort by any column), figures embedded as
data URIs, and each probe heatmap drawn as an interactive table from ``probe_results.csv``:
hovering a cell shows its accuracy, its 95 % interval and the examples and groups behind it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from probes.html import esc, heatmap, image_uri, markdown_html, page, write_page
from probes.plot import _prefills, _targets
from tasks import stratum, task_names
from tasks.base import POOLED


def _tip(r, what: str) -> str:
    return (f"{what}\naccuracy {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (95 % CI)\n"
            f"n = {int(r.n_examples)} examples in {int(r.n_groups)} groups\nchance {r.chance:.3f}")  # fmt: skip


def _grid(g: pd.DataFrame, index: str, columns: str, title: str, what) -> str:
    """One heatmap: a row of ``g`` per (index, column) cell."""
    by = {(getattr(r, index), getattr(r, columns)): r for r in g.itertuples(index=False)}
    rows = _prefills(g) if index == "prefill" else sorted(set(g[index]))
    cols = sorted(set(g[columns]))
    chance = float(g.chance.mean())

    def cell(r, c):
        row = by.get((r, c))
        return None if row is None else (row.accuracy, _tip(row, what(r, c)))

    return heatmap(f"{title} (chance {chance:.2f})", rows, cols, cell, lo=chance, hi=1.0,
                   row_name=index, col_name=columns)  # fmt: skip


def prefill_by_depth(df: pd.DataFrame, task: str) -> list[str]:
    sel = df[(df.model == "trained") & (df.distractors == POOLED) & (df.overwrites == "all")
             & (df.task == task)]  # fmt: skip
    return [
        _grid(
            sel[sel.target == t],
            "prefill",
            "depth",
            f"{task} {t}: prefill by depth, counts {POOLED}",
            lambda p, d, t=t: f"{task} {t}, {p} prefill, depth {d}",
        )  # fmt: skip
        for t in _targets(sel, task)
    ]


def depth_by_count(df: pd.DataFrame, task: str) -> list[str]:
    sel = df[(df.model == "trained") & (df.distractors != POOLED) & (df.overwrites == "all")
             & (df.task == task)].copy()  # fmt: skip
    if sel.empty:
        return []
    sel = sel[sel.target == _targets(sel, task)[0]].assign(
        count=lambda d: d.distractors.astype(int)
    )
    return [
        _grid(
            sel[sel.prefill == p],
            "depth",
            "count",
            f"{task}, {p} prefill: depth by distractor count",
            lambda d, n, p=p: f"{task}, {p} prefill, depth {d}, {n} distractors",
        )  # fmt: skip
        for p in ("standard", "recurrent")
        if p in set(sel.prefill)
    ]


def overwrites(df: pd.DataFrame, task: str) -> list[str]:
    """Depth by stratum value, the mean over targets; the tooltip lists each target's."""
    sel = df[(df.model == "trained") & (df.overwrites != "all") & (df.task == task)].copy()
    if sel.empty:
        return []
    name = (stratum(task) if task in task_names() else None) or "stratum"
    sel["k"] = sel.overwrites.astype(int)
    out = []
    for p in [p for p in ("recurrent", "full") if p in set(sel.prefill)]:
        g = sel[sel.prefill == p]
        chance = float(g.chance.mean())

        def cell(d, k, g=g, p=p):
            h = g[(g.depth == d) & (g.k == k)]
            if h.empty:
                return None
            each = "\n".join(f"{r.target} {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}], n {int(r.n_examples)}"
                             for r in h.itertuples(index=False))  # fmt: skip
            return (
                h.accuracy.mean(),
                f"{task}, {p} prefill, depth {d}, {name} {k}\nmean over targets {h.accuracy.mean():.3f}\n{each}",
            )

        out.append(heatmap(f"{task}, {p} prefill: depth by {name}, mean over targets (chance {chance:.2f})",
                           sorted(set(g.depth)), sorted(set(g.k)), cell, lo=chance, hi=1.0,
                           row_name="depth", col_name=name))  # fmt: skip
    return out


# the probe heatmaps (probes/plot.py) by the suffix of their figure's stem
INTERACTIVE = {"_prefill_by_depth": prefill_by_depth, "_depth_by_count": depth_by_count,
               "_overwrites": overwrites}  # fmt: skip


def interactive(df: pd.DataFrame, stem: str) -> str | None:
    """The interactive version of figure ``stem`` where there is one."""
    for suffix, draw in INTERACTIVE.items():
        task = stem.removeprefix("heatmap_").removesuffix(suffix)
        if stem.startswith("heatmap_") and stem.endswith(suffix) and task in set(df.task):
            parts = draw(df, task)
            if parts:
                return f'<figure class="interactive" data-figure="{esc(stem)}">{"".join(parts)}</figure>'
    return None


def write_report_html(res: Path, markdown: str, df: pd.DataFrame) -> Path:
    """``report.html`` beside ``report.md``, from the report's markdown and its table."""

    def image(alt: str, path: str) -> str:
        p = Path(path) if Path(path).is_absolute() else res / path
        got = interactive(df, p.stem)
        if got is not None:
            return got
        if not p.is_file():
            return f"<p>(figure {esc(path)} is missing)</p>"
        return f'<figure><img alt="{esc(alt)}" src="{image_uri(p)}"><figcaption>{esc(alt)}</figcaption></figure>'

    body = markdown_html(markdown, image)
    note = ("<p><em>Hover a heatmap's cell for its accuracy, interval and n; click a table's "
            "header to sort by it.</em></p>")  # fmt: skip
    body = body.replace("</h1>", "</h1>" + note, 1)
    return write_page(res / "report.html", page("fbt-probe report", body))

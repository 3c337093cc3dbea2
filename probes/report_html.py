"""``report.html``: the report as one page that works offline.

The same text and tables as ``report.md`` (tables sort by any column), figures embedded as
data URIs, and each heatmap drawn as an interactive table from the CSV behind it: the probe
heatmaps from ``probe_results.csv`` (hover: accuracy, 95 % interval, the examples and groups
behind it), the interventions' from ``interventions/interventions.csv`` and the lens's from
``lens/lens.csv`` (hover: the value, its interval and n). Curves stay embedded PNGs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def _value_tip(r, what: str, metric: str) -> str:
    return (f"{what}\n{metric} {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (95 % CI)\n"
            f"n = {int(r.n_examples)} examples")  # fmt: skip


def _rows_grid(g: pd.DataFrame, rows: list, cols: list, title: str, what, metric: str) -> str:
    """A heatmap of ``g``'s ``value`` on [0, 1], one row of ``g`` per (row, col) cell."""
    by = {(r.row, r.col): r for r in g.itertuples(index=False)}

    def cell(a, b):
        r = by.get((a, b))
        return None if r is None else (r.value, _value_tip(r, what(a, b), metric))

    return heatmap(title, rows, cols, cell, lo=0.0, hi=1.0)


def interchange(iv: pd.DataFrame, task: str) -> list[str]:
    """The interchange figure: flip rate by positions patched x prefill (probes.intervene_plot)."""
    from probes.intervene_plot import interchange_cells

    g, rows, cols = interchange_cells(iv, task)
    if g.empty:
        return []
    return [_rows_grid(g, rows, cols, f"{task}: interchange the fed-back state with the twin's (flip rate)",
                       lambda w, c: f"{task}, {c}, positions {w}", "flip rate")]  # fmt: skip


def depth(iv: pd.DataFrame, task: str) -> list[str]:
    """The depth figure: answer accuracy after erasing or steering at each depth, per prefill."""
    from probes.intervene_plot import depth_cells

    out = []
    for p in _prefills(iv[iv.task == task]):
        h = depth_cells(iv, task, p)
        if h.empty:
            continue
        out.append(_rows_grid(h, sorted(set(h.row)), list(dict.fromkeys(h.col)),
                              f"{task}, {p} prefill: answer accuracy by depth",
                              lambda d, c, p=p: f"{task}, {p} prefill, {c} at depth {d}", "accuracy"))  # fmt: skip
    return out


def lens(ld: pd.DataFrame, task: str) -> list[str]:
    """The lens figure: pass x read, the answer's probability and the KL to the final
    distribution (coloured on a log scale, bright where it is small), per lens."""
    from probes.lens_plot import READ_NAMES, _order

    out = []
    for name in dict.fromkeys(ld[ld.task == task].lens):
        for metric, label in (
            ("answer_prob", "answer probability"),
            ("kl", "KL to the final distribution"),
        ):
            g = ld[
                (ld.task == task)
                & (ld.lens == name)
                & (ld.metric == metric)
                & (ld.distractors == POOLED)
            ]
            if g.empty:
                continue
            g = g.rename(columns={"pass": "k"})  # a keyword: itertuples would rename it
            by = {(r.read, r.k): r for r in g.itertuples(index=False)}
            reads, passes = _order(set(g.read)), sorted(set(g.k))
            logs = np.log10(np.clip(g.value.to_numpy(dtype=float), 1e-4, None))

            def cell(k, read, by=by, metric=metric, label=label, name=name):
                r = by.get((read, k))
                if r is None or r.value != r.value:
                    return None
                tip = _value_tip(
                    r,
                    f"{task}, {name} lens, pass {k}, read {READ_NAMES.get(read, 'depth ' + read)}",
                    label,
                )
                if metric == "answer_prob":
                    return r.value, tip
                return -np.log10(max(r.value, 1e-4)), tip, f"{r.value:.2g}"

            lo, hi = (0.0, 1.0) if metric == "answer_prob" else (-logs.max(), -logs.min())
            cols = [READ_NAMES.get(r, r) for r in reads]
            by_col = dict(zip(cols, reads, strict=True))
            out.append(heatmap(f"{task}: {name} lens, {label}", passes, cols,
                               lambda k, c, cell=cell, by_col=by_col: cell(k, by_col[c]), lo=lo, hi=hi,
                               row_name="pass", col_name="read"))  # fmt: skip
    return out


def trajectory(tr: pd.DataFrame, task: str) -> list[str]:
    """The trajectory figure's heatmap: each pass's distance to the last, by position
    (coloured on a log scale, bright where the state is still far from its last pass)."""
    g = tr[(tr.task == task) & (tr.measure == "convergence")].rename(columns={"pass": "k"})
    g = g[g.k < g.k.max()].astype({"k": int, "offset": int})  # the last pass is at distance 0
    if g.empty:
        return []
    by = {(r.k, r.offset): r for r in g.itertuples(index=False)}
    logs = np.log10(np.clip(g.value.to_numpy(dtype=float), 1e-9, None))

    def cell(k, offset):
        r = by.get((k, offset))
        if r is None:
            return None
        tip = (f"{task}, pass {k}, position {offset} (0: where the answer is next)\n"
               f"distance to the last pass {r.value:.3g}\nn = {int(r.n)} examples")  # fmt: skip
        return float(np.log10(max(r.value, 1e-9))), tip, f"{r.value:.1g}"

    return [heatmap(f"{task}: distance to the last pass, ||h(k) - h(K)|| / ||h(K)||", sorted(set(g.k)),
                    sorted(set(g.offset)), cell, lo=float(logs.min()), hi=float(logs.max()),
                    row_name="pass", col_name="position")]  # fmt: skip


# every heatmap of the report by the prefix and suffix of its figure's stem, the table it is
# drawn from (the probes' of probes/plot.py, the interventions', the lens's, the trajectory's)
# and whether the figure has other panels, kept as the PNG below it
INTERACTIVE = {("heatmap_", "_prefill_by_depth"): ("probes", prefill_by_depth, False),
               ("heatmap_", "_depth_by_count"): ("probes", depth_by_count, False),
               ("heatmap_", "_overwrites"): ("probes", overwrites, False),
               ("interchange_", ""): ("interventions", interchange, False),
               ("depth_", ""): ("interventions", depth, False),
               ("lens_", ""): ("lens", lens, False),
               ("trajectory_", ""): ("trajectory", trajectory, True)}  # fmt: skip


def interactive(tables: dict[str, pd.DataFrame | None], stem: str) -> tuple[str, bool] | None:
    """The interactive version of figure ``stem`` where there is one, and whether the PNG
    is still to be shown (for its other panels)."""
    for (prefix, suffix), (source, draw, keep) in INTERACTIVE.items():
        df = tables.get(source)
        if df is None or not (stem.startswith(prefix) and stem.endswith(suffix)):
            continue
        task = (
            stem.removeprefix(prefix).removesuffix(suffix) if suffix else stem.removeprefix(prefix)
        )
        if task in set(df.task) and (parts := draw(df, task)):
            html = (
                f'<figure class="interactive" data-figure="{esc(stem)}">{"".join(parts)}</figure>'
            )
            return html, keep
    return None


def _tables(res: Path, df: pd.DataFrame) -> dict[str, pd.DataFrame | None]:
    iv, ld = res / "interventions" / "interventions.csv", res / "lens" / "lens.csv"
    tr = res / "trajectory" / "trajectory.csv"
    return {"probes": df, "trajectory": pd.read_csv(tr) if tr.is_file() else None,
            "interventions": pd.read_csv(iv) if iv.is_file() else None,
            "lens": pd.read_csv(ld, dtype={"read": str, "distractors": str}) if ld.is_file() else None}  # fmt: skip


def write_report_html(res: Path, markdown: str, df: pd.DataFrame) -> Path:
    """``report.html`` beside ``report.md``, from the report's markdown and its table."""

    tables = _tables(res, df)

    def image(alt: str, path: str) -> str:
        p = Path(path) if Path(path).is_absolute() else res / path
        html, keep = interactive(tables, p.stem) or ("", True)
        if not keep:
            return html
        if not p.is_file():
            return html + f"<p>(figure {esc(path)} is missing)</p>"
        return (
            html
            + f'<figure><img alt="{esc(alt)}" src="{image_uri(p)}"><figcaption>{esc(alt)}</figcaption></figure>'
        )

    body = markdown_html(markdown, image)
    note = ("<p><em>Hover a heatmap's cell for its value, interval and n; click a table's "
            "header to sort by it.</em></p>")  # fmt: skip
    body = body.replace("</h1>", "</h1>" + note, 1)
    return write_page(res / "report.html", page("fbt-probe report", body))

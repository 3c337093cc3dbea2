"""The trajectory analysis in report.md and report.html: its findings and its figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from probes.analysis import Figure
from probes.common.html import heatmap
from probes.common.tables import findings, read_long_table
from probes.trajectory.run import headline


def trajectory(tr: pd.DataFrame, task: str) -> list[str]:
    """The trajectory figure's heatmap: each pass's distance to the last, by position
    (coloured on a log scale, bright where the state is still far from its last pass)."""
    g = tr[(tr.task == task) & (tr.metric == "convergence")].rename(columns={"pass": "k"})
    g = g[g.k < g.k.max()].astype({"k": int, "from_answer": int})  # the last pass is at distance 0
    if g.empty:
        return []
    by = {(r.k, r.from_answer): r for r in g.itertuples(index=False)}
    logs = np.log10(np.clip(g.value.to_numpy(dtype=float), 1e-9, None))

    def cell(k, from_answer):
        r = by.get((k, from_answer))
        if r is None:
            return None
        tip = (
            f"{task}, pass {k}, position {from_answer} (0: where the answer is next)\n"
            f"distance to the last pass {r.value:.3g}\nn = {int(r.n)} examples"
        )
        return float(np.log10(max(r.value, 1e-9))), tip, f"{r.value:.1g}"

    return [
        heatmap(
            f"{task}: distance to the last pass, ||h(k) - h(K)|| / ||h(K)||",
            sorted(set(g.k)),
            sorted(set(g.from_answer)),
            cell,
            lo=float(logs.min()),
            hi=float(logs.max()),
            row_name="pass",
            col_name="position",
        )
    ]


def section(results: Path) -> list:
    """The trajectory's part of the report, from ``results/trajectory``: a finding per task
    and its figure (the distance heatmap interactive, the PNG kept for its other panels)."""
    folder = results / "trajectory"
    if not (folder / "trajectory.csv").exists():
        return []
    tr = read_long_table(folder / "trajectory.csv")
    parts: list = findings("How the states move over passes (`fbt-probe trajectory`)", tr, headline)
    pngs = {t: folder / "figures" / f"trajectory_{t}.png" for t in dict.fromkeys(tr.task)}
    return parts + [
        Figure(png, tuple(trajectory(tr, t)), keep_png=True)
        for t, png in pngs.items()
        if png.is_file()
    ]

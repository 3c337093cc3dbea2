"""The lens analysis in report.md and report.html: its findings and its heatmaps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from probes.analysis import Figure
from probes.common.html import heatmap, value_tip
from probes.common.tables import findings, read_long_table
from probes.lens.plot import READ_NAMES, read_order
from probes.lens.run import headline
from tasks.base import POOLED


def lens(ld: pd.DataFrame, task: str) -> list[str]:
    """The lens figure: pass x read, the answer's probability and the KL to the final
    distribution (coloured on a log scale, bright where it is small), per lens."""
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
            reads, passes = read_order(set(g.read)), sorted(set(g.k))
            logs = np.log10(np.clip(g.value.to_numpy(dtype=float), 1e-4, None))

            def cell(k, read, by=by, metric=metric, label=label, name=name):
                r = by.get((read, k))
                if r is None or r.value != r.value:
                    return None
                tip = value_tip(
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
            out.append(
                heatmap(
                    f"{task}: {name} lens, {label}",
                    passes,
                    cols,
                    lambda k, c, cell=cell, by_col=by_col: cell(k, by_col[c]),
                    lo=lo,
                    hi=hi,
                    row_name="pass",
                    col_name="read",
                )
            )
    return out


def section(results: Path) -> list:
    """The lens's part of the report, from ``results/lens``: a finding per task and the pass
    x read heatmaps (docs/anatomy.md explains each measure)."""
    folder = results / "lens"
    if not (folder / "lens.csv").exists():
        return []
    ld = read_long_table(
        folder / "lens.csv",
        ("task", "lens", "read", "pass", "metric"),
        dtype={"read": str, "distractors": str},
    )
    parts: list = findings("What each (pass, depth) predicts (`fbt-probe lens`)", ld, headline)
    pngs = {t: folder / "figures" / f"lens_{t}.png" for t in dict.fromkeys(ld.task)}
    return parts + [Figure(png, tuple(lens(ld, t))) for t, png in pngs.items() if png.is_file()]

"""The lens figure, drawn from ``lens.csv`` alone: per task, pass x read heatmaps of the KL
to the final distribution and of the answer's probability, one row of panels per lens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import LogNorm

from probes.common.figures import CMAP, save_figure, subplots
from probes.common.tables import read_long_table
from tasks.base import POOLED

READ_NAMES = {"fed_state": "fed h", "fed_value": "W_U h"}


def read_order(reads) -> list[str]:
    fed = [r for r in READ_NAMES if r in set(reads)]
    return fed + sorted((r for r in set(reads) if r not in READ_NAMES), key=int)


def lens_matrix(df: pd.DataFrame, task: str, lens: str, metric: str) -> pd.DataFrame:
    """Rows: pass; columns: the reads (the fed-back state's two, then depth 0..L)."""
    g = df[
        (df.task == task) & (df.lens == lens) & (df.metric == metric) & (df.distractors == POOLED)
    ]
    t = g.pivot_table(index="pass", columns="read", values="value", aggfunc="first")
    return t[read_order(t.columns)].rename(columns=READ_NAMES)


def plot_lens(df: pd.DataFrame, task: str, out: Path) -> dict[str, pd.DataFrame]:
    """``lens_<task>`` in ``out``; returns the matrices drawn, by panel title."""
    lenses = list(dict.fromkeys(df[df.task == task].lens))
    width = len(read_order(df[df.task == task].read.unique()))
    fig, axes = subplots(
        len(lenses),
        2,
        figsize=(max(8, 0.45 * width) * 2, 0.5 + 1.1 * len(lenses) * 2.2),
        squeeze=False,
    )
    drawn = {}
    for i, name in enumerate(lenses):
        for j, (metric, label) in enumerate(
            (("kl", "KL to the final distribution (nats)"), ("answer_prob", "answer probability"))
        ):
            t = lens_matrix(df, task, name, metric)
            title = f"{name} lens: {label}"
            drawn[title] = t
            ax = axes[i][j]
            kw = (
                {"vmin": 0, "vmax": 1}
                if metric == "answer_prob"
                else {
                    "norm": LogNorm(
                        vmin=max(1e-4, np.nanmin(t.values[t.values > 0], initial=1.0)),
                        vmax=max(1e-3, np.nanmax(t.values, initial=1.0)),
                    )
                }
            )
            sns.heatmap(
                t.clip(lower=1e-4) if metric == "kl" else t,
                ax=ax,
                cmap=CMAP,
                annot=width <= 12,
                fmt=".2f",
                cbar_kws={"label": label},
                **kw,
            )
            ax.set_title(f"{task}: {title}")
            ax.set_xlabel("read: the fed-back state, then the residual at depth")
            ax.set_ylabel("pass")
    fig.tight_layout()
    save_figure(fig, Path(out), f"lens_{task}")
    return drawn


def figures(results: Path) -> int:
    """The lens's figures, one per task, redrawn from ``results/lens/lens.csv``."""
    csv = Path(results) / "lens" / "lens.csv"
    if not csv.exists():
        return 0
    df = read_long_table(
        csv, ("task", "lens", "read", "pass", "metric"), dtype={"read": str, "distractors": str}
    )
    return sum(len(plot_lens(df, t, csv.parent / "figures")) for t in dict.fromkeys(df.task))

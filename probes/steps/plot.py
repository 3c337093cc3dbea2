"""The steps figures, drawn from ``steps.csv`` alone: per task, for each decoding mode, the
probe of the step's state and the logit lens by generated step x depth, and whole answers by
distractor count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from probes.common.figures import CMAP, PALETTE, save_figure, subplots
from probes.common.tables import NUMBERS, read_table
from tasks.base import POOLED


def step_matrix(df: pd.DataFrame, task: str, mode: str, metric: str) -> pd.DataFrame:
    """Rows: depth (0 = the embeddings, then each block's output; ``state``: the fed-back
    state); columns: generated step."""
    g = df[(df.task == task) & (df["mode"] == mode) & (df.metric == metric)]
    t = g.pivot_table(index="depth", columns="step", values="value", aggfunc="first")
    order = sorted((d for d in t.index if d != "state"), key=int) + [
        d for d in t.index if d == "state"
    ]
    return t.reindex(order)


# the columns never empty (a value may be: nothing to measure there)
REQUIRED = ("task", "mode", "metric", "step")


def plot_task(df: pd.DataFrame, task: str, out: Path) -> list[Path]:
    """``steps_<task>`` in ``out``: a row per mode (probe, lens), and the answers panel."""
    modes = list(dict.fromkeys(df[df.task == task]["mode"]))
    fig, axes = subplots(len(modes), 3, figsize=(17, 3.4 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, (metric, title) in enumerate(
            (("probe", "probe of the step's state"), ("lens", "logit lens: the step's word"))
        ):
            t = step_matrix(df, task, mode, metric)
            ax = axes[i][j]
            if t.empty:
                ax.set_axis_off()
                continue
            sns.heatmap(
                t,
                ax=ax,
                cmap=CMAP,
                vmin=0,
                vmax=1,
                annot=True,
                fmt=".2f",
                annot_kws={"size": 7},
                cbar=j == 1,
            )
            ax.set_title(f"{task}, {mode}: {title}")
            ax.set_xlabel("generated step")
            ax.set_ylabel("depth")
        g = df[
            (df.task == task)
            & (df["mode"] == mode)
            & (df.metric == "exact")
            & (df.length == -1)
            & (df.distractors != POOLED)
        ]
        ax = axes[i][2]
        x = g.distractors.astype(int).to_numpy()
        ax.plot(np.arange(len(x)), g.value, marker="o", color=PALETTE[i % len(PALETTE)])
        ax.fill_between(
            np.arange(len(x)), g.ci_low, g.ci_high, alpha=0.2, color=PALETTE[i % len(PALETTE)]
        )
        ax.set_xticks(np.arange(len(x)), [str(v) for v in x])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}, {mode}: whole answers right")
        ax.set_xlabel("distractors")
    fig.tight_layout()
    return save_figure(fig, out, f"steps_{task}")


def plot_steps(df: pd.DataFrame, out: Path) -> list[Path]:
    """Every task's figure; returns the files written."""
    return [p for t in dict.fromkeys(df.task) for p in plot_task(df, t, out)]


def figures(results: Path) -> int:
    """Redraw from ``results/steps/steps.csv``; returns how many figures it drew."""
    path = results / "steps" / "steps.csv"
    if not path.exists():
        return 0
    df = read_table(path, REQUIRED, NUMBERS, dtype={"depth": str, "distractors": str})
    return len(plot_steps(df, results / "steps" / "figures")) // 2

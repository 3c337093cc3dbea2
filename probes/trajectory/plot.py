"""The trajectory figure, drawn from ``trajectory.csv`` and ``trajectory_pca.csv`` alone: per
task the convergence map (pass x position, log colour), the read position's states on two
principal components with each example's passes joined, answer flips by distractor count,
and the fusion's gate by token class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import LogNorm

from probes.common.figures import CMAP, PALETTE, save_figure, subplots
from probes.common.tables import read_long_table, read_table
from tasks.base import POOLED

PCA_EXAMPLES = 120  # examples drawn in the PCA panel (all are in the CSV)


def convergence_matrix(df: pd.DataFrame, task: str) -> pd.DataFrame:
    """Rows: pass (the last one is 0 by definition and left out); columns: from_answer (0: where the answer is next)."""
    g = df[(df.task == task) & (df.metric == "convergence")]
    t = g.pivot_table(index="pass", columns="from_answer", values="value", aggfunc="first")
    return t.iloc[:-1]


def plot_trajectory(df: pd.DataFrame, pca: pd.DataFrame, task: str, out: Path) -> dict:
    """``trajectory_<task>`` in ``out``; returns what each panel drew."""
    fig, axes = subplots(1, 4, figsize=(22, 4.2), gridspec_kw={"width_ratios": [2.2, 1.3, 1.3, 1]})
    drawn = {
        "convergence": _convergence_panel(axes[0], df, task),
        "flips": _flips_panel(axes[2], df, task),
        "gate": _gate_panel(axes[3], df, task),
    }
    _pca_panel(axes[1], pca, task)
    fig.tight_layout()
    save_figure(fig, Path(out), f"trajectory_{task}")
    return drawn


def _convergence_panel(ax, df: pd.DataFrame, task: str) -> pd.DataFrame:
    """Distance to the last pass by pass and position (log colour scale)."""
    t = convergence_matrix(df, task)
    positive = t.values[t.values > 0]
    lo = float(positive.min()) if positive.size else 1e-6
    sns.heatmap(
        t.clip(lower=lo),
        ax=ax,
        cmap=CMAP,
        norm=LogNorm(vmin=lo, vmax=max(lo * 10, float(np.nanmax(t.values)))),
        cbar_kws={"label": "||h(k) - h(K)|| / ||h(K)||"},
    )
    ax.set_title(f"{task}: distance to the last pass")
    ax.set_xlabel("position (0: where the answer is next)")
    ax.set_ylabel("pass k")
    return t


def _pca_panel(ax, pca: pd.DataFrame, task: str) -> None:
    """The read position's state pass by pass, in the first two principal components."""
    p = pca[(pca.task == task) & (pca.example < PCA_EXAMPLES)]
    for i, (label, g) in enumerate(p.groupby("label")):
        colour = PALETTE[i % len(PALETTE)]
        for _, e in g.groupby("example"):
            ax.plot(e.pc1, e.pc2, "-", color=colour, lw=0.4, alpha=0.5)
        last = g[g["pass"] == g["pass"].max()]
        ax.scatter(last.pc1, last.pc2, s=8, color=colour, label=f"{label} (last pass)")
    ax.set_title("read position's state, pass by pass (PCA)")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.legend(fontsize=7)


def _flips_panel(ax, df: pd.DataFrame, task: str) -> pd.DataFrame:
    """The share of answers that change between passes, by distractor count."""
    flips = df[(df.task == task) & (df.metric == "flip_rate") & (df.distractors != POOLED)].copy()
    flips["count"] = flips.distractors.astype(int)
    for i, (k, g) in enumerate(flips.groupby("pass")):
        g = g.sort_values("count")
        ax.plot(g["count"], g.value, "o-", color=PALETTE[i % len(PALETTE)], label=f"{k - 1} -> {k}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("distractors")
    ax.set_ylabel("share of examples whose top token changes")
    ax.set_title("answer flips between passes")
    ax.legend(fontsize=7, title="pass", ncols=2)
    return flips.pivot_table(index="count", columns="pass", values="value")


def _gate_panel(ax, df: pd.DataFrame, task: str) -> pd.Series:
    """The fusion's mean gate by token class, with its spread over positions."""
    gates = df[(df.task == task) & (df.metric == "gate")]
    if len(gates):
        ax.bar(gates.token_class, gates.value, color=PALETTE[: len(gates)])
        ax.errorbar(
            gates.token_class,
            gates.value,
            fmt="none",
            ecolor="black",
            yerr=[gates.value - gates.ci_low, gates.ci_high - gates.value],
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("mean sigma(W_G e_t) (bars: 2.5-97.5 % of positions)")
    ax.set_title("the fusion's gate by token")
    ax.tick_params(axis="x", labelrotation=20)
    return gates.set_index("token_class").value


def figures(results: Path) -> int:
    """The trajectory's figures, one per task, redrawn from ``results/trajectory``'s tables."""
    folder = Path(results) / "trajectory"
    if not (folder / "trajectory.csv").exists():
        return 0
    df = read_long_table(folder / "trajectory.csv", ("task", "metric", "pass"))
    pca = read_table(folder / "trajectory_pca.csv", ("task", "pass", "label"), ("pc1", "pc2"))
    return sum(len(plot_trajectory(df, pca, t, folder / "figures")) for t in dict.fromkeys(df.task))

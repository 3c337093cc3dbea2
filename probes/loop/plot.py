"""The loop figure, drawn from ``loop.csv`` alone: per task and decoding mode, the share of
answers that follow the twin after a swap at each step (one line per kind), the divergence
curves and the normalised logit difference by later step after a swap of the fed-back state."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.ticker import MaxNLocator

from probes.common.figures import PALETTE, save_figure, subplots
from probes.common.tables import NUMBERS, read_table

# the columns never empty (a value may be: nothing to measure there)
REQUIRED = ("task", "mode", "kind", "step", "later_step", "metric")


def plot_task(df: pd.DataFrame, task: str, out: Path) -> list[Path]:
    """``loop_<task>`` in ``out``: a row per decoding mode."""
    d = df[df.task == task]
    modes = list(dict.fromkeys(d["mode"]))
    fig, axes = subplots(len(modes), 3, figsize=(16, 3.3 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        g = d[d["mode"] == mode]
        ax = axes[i][0]
        for j, kind in enumerate(k for k in dict.fromkeys(g.kind) if k != "none"):
            f = g[(g.kind == kind) & (g.metric == "follows_twin")].sort_values("step")
            ax.plot(f.step, f.value, marker="o", label=kind, color=PALETTE[j])
            ax.fill_between(f.step, f.ci_low, f.ci_high, alpha=0.2, color=PALETTE[j])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}, {mode}: answers that follow the twin")
        ax.set_xlabel("step s of the swap")
        ax.legend(fontsize=8)
        swap = (
            "state"
            if "state" in set(g.kind)
            else next(iter(k for k in g.kind if k != "none"), None)
        )
        for col, (metric, title) in enumerate(
            (("diverged_by", "diverged by step t"), ("logit_diff", "normalised logit difference")),
            1,
        ):
            ax = axes[i][col]
            c = g[(g.kind == swap) & (g.metric == metric)]
            for j, (s, h) in enumerate(c.groupby("step")):
                h = h.sort_values("later_step")
                ax.plot(
                    h.later_step,
                    h.value,
                    marker=".",
                    label=f"s = {s}",
                    color=PALETTE[j % len(PALETTE)],
                )
            ax.set_title(f"{mode}, {swap} swapped at s: {title}")
            ax.set_xlabel("later step t")
            if metric == "diverged_by":
                ax.set_ylim(-0.02, 1.02)  # a share: a small one should look small
            if metric == "logit_diff":
                ax.axhline(1, color="grey", lw=0.6, ls="--")
                ax.axhline(0, color="grey", lw=0.6, ls=":")
            if len(c):
                ax.legend(fontsize=7, ncol=2)
    steps = d[d.step >= 1].step
    for k, ax in enumerate(fig.axes):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        if len(steps):  # one step alone would get a fractional axis around it
            hi = int(steps.max()) + (
                0 if k % 3 == 0 else int(d.later_step.max()) - int(steps.max())
            )
            ax.set_xlim(int(steps.min()) - 0.5, hi + 0.5)
    fig.tight_layout()
    return save_figure(fig, out, f"loop_{task}")


def plot_loop(df: pd.DataFrame, out: Path) -> list[Path]:
    """Every task's figure; returns the files written."""
    return [p for t in dict.fromkeys(df.task) for p in plot_task(df, t, out)]


def figures(results: Path) -> int:
    """Redraw from ``results/loop/loop.csv``; returns how many figures it drew."""
    path = results / "loop" / "loop.csv"
    if not path.exists():
        return 0
    df = read_table(path, REQUIRED, NUMBERS)
    return len(plot_loop(df, results / "loop" / "figures")) // 2

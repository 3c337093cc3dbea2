"""Figures of the stability analysis, drawn from its CSV tables."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from probes.common.figures import PALETTE, save_figure, subplots
from probes.common.tables import read_table


def plot_stability(df: pd.DataFrame, out: Path, stem: str = "stability") -> None:
    """State change (log scale) and validation loss against pass, one line per model."""
    fig, (a, b) = subplots(1, 2, figsize=(11, 3.8))
    for i, (name, g) in enumerate(df.groupby("model", sort=False)):
        g = g.sort_values("pass")
        a.semilogy(g["pass"], g.delta_mean, "-", color=PALETTE[i], label=f"{name} (mean)")
        a.semilogy(g["pass"], g.delta_max, ":", color=PALETTE[i], label=f"{name} (max)")
        b.plot(g["pass"], g.loss, "-", color=PALETTE[i], label=name)
    a.set_xlabel("pass k")
    a.set_ylabel("||h(k) - h(k-1)|| / ||h(k-1)||")
    a.set_title("state change between Jacobi passes")
    a.legend(fontsize=7)
    b.set_xlabel("pass k")
    b.set_ylabel("validation next-token loss")
    b.set_title("loss by pass")
    b.legend(fontsize=7)
    save_figure(fig, out, stem)


def plot_soft(df: pd.DataFrame, out: Path) -> None:
    fig, (a, b) = subplots(1, 2, figsize=(11, 3.6))
    for i, (name, g) in enumerate(df.groupby("model", sort=False)):
        a.plot(g.step, g.h_norm_mean, color=PALETTE[i], label=name)
        b.semilogy(g.step, g.h_change_mean, color=PALETTE[i], label=name, lw=0.8)
    a.set_xlabel("generated token")
    a.set_ylabel("||h|| (mean over sequences)")
    a.set_title("SOFT decoding: state norm per step")
    b.set_xlabel("generated token")
    b.set_ylabel("||h(t) - h(t-1)||")
    b.set_title("SOFT decoding: state change per step")
    a.legend(fontsize=7)
    save_figure(fig, out, "soft_decoding")


def figures(results: Path) -> int:
    """The stability figures, redrawn from ``results/stability``'s tables."""
    folder = Path(results) / "stability"
    if not (folder / "stability.csv").exists():
        return 0
    plot_stability(
        read_table(
            folder / "stability.csv",
            ("model", "pass"),
            ("delta_mean", "delta_max", "loss", "accuracy"),
        ),
        folder,
    )
    if (folder / "soft_decoding.csv").exists():
        plot_soft(
            read_table(folder / "soft_decoding.csv", ("model", "step"), ("h_norm_mean",)), folder
        )
        return 2
    return 1

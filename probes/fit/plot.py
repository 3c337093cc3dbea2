"""Figures drawn from ``probe_results.csv`` alone: no statistics are computed here.

Each ``plot_*`` function returns the matrices it drew (``{title: DataFrame}``), so tests
can compare every annotated number with the table.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from probes.common.figures import CMAP, PALETTE, ordered_prefills, save_figure, subplots
from probes.common.probe_results import (
    depth_by_count_panels,
    load_results,
    overwrites_panels,
    prefill_by_depth_panels,
    primary,
    targets_in,
)
from tasks import stratum, task_names
from tasks.base import POOLED


def _heat(ax, mat: pd.DataFrame, chance: float, title: str, xlabel: str, ylabel: str):
    sns.heatmap(
        mat,
        ax=ax,
        vmin=chance,
        vmax=1.0,
        cmap=CMAP,
        annot=True,
        fmt=".2f",
        cbar_kws={"label": f"probe accuracy (scale from chance {chance:.2f} to 1)"},
        linewidths=0.5,
    )
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def plot_prefill_by_depth(df: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """Per task (and target): rows = prefill, columns = depth, pooled counts 1..256."""
    drawn = {}
    for task in dict.fromkeys(df.task):
        panels = prefill_by_depth_panels(df, task)
        if not panels:
            continue
        width = max(g.depth.nunique() for _, g in panels)
        fig, axes = subplots(
            1, len(panels), figsize=(1.2 + 1.3 * width * len(panels), 3.2), squeeze=False
        )
        for ax, (target, g) in zip(axes[0], panels, strict=True):
            mat = g.pivot(index="prefill", columns="depth", values="accuracy").reindex(
                ordered_prefills(g)
            )
            chance = float(g.chance.mean())
            name = task if target == "label" else f"{task} {target}"
            _heat(
                ax,
                mat,
                chance,
                f"{name}: accuracy at the colon\n(chance {chance:.2f}; pooled counts {POOLED})",
                "depth (0 = block 0 input)",
                "prefill",
            )
            drawn[f"{task}/{target}"] = mat
        save_figure(fig, out, f"heatmap_{task}_prefill_by_depth")
    return drawn


def plot_depth_by_count(df: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """Per task: depth x distractor count, for standard and recurrent prefill."""
    drawn = {}
    for task in dict.fromkeys(df.task):
        panels = depth_by_count_panels(df, task)
        if not panels:
            continue
        fig, axes = subplots(1, len(panels), figsize=(6.5 * len(panels), 3.4), squeeze=False)
        for ax, (target, p, g) in zip(axes[0], panels, strict=True):
            mat = g.pivot(index="depth", columns="count", values="accuracy").sort_index()
            chance = float(g.chance.mean())
            name = task if target == "label" else f"{task} {target}"
            _heat(
                ax,
                mat,
                chance,
                f"{name}, {p} prefill (chance {chance:.2f})",
                "distractor count",
                "depth",
            )
            drawn[f"{task}/{target}/{p}"] = mat
        save_figure(fig, out, f"heatmap_{task}_depth_by_count")
    return drawn


def plot_overwrites(df: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """Tasks with a stratum of their own (multi_register: overwrites of the register): depth
    x stratum value (mean over targets), for recurrent and full prefill."""
    drawn = {}
    for task in dict.fromkeys(df.task):
        panels = overwrites_panels(df, task)
        if not panels:
            continue
        name = stratum(task) if task in task_names() else None
        fig, axes = subplots(1, len(panels), figsize=(5.5 * len(panels), 3.4), squeeze=False)
        for ax, (p, g) in zip(axes[0], panels, strict=True):
            mat = g.pivot_table(
                index="depth", columns="k", values="accuracy", aggfunc="mean"
            ).sort_index()
            chance = float(g.chance.mean())
            _heat(
                ax,
                mat,
                chance,
                f"{task}, {p} prefill\n(mean over targets; chance {chance:.2f})",
                name or "stratum",
                "depth",
            )
            drawn[f"{task}/{p}"] = mat
        save_figure(fig, out, f"heatmap_{task}_overwrites")
    return drawn


def plot_lines(df: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """Accuracy against depth with 95 % bands, per prefill, beside the random-init control."""
    drawn = {}
    sel = df[
        (df.distractors == POOLED)
        & (df.overwrites == "all")
        & (df.model.isin(["trained", "random_init"]))
    ]
    for task in dict.fromkeys(sel.task):
        target = targets_in(sel, task)[0]
        g = sel[(sel.task == task) & (sel.target == target)]
        fig, ax = subplots(figsize=(6, 3.6))
        for i, p in enumerate(ordered_prefills(g)):
            for model, style in (("trained", "-"), ("random_init", ":")):
                h = g[(g.prefill == p) & (g.model == model)].sort_values("depth")
                if h.empty:
                    continue
                label = f"{p}" + (" (random init)" if model == "random_init" else "")
                ax.plot(h.depth, h.accuracy, style, marker="o", color=PALETTE[i], label=label)
                ax.fill_between(
                    h.depth,
                    h.ci_low,
                    h.ci_high,
                    color=PALETTE[i],
                    alpha=0.15 if model == "trained" else 0.07,
                )
                drawn[f"{task}/{target}/{p}/{model}"] = h[
                    ["depth", "accuracy", "ci_low", "ci_high"]
                ].reset_index(drop=True)
        chance = float(g[g.model == "trained"].chance.mean())
        ax.axhline(chance, color="grey", lw=1, ls="--", label=f"chance ({chance:.2f})")
        name = task if target == "label" else f"{task} {target}"
        ax.set_title(f"{name}: probe accuracy at the colon by depth (pooled counts {POOLED})")
        ax.set_xlabel("depth (0 = block 0 input)")
        ax.set_ylabel("accuracy (95 % CI band)")
        ax.set_ylim(max(0.0, chance - 0.15), 1.02)
        ax.set_xticks(sorted(g.depth.unique()))
        ax.legend(fontsize=7, loc="lower right")
        save_figure(fig, out, f"lines_{task}")
    return drawn


def plot_all(
    results: str | Path, out: str | Path | None = None
) -> dict[str, dict[str, pd.DataFrame]]:
    """Every figure from ``results`` (a folder or the CSV) into ``out`` (default: results/figures)."""
    df = primary(load_results(results))
    base = Path(results) if Path(results).is_dir() else Path(results).parent
    out = Path(out) if out is not None else base / "figures"
    return {
        "prefill_by_depth": plot_prefill_by_depth(df, out),
        "depth_by_count": plot_depth_by_count(df, out),
        "overwrites": plot_overwrites(df, out),
        "lines": plot_lines(df, out),
    }


def figures(results: Path) -> int:
    """The fit's figures, redrawn from ``results/probe_results.csv``; the number of panels."""
    if not (Path(results) / "probe_results.csv").exists():
        return 0
    return sum(len(v) for v in plot_all(results).values())

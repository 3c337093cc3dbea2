"""Figures drawn from ``probe_results.csv`` alone: no statistics are computed here.

Each ``plot_*`` function returns the matrices it drew (``{title: DataFrame}``), so tests
can compare every annotated number with the table.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from probes.results import load_results, primary  # noqa: E402
from tasks import stratum, task_names  # noqa: E402
from tasks.base import POOLED  # noqa: E402

PREFILL_ORDER = ["standard", "recurrent", "full"]
CMAP = "cividis"  # perceptually uniform and colour-blind safe
PALETTE = sns.color_palette("colorblind")


def _prefills(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df.prefill))
    return [p for p in PREFILL_ORDER if p in present] + [
        p for p in present if p not in PREFILL_ORDER
    ]


def save_figure(fig, out: Path, stem: str) -> list[Path]:
    """``stem``.png and .pdf in ``out``, each written whole or not at all (a failed write
    leaves no partial or temporary file)."""
    from tasks.files import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    try:
        atomic_write(
            paths[0], lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight")
        )
        atomic_write(paths[1], lambda tmp: fig.savefig(tmp, format="pdf", bbox_inches="tight"))
    finally:
        plt.close(fig)
    return paths


def _heat(ax, mat: pd.DataFrame, chance: float, title: str, xlabel: str, ylabel: str):
    sns.heatmap(
        mat, ax=ax, vmin=chance, vmax=1.0, cmap=CMAP, annot=True, fmt=".2f",
        cbar_kws={"label": f"probe accuracy (scale from chance {chance:.2f} to 1)"}, linewidths=0.5,
    )  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _targets(df: pd.DataFrame, task: str) -> list[str]:
    return list(dict.fromkeys(df[df.task == task].target))


def plot_prefill_by_depth(df: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """Per task (and target): rows = prefill, columns = depth, pooled counts 1..256."""
    drawn = {}
    sel = df[(df.model == "trained") & (df.distractors == POOLED) & (df.overwrites == "all")]
    for task in dict.fromkeys(sel.task):
        targets = _targets(sel, task)
        fig, axes = plt.subplots(
            1,
            len(targets),
            figsize=(1.2 + 1.3 * sel.depth.nunique() * len(targets), 3.2),
            squeeze=False,
        )
        for ax, target in zip(axes[0], targets, strict=True):
            g = sel[(sel.task == task) & (sel.target == target)]
            mat = g.pivot(index="prefill", columns="depth", values="accuracy").reindex(_prefills(g))
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


def plot_depth_by_count(
    df: pd.DataFrame, out: Path, prefills=("standard", "recurrent")
) -> dict[str, pd.DataFrame]:
    """Per task: depth x distractor count, for standard and recurrent prefill."""
    drawn = {}
    sel = df[(df.model == "trained") & (df.distractors != POOLED) & (df.overwrites == "all")]
    for task in dict.fromkeys(sel.task):
        target = _targets(sel, task)[0]
        ps = [p for p in prefills if p in set(sel[sel.task == task].prefill)]
        if not ps:
            continue
        fig, axes = plt.subplots(1, len(ps), figsize=(6.5 * len(ps), 3.4), squeeze=False)
        for ax, p in zip(axes[0], ps, strict=True):
            g = sel[(sel.task == task) & (sel.target == target) & (sel.prefill == p)].copy()
            g["n"] = g.distractors.astype(int)
            mat = g.pivot(index="depth", columns="n", values="accuracy").sort_index()
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


def plot_overwrites(
    df: pd.DataFrame, out: Path, prefills=("recurrent", "full")
) -> dict[str, pd.DataFrame]:
    """Tasks with a stratum of their own (multi_register: overwrites of the register): depth
    x stratum value (mean over targets), for recurrent and full prefill."""
    drawn = {}
    strat = df[(df.model == "trained") & (df.overwrites != "all")]
    for task, sel in strat.groupby("task", sort=False):
        name = stratum(task) if task in task_names() else None
        ps = [p for p in prefills if p in set(sel.prefill)]
        if not ps:
            continue
        fig, axes = plt.subplots(1, len(ps), figsize=(5.5 * len(ps), 3.4), squeeze=False)
        for ax, p in zip(axes[0], ps, strict=True):
            g = sel[sel.prefill == p].copy()
            g["k"] = g.overwrites.astype(int)
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
        target = _targets(sel, task)[0]
        g = sel[(sel.task == task) & (sel.target == target)]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, p in enumerate(_prefills(g)):
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

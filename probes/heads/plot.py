"""The attention figures, drawn from ``heads.csv`` and ``heads_pattern.csv`` alone: per task a
grid of layer x head maps (previous-token share, attention to the label token and to the token
after it, induction score) by pass, and the shown example's attention from the read position, pass by pass."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from probes.common.figures import CMAP, save_figure, subplots
from probes.common.tables import read_long_table, read_table
from tasks.base import POOLED

TITLES = {
    "prev_token": "previous token",
    "label": "read position -> label token",
    "label_next": "read position -> the token after the label",
    "induction": "induction (repeated random tokens)",
}
MAX_PATTERN_HEADS = 32  # a larger model's pattern shows the heads that read the label most


def head_matrix(df: pd.DataFrame, task: str, measure: str, k: int) -> pd.DataFrame:
    """Rows: layer; columns: head; the pooled value in pass k."""
    t = task if measure != "induction" else "-"
    g = df[
        (df.task == t)
        & (df.metric == measure)
        & (df["pass"] == k)
        & df.distractors.isin([POOLED, "-"])
    ]
    return g.pivot_table(index="layer", columns="head", values="value", aggfunc="first")


def pattern_matrix(pattern: pd.DataFrame, task: str, k: int, heads=None) -> pd.DataFrame:
    """Rows: 'L{layer}H{head}'; columns: 'position token'; the read row's weights in pass k."""
    g = pattern[(pattern.task == task) & (pattern["pass"] == k)].copy()
    g["row"] = "L" + g.layer.astype(str) + "H" + g["head"].astype(str)
    if heads is not None:
        g = g[g.row.isin(heads)]
    g["col"] = g.position.astype(str) + " " + g.token.astype(str)
    t = g.pivot_table(index="row", columns="col", values="weight", aggfunc="first", sort=False)
    cols = g.drop_duplicates("position").sort_values("position").col
    rows = g.drop_duplicates("row").sort_values(["layer", "head"]).row
    return t.loc[list(rows), list(cols)]


def chosen_heads(pattern: pd.DataFrame, task: str) -> list[str] | None:
    """Every head, or for a model with more than ``MAX_PATTERN_HEADS``, those whose weight on
    the label token is largest in any pass."""
    g = pattern[(pattern.task == task) & pattern.is_label]
    names = "L" + g.layer.astype(str) + "H" + g["head"].astype(str)
    best = g.assign(row=names).groupby("row").weight.max()
    if len(best) <= MAX_PATTERN_HEADS:
        return None
    return list(best.sort_values(ascending=False).index[:MAX_PATTERN_HEADS])


def plot_heads(df: pd.DataFrame, pattern: pd.DataFrame, task: str, out: Path) -> dict:
    """``heads_<task>`` and ``heads_pattern_<task>`` in ``out``; returns what was drawn."""
    passes = sorted(set(df[df.task == task]["pass"]))
    fig, axes = subplots(
        len(TITLES), len(passes), squeeze=False, figsize=(3.8 * len(passes) + 1, 11)
    )
    drawn = {}
    for i, measure in enumerate(TITLES):
        for j, k in enumerate(passes):
            t = drawn[(measure, k)] = head_matrix(df, task, measure, k)
            sns.heatmap(
                t,
                ax=axes[i, j],
                cmap=CMAP,
                vmin=0,
                vmax=1,
                annot=t.shape[1] <= 8 and t.size <= 64,
                fmt=".2f",
            )
            axes[i, j].set_title(f"{TITLES[measure]}, pass {k}", fontsize=9)
    fig.suptitle(f"{task}: attention by head and pass")
    fig.tight_layout()
    save_figure(fig, Path(out), f"heads_{task}")
    heads = chosen_heads(pattern, task)
    mats = [pattern_matrix(pattern, task, k, heads) for k in passes]
    rows, cols = mats[0].shape
    fig, axes = subplots(
        1,
        len(passes),
        squeeze=False,
        sharey=True,
        figsize=(max(6, 0.28 * cols + 2) * len(passes), 0.22 * rows + 2.5),
    )
    for j, (k, t) in enumerate(zip(passes, mats, strict=True)):
        sns.heatmap(t, ax=axes[0, j], cmap=CMAP, vmin=0, vmax=1, xticklabels=True, yticklabels=True)
        axes[0, j].set_title(f"pass {k}: attention from the read position")
        axes[0, j].set_xlabel("key position and token")
        axes[0, j].set_ylabel("layer, head")
        axes[0, j].tick_params(labelsize=6)
    fig.suptitle(f"{task}: one example, pass by pass")
    fig.tight_layout()
    save_figure(fig, Path(out), f"heads_pattern_{task}")
    drawn["pattern"] = mats
    return drawn


def figures(results: Path) -> int:
    """The heads' figures, one pair per task, redrawn from ``results/heads``'s tables."""
    folder = Path(results) / "heads"
    if not (folder / "heads.csv").exists():
        return 0
    df = read_long_table(folder / "heads.csv", dtype={"distractors": str})
    pattern = read_table(
        folder / "heads_pattern.csv", ("task", "pass", "layer", "head"), ("weight",)
    )
    tasks = [t for t in dict.fromkeys(df.task) if t != "-"]
    return sum(len(plot_heads(df, pattern, t, folder / "figures")) for t in tasks)

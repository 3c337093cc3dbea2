"""The patching figures, drawn from ``patch.csv`` alone: heatmaps of the normalised logit
difference (1: the clean run, 0: the twin's) by depth x position, layer x head and block-0
q/k/v x head, and one line of findings per kind."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from fbt_probe.util.files import read_json
from probes.common.figures import logit_diff_heatmap, save_figure, site_depth, subplots
from probes.common.tables import read_long_table


def patch_matrix(df: pd.DataFrame, task: str, kind: str) -> pd.DataFrame:
    g = df[
        (df.task == task) & (df.intervention == f"patch_{kind}") & (df.metric == "logit_diff")
    ].copy()
    if g.empty:
        return pd.DataFrame()
    if kind == "resid":
        g["row"] = g.site.map(site_depth)
        cols = list(dict.fromkeys(g.positions))
    elif kind == "head":
        g["row"] = g.site.map(lambda s: int(re.search(r"blocks\.(\d+)\.", s).group(1)))
    else:
        g["row"] = g.site.str[-1]
    if kind != "resid":
        g["col"] = g.positions.str.split().str[-1].astype(int)
        cols = sorted(set(g.col))
        g["positions"] = g.col
    t = g.pivot_table(index="row", columns="positions", values="value", aggfunc="first")
    return t[cols]


TITLES = {
    "resid": ("depth", "position patched"),
    "head": ("layer", "head (output, hook_z)"),
    "path": ("block-0 input", "head (the twin's fed-back state into it only)"),
}


def plot_patch(df: pd.DataFrame, task: str, prefill: str, out: Path) -> dict[str, pd.DataFrame]:
    """``patch_<kind>_<task>`` in ``out`` for each kind present; returns the matrices drawn.
    ``prefill``: how the title names the run (e.g. 'recurrent prefill, pass 2')."""
    drawn = {}
    for kind, (ylabel, xlabel) in TITLES.items():
        t = patch_matrix(df, task, kind)
        if t.empty:
            continue
        fig, ax = subplots(
            figsize=(max(5, 0.7 * t.shape[1] + 2), max(2.5, 0.45 * t.shape[0] + 1.2))
        )
        logit_diff_heatmap(ax, t, "logit difference (1 clean, 0 twin)")
        ax.set_title(f"{task}, {prefill}: patch the twin's {kind}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        save_figure(fig, Path(out), f"patch_{kind}_{task}")
        drawn[kind] = t
    return drawn


def findings(df: pd.DataFrame, task: str, prefill: str) -> list[str]:
    """Per kind patched: the three patches that move the answer most toward the twin's."""
    lines = []
    for kind, (ylabel, xlabel) in TITLES.items():
        t = patch_matrix(df, task, kind)
        if t.empty:
            continue
        low = t.stack().sort_values()
        where = ", ".join(
            f"{ylabel} {r} / {xlabel.split(' (')[0]} {c}: {v:.3f}"
            for (r, c), v in low.head(3).items()
        )
        lines.append(
            f"{task} {prefill}, {kind}: the patches that move the answer most toward the twin's: {where}."
        )
    return lines


def figures(results: Path) -> int:
    """The patching's heatmaps, redrawn from ``results/patch/patch.csv`` and its JSON."""
    folder = Path(results) / "patch"
    if not (folder / "patch.csv").exists():
        return 0
    meta = read_json(folder / "patch.json", "record of a patching", ("prefill", "pass"))
    where = f"{meta['prefill']} prefill, pass {meta['pass']}"
    return len(
        plot_patch(read_long_table(folder / "patch.csv"), meta["task"], where, folder / "figures")
    )

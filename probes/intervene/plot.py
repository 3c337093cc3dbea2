"""Figures drawn from ``interventions.csv`` alone (no statistics are computed here).

Per task: ``interchange_<task>``, the flip rate of each fed-back-state interchange by window
and prefill; ``depth_<task>``, answer accuracy after each probe-direction intervention by
depth (one panel per prefill); ``steering_<task>``, flip rate against the steering dose. Each
function returns the matrices it drew, so tests can compare every number with the table.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from fbt_probe.kernels.patching import STATE_HOOK
from probes.common.figures import CMAP, PALETTE, ordered_prefills, save_figure, subplots
from probes.common.metrics import IV_COLUMNS
from probes.common.tables import read_long_table
from probes.common.twins import WINDOWS

DEPTH_COLUMNS = (
    ("erase_probe", None),
    ("erase_random", None),
    ("steer_probe", 4.0),
    ("steer_random", 4.0),
)


def depth_of(site: str, sites: list[str] | None = None) -> int:
    """Depth of a residual site, from its name: block l's input is depth l, the last block's
    output one more (the battery may have run at a few depths only)."""
    return int(site.split(".")[1]) + site.endswith("resid_post")


def site_ladder(g: pd.DataFrame) -> list[str]:
    """The residual sites in depth order: block inputs by block, then the last output."""
    return sorted(set(g.site), key=lambda s: (s.endswith("resid_post"), int(s.split(".")[1])))


def interchange_cells(df: pd.DataFrame, task: str) -> tuple[pd.DataFrame, list, list]:
    """The interchange figure's rows of ``df``, each with its ``row`` (the positions patched)
    and ``col`` (the prefill, "(patch only)" where the state was patched without
    propagating), and the rows' and columns' order. The PNG and report.html draw these."""
    g = df[
        (df.task == task) & (df.intervention == "interchange_state") & (df.metric == "flip_rate")
    ]
    if g.empty:
        return g, [], []
    g = g.assign(
        row=g.positions,
        col=[
            p if s == STATE_HOOK else f"{p} (patch only)"
            for p, s in zip(g.prefill, g.site, strict=True)
        ],
    )
    cols = [c for p in ordered_prefills(g) for c in (p, f"{p} (patch only)") if c in set(g.col)]
    return g, [w for w in WINDOWS if w in set(g.row)], cols


def interchange_matrix(df: pd.DataFrame, task: str) -> pd.DataFrame:
    g, rows, cols = interchange_cells(df, task)
    if g.empty:
        return pd.DataFrame()
    mat = g.pivot_table(index="row", columns="col", values="value", aggfunc="first")
    mat = mat.reindex(index=rows, columns=cols)
    mat.index.name, mat.columns.name = "positions", "column"
    return mat


def depth_cells(df: pd.DataFrame, task: str, prefill: str) -> pd.DataFrame:
    """The depth figure's rows of ``df`` for one prefill, each with its ``row`` (the depth)
    and ``col`` (the intervention, with its dose for steering), in DEPTH_COLUMNS order."""
    g = df[
        (df.task == task)
        & (df.prefill == prefill)
        & (df.metric == "accuracy")
        & df.intervention.isin([n for n, _ in DEPTH_COLUMNS])
    ]
    if g.empty:
        return g.assign(row=[], col=[])
    sites, parts = site_ladder(g), []
    for name, alpha in DEPTH_COLUMNS:
        h = g[g.intervention == name]
        h = h[h.alpha.isna()] if alpha is None else h[h.alpha == alpha]
        label = name if alpha is None else f"{name} α={alpha:+g}"
        parts.append(h.assign(col=label, row=[depth_of(s, sites) for s in h.site]))
    return pd.concat(parts)


def depth_matrix(df: pd.DataFrame, task: str, prefill: str) -> pd.DataFrame:
    h = depth_cells(df, task, prefill)
    if h.empty:
        return pd.DataFrame()
    mat = pd.DataFrame(
        {c: dict(zip(g.row, g.value, strict=True)) for c, g in h.groupby("col", sort=False)}
    )
    mat.index.name = "depth"
    return mat.sort_index()


def steering_curves(df: pd.DataFrame, task: str, prefill: str) -> pd.DataFrame:
    """Rows: alpha; columns: (intervention, depth); values: flip rate."""
    g = df[
        (df.task == task)
        & (df.prefill == prefill)
        & (df.metric == "flip_rate")
        & df.intervention.isin(["steer_probe", "steer_random"])
    ]
    if g.empty:
        return pd.DataFrame()
    sites = site_ladder(g)
    g = g.assign(depth=[depth_of(s, sites) for s in g.site])
    return g.pivot_table(index="alpha", columns=["intervention", "depth"], values="value")


def plot_interventions(df: pd.DataFrame, out: str | Path) -> dict[str, pd.DataFrame]:
    """Draw every figure for every task in ``df`` into ``out``; returns {title: matrix}."""
    out = Path(out)
    drawn: dict[str, pd.DataFrame] = {}
    for task in dict.fromkeys(df.task):
        mat = interchange_matrix(df, task)
        if not mat.empty:
            fig, ax = subplots(figsize=(1.6 + 1.5 * mat.shape[1], 3.6))
            sns.heatmap(
                mat,
                ax=ax,
                vmin=0,
                vmax=1,
                cmap=CMAP,
                annot=True,
                fmt=".2f",
                linewidths=0.5,
                cbar_kws={"label": "flip rate to the twin's label"},
            )
            ax.set_title(f"{task}: interchange the fed-back state with the twin's")
            ax.set_xlabel("prefill")
            ax.set_ylabel("positions patched (before the answer)")
            title = f"interchange_{task}"
            save_figure(fig, out, title)
            drawn[title] = mat
        prefills = [
            p for p in ordered_prefills(df[df.task == task]) if not depth_matrix(df, task, p).empty
        ]
        if prefills:
            fig, axes = subplots(
                1, len(prefills), figsize=(4.6 * len(prefills), 3.6), squeeze=False
            )
            for ax, p in zip(axes[0], prefills, strict=True):
                mat = depth_matrix(df, task, p)
                sns.heatmap(
                    mat,
                    ax=ax,
                    vmin=0,
                    vmax=1,
                    cmap=CMAP,
                    annot=True,
                    fmt=".2f",
                    linewidths=0.5,
                    cbar=ax is axes[0][-1],
                    cbar_kws={"label": "answer accuracy"},
                )
                ax.set_title(f"{task}, {p} prefill")
                ax.set_xlabel("")
                drawn[f"depth_{task}_{p}"] = mat
            save_figure(fig, out, f"depth_{task}")
            fig, axes = subplots(
                1, len(prefills), figsize=(4.6 * len(prefills), 3.4), squeeze=False, sharey=True
            )
            for ax, p in zip(axes[0], prefills, strict=True):
                cur = steering_curves(df, task, p)
                for (name, depth), col in cur.items():
                    ax.plot(
                        cur.index,
                        col.values,
                        color=PALETTE[depth % len(PALETTE)],
                        ls="-" if name == "steer_probe" else ":",
                        marker="o",
                        ms=3,
                        label=f"depth {depth}" if name == "steer_probe" else None,
                    )
                ax.set_title(f"{task}, {p} prefill")
                ax.set_xlabel("dose α (s.d. of the probe projection; > 0 towards the twin)")
                ax.set_ylim(-0.02, 1.02)
                drawn[f"steering_{task}_{p}"] = cur
            axes[0][0].set_ylabel("flip rate (solid: probe direction, dotted: random)")
            axes[0][-1].legend(fontsize=7, loc="upper left")
            save_figure(fig, out, f"steering_{task}")
    return drawn


def figures(results: Path) -> int:
    """The interventions' figures, redrawn from ``results/interventions/interventions.csv``."""
    csv = Path(results) / "interventions" / "interventions.csv"
    if not csv.exists():
        return 0
    return len(
        plot_interventions(
            read_long_table(csv, IV_COLUMNS, keep_default_na=True), csv.parent / "figures"
        )
    )

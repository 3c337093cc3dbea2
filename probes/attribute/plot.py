"""The attribution figures, drawn from ``attribution.csv`` and ``edges.csv`` alone: heatmaps of the
estimated normalised logit difference (1: the clean run, 0: the twin's) by (pass, depth) x
position and by head, the estimate against the exact patch for the checked sites, and a graph of
the strongest edges with the feedback edges marked; and the summary lines."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from fbt_probe.util.files import read_json
from probes.attribute.check import LOW_RANK, LOW_RECALL
from probes.common.figures import (
    PALETTE,
    logit_diff_heatmap,
    save_figure,
    site_depth,
    subplots,
)
from probes.common.tables import read_long_table

N_EDGES = 24  # the graph draws the strongest this many


def _pass(p) -> str:
    return "full" if p in ("", None) or (isinstance(p, float) and np.isnan(p)) else f"pass {int(p)}"


def _layer(site: str) -> str:
    return "layer " + re.search(r"blocks\.(\d+)\.", site).group(1)


def matrix(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    """(pass, depth or layer or q/k/v) x (position or head) of the estimates of ``kind``."""
    if kind == "resid":
        g = df[df.intervention.isin(["patch_resid", "patch_state"])].copy()
        g["row"] = [
            f"{_pass(p)}, " + ("state in" if i == "patch_state" else f"depth {site_depth(s)}")
            for p, i, s in zip(g["pass"], g.intervention, g.site, strict=True)
        ]
        cols = list(dict.fromkeys(g.positions))
    else:
        g = df[df.intervention == f"patch_{kind}"].copy()
        g["row"] = [
            f"{_pass(p)}, {_layer(s) if kind == 'head' else s[-1]}"
            for p, s in zip(g["pass"], g.site, strict=True)
        ]
        g["positions"] = g.positions.str.split().str[-1].astype(int)
        cols = sorted(set(g.positions))
    if g.empty:
        return pd.DataFrame()
    rows = list(dict.fromkeys(g.row))
    t = g.pivot_table(index="row", columns="positions", values="value", aggfunc="first")
    return t.loc[rows, cols]


TITLES = {
    "resid": ("(pass, depth)", "position patched"),
    "head": ("(pass, layer)", "head (output, hook_z)"),
    "path": ("(pass, block-0 input)", "head (the twin's fed-back state into it only)"),
}


def plot_attribution(df: pd.DataFrame, edf, meta: dict, out: Path) -> int:
    """The heatmaps, the check's scatter and the edge graph in ``out``; returns how many."""
    task, where = meta["task"], f"{meta['prefill']} prefill"
    n = 0
    for kind, (ylabel, xlabel) in TITLES.items():
        t = matrix(df, kind)
        if t.empty:
            continue
        fig, ax = subplots(figsize=(max(5, 0.7 * t.shape[1] + 3), max(2.5, 0.4 * t.shape[0] + 1.2)))
        logit_diff_heatmap(ax, t, "estimated logit difference (1 clean, 0 twin)")
        ax.set_title(f"{task}, {where}: attribution of the twin's {kind}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        save_figure(fig, out, f"attribution_{kind}_{task}")
        n += 1
    n += _scatter(df, task, where, out)
    if edf is not None and len(edf):
        n += _edge_graph(edf, task, where, out)
    return n


def _scatter(df, task, where, out) -> int:
    g = df[np.isfinite(df.exact.astype(float))]
    if g.empty:
        return 0
    fig, ax = subplots(figsize=(5.5, 5))
    for i, (kind, h) in enumerate(g.groupby("intervention")):
        ax.scatter(
            h.exact,
            h.value,
            s=18,
            color=PALETTE[i % len(PALETTE)],
            label=kind.removeprefix("patch_"),
        )
    lo = float(min(g.exact.min(), g.value.min(), 0)) - 0.05
    hi = float(max(g.exact.max(), g.value.max(), 1)) + 0.05
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("exact patch (normalised logit difference)")
    ax.set_ylabel("attribution estimate")
    ax.set_title(f"{task}, {where}: estimate against the exact patch")
    ax.legend(fontsize=8)
    save_figure(fig, out, f"attribution_check_{task}")
    return 1


def _node_xy(node: str, base: float, n_layers: int, mid: float) -> tuple[float, float]:
    """A node's place in its pass's stretch starting at x = ``base``: the input, then per layer
    its attention's input, its heads (one row each) and its MLP, then the readout; everything
    but the heads on the middle row ``mid``."""
    if node in ("input", "readout"):
        return (base, mid) if node == "input" else (base + 2 * n_layers + 1, mid)
    kind, at = node.split(" ")
    layer = int(at.split(".")[0])
    if kind == "head":
        return base + 2 * layer + 1, float(at.split(".")[1])
    return base + 2 * layer + (0.6 if kind == "attn" else 2), mid


def _edge_graph(edf: pd.DataFrame, task, where, out) -> int:
    """The strongest edges by |share| (width), toward the twin in one colour and away in
    another, the feedback edges (pass k's readout into pass k+1's input) dashed."""
    e = edf.assign(size=edf.value.abs()).nlargest(N_EDGES, "size")
    passes = [_pass(p) for p in dict.fromkeys(edf["pass"])]
    names = set(edf.source) | set(edf.target)
    layers = 1 + max((int(n.split()[1].split(".")[0]) for n in names if " " in n), default=0)
    heads = 1 + max((int(n.split(".")[1]) for n in names if n.startswith("head ")), default=0)
    mid, span = (heads - 1) / 2, 2 * layers + 3
    base = {p: i * span for i, p in enumerate(passes)}
    fig, ax = subplots(
        figsize=(min(30, max(7, 0.5 * span * len(passes) + 2)), min(12, max(4, 0.3 * heads + 2)))
    )
    xy = {
        (p, n): _node_xy(n, base[p], layers, mid) for p in passes for n in names if n != "feedback"
    }
    ax.scatter(
        [x for x, _ in xy.values()], [y for _, y in xy.values()], s=6, color="lightgrey", zorder=1
    )
    top = float(e["size"].max()) or 1.0
    for _, r in e.iterrows():
        p = _pass(r["pass"])
        before = passes[max(passes.index(p) - 1, 0)]
        x0, y0 = xy[(before, "readout")] if r.feedback else xy[(p, r.source)]
        x1, y1 = xy[(p, r.target)]
        color = PALETTE[3] if r.feedback else (PALETTE[0] if r.value < 0 else PALETTE[1])
        ax.annotate(
            "",
            (x1, y1),
            (x0, y0),
            zorder=2,
            arrowprops={
                "arrowstyle": "->",
                "lw": 0.5 + 3 * r["size"] / top,
                "alpha": 0.85,
                "color": color,
                "linestyle": "--" if r.feedback else "-",
                "connectionstyle": "arc3,rad=0.2",
            },
        )
    for p in passes:
        for n in ("input", "readout"):
            x, y = xy[(p, n)]
            ax.text(x, y - 0.6, f"{p} {n}" if n == "input" else n, fontsize=7, ha="center")
    ax.set_xlim(-1, span * len(passes))
    ax.set_ylim(-1.5, heads)
    every = max(1, layers // 8)  # a deep model: a tick every few layers
    ticks = [(base[p] + 2 * layer + 1, layer) for p in passes for layer in range(0, layers, every)]
    ax.set_xticks([x for x, _ in ticks], [str(layer) for _, layer in ticks], fontsize=7)
    ax.set_xlabel(
        "layer, pass by pass (its attention's input just left of its heads, its MLP "
        "just right, on the middle row)"
    )
    ax.set_ylabel("head")
    ax.set_title(
        f"{task}, {where}: the {len(e)} strongest edges (blue: toward the twin; dashed: feedback)"
    )
    save_figure(fig, out, f"attribution_edges_{task}")
    return 1


def findings(df: pd.DataFrame, edf, meta: dict) -> list[str]:
    """The sites the estimate moves most toward the twin, the agreement with the exact patch
    (a warning when it is low) and the feedback edges' share."""
    task, where = meta["task"], f"{meta['prefill']} prefill"
    low = df.nsmallest(3, "value")
    tops = "; ".join(
        f"{_pass(r['pass'])} {r.intervention.removeprefix('patch_')} {r.site} "
        f"{r.positions}: {r.value:.3f}"
        for _, r in low.iterrows()
    )
    lines = [f"{task} {where}: the estimates that move the answer most toward the twin's: {tops}."]
    ag = meta.get("agreement", {}).get("all", {})
    if ag.get("checked", 0) >= 3 and ag.get("rank_correlation") is not None:
        rr = meta["agreement"]["resid_head"]
        lines.append(
            f"exact check of {ag['checked']} sites: rank correlation "
            f"{ag['rank_correlation']:.3f}, top-{ag['top_k']} recall "
            f"{ag['top_k_recall']:.2f} (resid and head: "
            + (
                f"{rr['rank_correlation']:.3f}, {rr['top_k_recall']:.2f})"
                if rr.get("rank_correlation") is not None
                else "too few checked)"
            )
        )
        if ag["rank_correlation"] < LOW_RANK or ag["top_k_recall"] < LOW_RECALL:
            m = ag["misses"][0]
            lines.append(
                f"warning: the estimates agree poorly with exact patching here; the "
                f"largest miss is {m['intervention']} {m['site']} {m['positions']} "
                f"({m['pass']}): estimate {m['estimate']:.3f}, exact {m['exact']:.3f}"
            )
    if edf is not None and edf.feedback.any():
        fb = edf[edf.feedback]
        lines.append(
            "feedback edges (pass k's top state into pass k+1's fusion): "
            + ", ".join(f"{_pass(r['pass'])} {r.value:+.3f}" for _, r in fb.iterrows())
            + " of the logit difference"
        )
    return lines


def figures(results: Path) -> int:
    """The attribution figures, redrawn from ``results/attribute``'s tables and JSON."""
    folder = Path(results) / "attribute"
    if not (folder / "attribution.csv").exists():
        return 0
    meta = read_json(
        folder / "attribution.json", "record of an attribution", ("prefill", "n_pairs")
    )
    df = read_long_table(folder / "attribution.csv")
    edges = folder / "edges.csv"
    edf = read_long_table(edges) if edges.is_file() else None
    return plot_attribution(df, edf, meta, folder / "figures")

"""The fit analysis in report.md and report.html: the paper's table at the feedback's entry,
the multi-target tables, and the probe heatmaps, each drawn in report.html from the same
selection as its PNG."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fbt_probe.util.files import read_json
from probes.analysis import Figure
from probes.common.figures import ordered_prefills
from probes.common.html import heatmap
from probes.common.probe_results import (
    PAPER_LAYER0,
    depth_by_count_panels,
    load_results,
    overwrites_panels,
    prefill_by_depth_panels,
    primary,
)
from probes.common.tables import percent
from tasks import stratum, task_names
from tasks.base import POOLED


def paper_table(df: pd.DataFrame, depth: int = 0) -> str:
    """Task x prefill at the feedback's entry ``depth`` (pooled counts 1..256): ours [CI],
    chance, control, the paper's (at depth 0)."""
    pooled = df[(df.distractors == POOLED) & (df.overwrites == "all") & (df.depth == depth)]
    name = "layer 0" if depth == 0 else f"depth {depth}"
    lines = [
        f"| task | target | prefill | {name} (ours) [95 % CI] | chance | random-init control | permuted labels | paper |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (task, target, prefill), g in pooled.groupby(["task", "target", "prefill"], sort=False):
        tr = g[g.model == "trained"]
        if tr.empty:
            continue
        r = tr.iloc[0]
        ctl = g[g.model == "random_init"].accuracy
        perm = g[g.model == "permuted"].accuracy
        lines.append(
            f"| {task} | {target} | {prefill} | {percent(r.accuracy)} [{percent(r.ci_low)}, {percent(r.ci_high)}] | {percent(r.chance)} | "
            f"{percent(ctl.iloc[0]) if len(ctl) else '–'} | {percent(perm.iloc[0]) if len(perm) else '–'} | {PAPER_LAYER0.get((task, prefill), '') if depth == 0 else ''} |"
        )
    return "\n".join(lines)


def multi_target_table(df: pd.DataFrame, task: str) -> str:
    """A task with several targets (multi_register: one per register): prefill by depth
    (mean over targets) and, if it has a stratum of its own, by that stratum at depth 0."""
    g = df[(df.task == task) & (df.model == "trained") & (df.distractors == POOLED)]
    if g.empty or g.target.nunique() < 2:
        return ""
    by_depth = g[g.overwrites == "all"].pivot_table(
        index="depth", columns="prefill", values="accuracy", aggfunc="mean"
    )
    lines = [
        "| depth | " + " | ".join(by_depth.columns) + " |",
        "|---" * (1 + len(by_depth.columns)) + "|",
    ]
    for d, row in by_depth.iterrows():
        lines.append(f"| {d} | " + " | ".join(percent(v) for v in row.values) + " |")
    ow = g[g.overwrites != "all"].copy()
    if not ow.empty:
        ow["k"] = ow.overwrites.astype(int)
        t = ow[ow.depth == 0].pivot_table(
            index="k", columns="prefill", values="accuracy", aggfunc="mean"
        )
        name = (stratum(task) if task in task_names() else None) or "stratum"
        lines += [
            "",
            f"At depth 0, by {name} (mean over targets):",
            "",
            f"| {name} | " + " | ".join(t.columns) + " |",
            "|---" * (1 + len(t.columns)) + "|",
        ]
        for k, row in t.iterrows():
            lines.append(f"| {k} | " + " | ".join(percent(v) for v in row.values) + " |")
    return "\n".join(lines)


def report_header(meta: dict, df: pd.DataFrame) -> list[str]:
    """The report's opening: the model, the data, the protocol and the paper's table."""
    datasets = ", ".join(
        f"{t} `{d['content_hash']}` ({d['n_examples']} examples, {d['n_groups']} groups, seed {d['seed']})"
        for t, d in meta.get("datasets", {}).items()
    )
    return [
        f"Model: `{meta.get('model', '?')}` (hash `{meta.get('model_hash', '?')}`), random-init control "
        f"hash `{meta.get('random_init_hash', '?')}`.",
        "",
        "Datasets: " + datasets,
        "",
        f"Probes: standardise + logistic regression, {meta.get('folds', '?')} grouped folds (groups = base "
        f"instance), C from {meta.get('C_grid', '?')} by nested grouped CV, fold seed {meta.get('fold_seed', '?')}; "
        "95 % intervals by bootstrap over groups; chance = a constant-feature probe under the same folds.",
        "Pooled over distractor counts 1..256 (count 0 is trivial under recurrent prefill: the token "
        "before the colon is then the answer itself).",
        "",
        "## Layer 0 at the colon (the paper's table)"
        if not meta.get("entry_depth")
        else f"## Depth {meta['entry_depth']} at the colon, where this design's feedback enters",
        "",
        paper_table(df, int(meta.get("entry_depth", 0))),
        "",
        "Decodable is not the same as used: only causal tests say whether the model relies on it.",
        "",
    ]


def _tip(r, what: str) -> str:
    return (
        f"{what}\naccuracy {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (95 % CI)\n"
        f"n = {int(r.n_examples)} examples in {int(r.n_groups)} groups\nchance {r.chance:.3f}"
    )


def _grid(g: pd.DataFrame, index: str, columns: str, title: str, what) -> str:
    """One heatmap: a row of ``g`` per (index, column) cell."""
    by = {(getattr(r, index), getattr(r, columns)): r for r in g.itertuples(index=False)}
    rows = ordered_prefills(g) if index == "prefill" else sorted(set(g[index]))
    cols = sorted(set(g[columns]))
    chance = float(g.chance.mean())

    def cell(r, c):
        row = by.get((r, c))
        return None if row is None else (row.accuracy, _tip(row, what(r, c)))

    return heatmap(
        f"{title} (chance {chance:.2f})",
        rows,
        cols,
        cell,
        lo=chance,
        hi=1.0,
        row_name=index,
        col_name=columns,
    )


def prefill_by_depth(df: pd.DataFrame, task: str) -> list[str]:
    return [
        _grid(
            g,
            "prefill",
            "depth",
            f"{task} {t}: prefill by depth, counts {POOLED}",
            lambda p, d, t=t: f"{task} {t}, {p} prefill, depth {d}",
        )
        for t, g in prefill_by_depth_panels(df, task)
    ]


def depth_by_count(df: pd.DataFrame, task: str) -> list[str]:
    return [
        _grid(
            g,
            "depth",
            "count",
            f"{task}, {p} prefill: depth by distractor count",
            lambda d, n, p=p: f"{task}, {p} prefill, depth {d}, {n} distractors",
        )
        for _, p, g in depth_by_count_panels(df, task)
    ]


def overwrites(df: pd.DataFrame, task: str) -> list[str]:
    """Depth by stratum value, the mean over targets; the tooltip lists each target's."""
    name = (stratum(task) if task in task_names() else None) or "stratum"
    out = []
    for p, g in overwrites_panels(df, task):
        chance = float(g.chance.mean())

        def cell(d, k, g=g, p=p):
            h = g[(g.depth == d) & (g.k == k)]
            if h.empty:
                return None
            each = "\n".join(
                f"{r.target} {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}], n {int(r.n_examples)}"
                for r in h.itertuples(index=False)
            )
            return (
                h.accuracy.mean(),
                f"{task}, {p} prefill, depth {d}, {name} {k}\nmean over targets {h.accuracy.mean():.3f}\n{each}",
            )

        out.append(
            heatmap(
                f"{task}, {p} prefill: depth by {name}, mean over targets (chance {chance:.2f})",
                sorted(set(g.depth)),
                sorted(set(g.k)),
                cell,
                lo=chance,
                hi=1.0,
                row_name="depth",
                col_name=name,
            )
        )
    return out


# the heatmaps of probes.fit.plot, each by its figure's stem, drawn here from the same panels
HEATMAPS = {
    "heatmap_{task}_prefill_by_depth": prefill_by_depth,
    "heatmap_{task}_depth_by_count": depth_by_count,
    "heatmap_{task}_overwrites": overwrites,
}


def section(results: Path) -> list:
    """The fit's part of the report: the paper's table at the feedback's entry depth, the
    multi-target tables and the figures in ``results/figures``."""
    if not (results / "probe_results.csv").exists():
        return []
    df = primary(load_results(results))
    meta_path = results / "probe_results.json"
    meta = read_json(meta_path, "fit's record") if meta_path.exists() else {}
    parts = report_header(meta, df)
    for task in dict.fromkeys(df.task):
        mt = multi_target_table(df, task)
        if mt:
            parts += [
                f"## {task}: recurrent vs full prefill",
                "",
                "Accuracy by depth (mean over targets), pooled counts 1..256:",
                "",
                mt,
                "",
            ]
    drawn = {
        stem.format(task=t): (draw, t) for stem, draw in HEATMAPS.items() for t in set(df.task)
    }
    figs = sorted((results / "figures").glob("*.png")) if (results / "figures").is_dir() else []
    if figs:
        parts += ["## Probe figures (`fbt-probe plot`)", ""]
    for png in figs:
        draw, task = drawn.get(png.stem, (None, None))
        parts.append(Figure(png, tuple(draw(df, task)) if draw else ()))
    return parts

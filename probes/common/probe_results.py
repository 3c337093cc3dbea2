"""Tables read from ``probe_results.csv``: the layer-0 table and the paper comparison."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fbt_probe.util.files import read_json
from tasks.base import POOLED

# The paper's layer-0 figures at the colon; absent where it gives no number.
PAPER_LAYER0 = {
    ("done_tracking", "standard"): "near chance",
    ("done_tracking", "recurrent"): "99.6 %",
    ("delayed_memory", "standard"): "near chance",
    ("delayed_memory", "recurrent"): "100 %",
}


def load_results(results: str | Path) -> pd.DataFrame:
    path = Path(results)
    if path.is_dir():
        path = path / "probe_results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no probe results at {path}; run 'fbt-probe fit' first")
    try:
        df = pd.read_csv(path, dtype={"distractors": str, "overwrites": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a probe results table ({type(e).__name__})") from None
    missing = {
        "task",
        "target",
        "model",
        "prefill",
        "depth",
        "distractors",
        "accuracy",
        "chance",
    } - set(df.columns)
    if missing:
        raise ValueError(f"{path} lacks columns {sorted(missing)}")
    if df.empty:
        raise ValueError(f"{path} has a header but no rows")
    for col in ("accuracy", "chance", "depth"):
        if not pd.api.types.is_numeric_dtype(df[col]) or df[col].isna().any():
            raise ValueError(f"{path}: column {col!r} holds values that are not numbers")
    if "overwrites" not in df.columns:
        df["overwrites"] = "all"
    for col, default in (("probe", "logistic"), ("site", "resid")):  # tables written before
        if col not in df.columns:
            df[col] = default
    return df


def primary(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of one probe and site, the ones the figures and the report show: the
    logistic probe on the residual ladder when present, else the first pair in the table."""
    pairs = list(dict.fromkeys(zip(df.probe, df.site, strict=True)))
    pick = ("logistic", "resid") if ("logistic", "resid") in pairs else pairs[0]
    return df[(df.probe == pick[0]) & (df.site == pick[1])]


def layer0_table(df: pd.DataFrame, depth: int = 0) -> pd.DataFrame:
    """Task x target x prefill at ``depth`` (the feedback's entry: 0 in the paper's design,
    ``entry_depth`` of a fit's meta in general), pooled over counts 1..256: trained accuracy
    with its interval, chance, majority, the random-init control, permuted labels, the paper
    (at depth 0)."""
    pooled = df[(df.distractors == POOLED) & (df.overwrites == "all") & (df.depth == depth)]
    rows = []
    keys = ["task", "target", "probe", "site", "prefill"]
    for (task, target, probe, site, prefill), g in pooled.groupby(keys, sort=False):
        tr = g[g.model == "trained"]
        if tr.empty:
            continue
        r = tr.iloc[0]
        ctl = g[g.model == "random_init"]
        perm = g[g.model == "permuted"]
        rows.append(
            {
                "task": task,
                "target": target,
                "probe": probe,
                "site": site,
                "prefill": prefill,
                "accuracy": r.accuracy,
                "ci_low": r.ci_low,
                "ci_high": r.ci_high,
                "chance": r.chance,
                "majority": r.majority,
                "random_init": ctl.accuracy.iloc[0] if len(ctl) else float("nan"),
                "permuted": perm.accuracy.iloc[0] if len(perm) else float("nan"),
                "paper": PAPER_LAYER0.get((task, prefill), "")
                if site == "resid" and depth == 0
                else "",
            }
        )
    return pd.DataFrame(rows)


def entry_depth(results: str | Path) -> int:
    """The depth where a fit's model takes its feedback (``probe_results.json``; 0 for a fit
    written before designs had an entry of their own)."""

    meta = read_json(Path(results) / "probe_results.json", "fit's record")
    depth = meta.get("entry_depth", 0)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ValueError(
            f"{Path(results) / 'probe_results.json'}: entry_depth {depth!r} is not a depth"
        )
    return depth


def format_layer0(table: pd.DataFrame) -> str:
    """Plain-text rendering (markdown) of ``layer0_table``; probe and site columns appear
    when the table holds more than the logistic probe on the residual ladder."""
    extra = bool(len(table)) and set(zip(table.probe, table.site, strict=True)) != {
        ("logistic", "resid")
    }
    head = (
        "| task | target | "
        + ("probe | site | " if extra else "")
        + "prefill | layer-0 accuracy [95 % CI] | chance | random-init | permuted | paper |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in table.itertuples():
        lines.append(
            f"| {r.task} | {r.target} | "
            + (f"{r.probe} | {r.site} | " if extra else "")
            + f"{r.prefill} | {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] | "
            f"{r.chance:.3f} | {r.random_init:.3f} | {r.permuted:.3f} | {r.paper} |"
        )
    return "\n".join(lines)


# ---- what each probe heatmap shows: one selection, drawn as the PNG (probes.fit.plot) and
# as report.html's interactive table (probes.fit.report) --------------------------------------
def targets_in(df: pd.DataFrame, task: str) -> list[str]:
    """The task's targets in the table, in order."""
    return list(dict.fromkeys(df[df.task == task].target))


def prefill_by_depth_panels(df: pd.DataFrame, task: str) -> list[tuple[str, pd.DataFrame]]:
    """``heatmap_<task>_prefill_by_depth``: per target, the trained model's rows pooled over
    counts 1..256 (prefill x depth)."""
    sel = df[
        (df.model == "trained")
        & (df.distractors == POOLED)
        & (df.overwrites == "all")
        & (df.task == task)
    ]
    return [(t, sel[sel.target == t]) for t in targets_in(sel, task)]


def depth_by_count_panels(
    df: pd.DataFrame, task: str, prefills=("standard", "recurrent")
) -> list[tuple[str, str, pd.DataFrame]]:
    """``heatmap_<task>_depth_by_count``: the first target's rows per distractor count (a
    ``count`` column), one panel per prefill of ``prefills`` present."""
    sel = df[
        (df.model == "trained")
        & (df.distractors != POOLED)
        & (df.overwrites == "all")
        & (df.task == task)
    ]
    if sel.empty:
        return []
    target = targets_in(sel, task)[0]
    sel = sel[sel.target == target].assign(count=lambda d: d.distractors.astype(int))
    return [(target, p, sel[sel.prefill == p]) for p in prefills if p in set(sel.prefill)]


def overwrites_panels(
    df: pd.DataFrame, task: str, prefills=("recurrent", "full")
) -> list[tuple[str, pd.DataFrame]]:
    """``heatmap_<task>_overwrites`` (a task with a stratum of its own): every target's rows by
    stratum value (a ``k`` column), one panel per prefill of ``prefills`` present."""
    sel = df[(df.model == "trained") & (df.overwrites != "all") & (df.task == task)]
    sel = sel.assign(k=lambda d: d.overwrites.astype(int))
    return [(p, sel[sel.prefill == p]) for p in prefills if p in set(sel.prefill)]

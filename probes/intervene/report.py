"""The intervene analysis in report.md and report.html: decodable vs used, in words and by
depth, and the interchange and depth heatmaps."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fbt_probe.kernels.patching import STATE_HOOK
from fbt_probe.util.files import read_json
from probes.analysis import Figure
from probes.common.figures import ordered_prefills
from probes.common.html import rows_grid
from probes.common.metrics import IV_COLUMNS
from probes.common.probe_results import load_results, primary
from probes.common.tables import percent, read_long_table
from probes.intervene.plot import depth_cells, depth_of, interchange_cells, site_ladder
from probes.intervene.registry import TOKEN_SITE
from tasks.base import POOLED

# below this clean accuracy a model does not do the task, and no route can be said to carry it
MIN_CLEAN_ACCURACY = 0.8


def headline(df: pd.DataFrame, task: str, prefill: str, clean_accuracy: float | None = None) -> str:
    """The answer, in words, to: does the answer rely on the fed-back state, on attention to
    the original token, or on both? From the flip rates of the two interchanges; none where
    the clean run's accuracy (the ``self`` rows, else ``clean_accuracy``) is below
    ``MIN_CLEAN_ACCURACY``."""
    g = df[(df.task == task) & (df.prefill == prefill) & (df.metric == "flip_rate")]

    def pick(intervention, site, positions):
        r = g[(g.intervention == intervention) & (g.site == site) & (g.positions == positions)]
        return None if r.empty else r.iloc[0]

    st = pick("interchange_state", STATE_HOOK, "all")
    tok = pick("interchange_token", TOKEN_SITE, "label_token")
    if tok is None:
        return ""
    fmt = lambda r: f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"  # noqa: E731
    acc = df[
        (df.task == task)
        & (df.prefill == prefill)
        & (df.intervention == "self")
        & (df.metric == "accuracy")
    ]
    clean = acc.iloc[0].value if len(acc) else clean_accuracy
    if clean is not None and clean < MIN_CLEAN_ACCURACY:
        return (
            f"{task}, {prefill} prefill: the clean run answers only {clean:.3f} of "
            f"these prompts, so the interchanges (state {st.value if st is not None else float('nan'):.3f}, "
            f"token {tok.value:.3f}) say nothing about what it uses."
        )
    if st is None:
        return f"{task}, {prefill} prefill: the twin's label token flips {fmt(tok)} of answers."
    state_used, token_used = st.value >= 0.5, tok.value >= 0.5
    verdict = (
        "both: each interchange alone flips most answers"
        if state_used and token_used
        else "the fed-back state: when the state and the token disagree, the answer follows the state"
        if state_used
        else "attention to the original token: when the two disagree, the answer follows the token"
        if token_used
        else "both, redundantly: with either route left clean, most answers survive"
    )
    return (
        f"{task}, {prefill} prefill: interchanging every fed-back state flips {fmt(st)} of answers, "
        f"the label token's embedding {fmt(tok)}: the answer relies on {verdict}."
    )


def headlines(df: pd.DataFrame, plan, out: Path) -> list[str]:
    """``headline`` of each (task, prefill) of ``plan`` that has one, read against the clean
    accuracy the run in ``out`` measured (its ``interventions.json``)."""
    runs = read_json(Path(out) / "interventions.json", "record of interventions", ("runs",))["runs"]
    clean = {(r["task"], r["prefill"]): r.get("clean_accuracy") for r in runs}
    return [line for t, p in plan if (line := headline(df, t, p, clean.get((t, p))))]


def decodable_vs_used(df: pd.DataFrame, iv: pd.DataFrame) -> str:
    """Per task, prefill and depth of the colon: the probe's accuracy beside the answer
    accuracy after LEACE erases the probe's concept there (and a random subspace)."""
    lines = []
    for task, prefill in dict.fromkeys(zip(iv.task, iv.prefill, strict=True)):
        line = headline(iv, task, prefill)
        if line:
            lines += [f"- {line}"]
    lines += [
        "",
        "| task | prefill | depth | probe accuracy (fit) | answer accuracy after LEACE "
        "[95 % CI] | after a random subspace | flip rate after LEACE |",
        "|---|---|---|---|---|---|---|",
    ]
    for (task, prefill), g in iv.groupby(["task", "prefill"], sort=False):
        er = g[g.intervention.isin(["erase_probe", "erase_random"])]
        if er.empty:
            continue
        sites = site_ladder(er)
        clean = g[(g.intervention == "self") & (g.metric == "accuracy")]
        for site in sites:
            d = depth_of(site, sites)

            def pick(name, metric, er=er, site=site):
                return er[
                    (er.intervention == name) & (er.site == site) & (er.metric == metric)
                ].iloc[0]

            probe = df[
                (df.task == task)
                & (df.prefill == prefill)
                & (df.depth == d)
                & (df.model == "trained")
                & (df.distractors == POOLED)
                & (df.overwrites == "all")
            ].accuracy
            e, r, f = (
                pick("erase_probe", "accuracy"),
                pick("erase_random", "accuracy"),
                pick("erase_probe", "flip_rate"),
            )
            lines.append(
                f"| {task} | {prefill} | {d} | {percent(probe.mean()) if len(probe) else '–'} | "
                f"{percent(e.value)} [{percent(e.ci_low)}, {percent(e.ci_high)}] | {percent(r.value)} | {percent(f.value)} |"
            )
        if len(clean):
            lines.append(f"| {task} | {prefill} | clean | | {percent(clean.iloc[0].value)} | | |")
    return "\n".join(lines)


def interchange(iv: pd.DataFrame, task: str) -> list[str]:
    """The interchange figure: flip rate by positions patched x prefill (probes.intervene.plot)."""
    g, rows, cols = interchange_cells(iv, task)
    if g.empty:
        return []
    return [
        rows_grid(
            g,
            rows,
            cols,
            f"{task}: interchange the fed-back state with the twin's (flip rate)",
            lambda w, c: f"{task}, {c}, positions {w}",
            "flip rate",
        )
    ]


def depth(iv: pd.DataFrame, task: str) -> list[str]:
    """The depth figure: answer accuracy after erasing or steering at each depth, per prefill."""
    out = []
    for p in ordered_prefills(iv[iv.task == task]):
        h = depth_cells(iv, task, p)
        if h.empty:
            continue
        out.append(
            rows_grid(
                h,
                sorted(set(h.row)),
                list(dict.fromkeys(h.col)),
                f"{task}, {p} prefill: answer accuracy by depth",
                lambda d, c, p=p: f"{task}, {p} prefill, {c} at depth {d}",
                "accuracy",
            )
        )
    return out


def section(results: Path) -> list:
    """The interventions' part of the report, from ``results/interventions``: decodable vs
    used (in words and by depth, beside the fit's probes where ``results`` holds them) and
    the figures, the interchange and depth heatmaps interactive in report.html."""
    folder = results / "interventions"
    if not (folder / "interventions.csv").exists():
        return []
    iv = read_long_table(folder / "interventions.csv", IV_COLUMNS, keep_default_na=True)
    fit = results / "probe_results.csv"
    df = (
        primary(load_results(results))
        if fit.is_file()
        else pd.DataFrame(
            columns=["task", "prefill", "depth", "model", "distractors", "overwrites", "accuracy"]
        )
    )
    parts = [
        "## Decodable vs used",
        "",
        "Causal tests against each example's counterfactual twin (`fbt-probe intervene`): "
        "interchange the fed-back state or the label token's embedding with the twin's, and "
        "erase the probe's concept (LEACE, fitted on the other grouped folds) at each depth "
        "of the colon. Intervals: 95 % bootstrap over groups.",
        "",
        decodable_vs_used(df, iv),
        "",
    ]
    # the heatmaps of probes.intervene.plot, by its figures' stems, drawn here from the same cells
    heat = {
        f"{kind}_{t}": (draw, t)
        for t in set(iv.task)
        for kind, draw in (("interchange", interchange), ("depth", depth))
    }
    for png in sorted((folder / "figures").glob("*.png")) if (folder / "figures").is_dir() else []:
        draw, task = heat.get(png.stem, (None, None))
        parts.append(Figure(png, tuple(draw(iv, task)) if draw else ()))
    return parts

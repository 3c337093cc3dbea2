"""``report.md``: the paper-style layer-0 table, the figures, and the hashes behind them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from fbt_probe.patching import STATE_HOOK
from probes.interventions import TOKEN_SITE
from probes.results import PAPER_LAYER0, load_results, primary
from tasks import stratum, task_names
from tasks.base import POOLED


def _fmt(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f} %"


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
            f"| {task} | {target} | {prefill} | {_fmt(r.accuracy)} [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}] | {_fmt(r.chance)} | "
            f"{_fmt(ctl.iloc[0]) if len(ctl) else '–'} | {_fmt(perm.iloc[0]) if len(perm) else '–'} | {PAPER_LAYER0.get((task, prefill), '') if depth == 0 else ''} |"
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
        lines.append(f"| {d} | " + " | ".join(_fmt(v) for v in row.values) + " |")
    ow = g[g.overwrites != "all"].copy()
    if not ow.empty:
        ow["k"] = ow.overwrites.astype(int)
        t = ow[ow.depth == 0].pivot_table(
            index="k", columns="prefill", values="accuracy", aggfunc="mean"
        )
        name = (stratum(task) if task in task_names() else None) or "stratum"
        lines += ["", f"At depth 0, by {name} (mean over targets):", "",
                  f"| {name} | " + " | ".join(t.columns) + " |", "|---" * (1 + len(t.columns)) + "|"]  # fmt: skip
        for k, row in t.iterrows():
            lines.append(f"| {k} | " + " | ".join(_fmt(v) for v in row.values) + " |")
    return "\n".join(lines)


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
    acc = df[(df.task == task) & (df.prefill == prefill) & (df.intervention == "self")
             & (df.metric == "accuracy")]  # fmt: skip
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
    runs = json.loads((Path(out) / "interventions.json").read_text())["runs"]
    clean = {(r["task"], r["prefill"]): r.get("clean_accuracy") for r in runs}
    return [line for t, p in plan if (line := headline(df, t, p, clean.get((t, p))))]


def decodable_vs_used(df: pd.DataFrame, iv: pd.DataFrame) -> str:
    """Per task, prefill and depth of the colon: the probe's accuracy beside the answer
    accuracy after LEACE erases the probe's concept there (and a random subspace)."""
    from probes.intervene_plot import _ladder, depth_of

    lines = []
    for task, prefill in dict.fromkeys(zip(iv.task, iv.prefill, strict=True)):
        line = headline(iv, task, prefill)
        if line:
            lines += [f"- {line}"]
    lines += ["", "| task | prefill | depth | probe accuracy (fit) | answer accuracy after LEACE "
              "[95 % CI] | after a random subspace | flip rate after LEACE |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (task, prefill), g in iv.groupby(["task", "prefill"], sort=False):
        er = g[g.intervention.isin(["erase_probe", "erase_random"])]
        if er.empty:
            continue
        ladder = _ladder(er)
        clean = g[(g.intervention == "self") & (g.metric == "accuracy")]
        for site in ladder:
            d = depth_of(site, ladder)

            def pick(name, metric, er=er, site=site):
                return er[
                    (er.intervention == name) & (er.site == site) & (er.metric == metric)
                ].iloc[0]

            probe = df[(df.task == task) & (df.prefill == prefill) & (df.depth == d)
                       & (df.model == "trained") & (df.distractors == POOLED)
                       & (df.overwrites == "all")].accuracy  # fmt: skip
            e, r, f = (
                pick("erase_probe", "accuracy"),
                pick("erase_random", "accuracy"),
                pick("erase_probe", "flip_rate"),
            )
            lines.append(
                f"| {task} | {prefill} | {d} | {_fmt(probe.mean()) if len(probe) else '–'} | "
                f"{_fmt(e.value)} [{_fmt(e.ci_low)}, {_fmt(e.ci_high)}] | {_fmt(r.value)} | {_fmt(f.value)} |"
            )
        if len(clean):
            lines.append(f"| {task} | {prefill} | clean | | {_fmt(clean.iloc[0].value)} | | |")
    return "\n".join(lines)


def report_header(meta: dict, df: pd.DataFrame) -> list[str]:
    """The report's opening: the model, the data, the protocol and the paper's table."""
    datasets = ", ".join(
        f"{t} `{d['content_hash']}` ({d['n_examples']} examples, {d['n_groups']} groups, seed {d['seed']})"
        for t, d in meta.get("datasets", {}).items()
    )
    return [
        "# fbt-probe report: is task state linearly decodable from the latent feedback?",
        "",
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
        "## Layer 0 at the colon (the paper's table)" if not meta.get("entry_depth") else
        f"## Depth {meta['entry_depth']} at the colon, where this design's feedback enters",
        "",
        paper_table(df, int(meta.get("entry_depth", 0))),
        "",
        "Decodable is not the same as used: only causal tests say whether the model relies on it.",
        "",
    ]  # fmt: skip


def anatomy_section(res: Path, rel) -> list[str]:
    """The lens's and the trajectory's summary lines and figures, where ``res`` holds their
    folders (``lens/``, ``trajectory/``; docs/anatomy.md explains each measure)."""
    from probes.lens_run import headline as lens_line
    from probes.trajectory_run import headline as trajectory_line

    parts = []
    for folder, stem, line, what in (
        ("lens", "lens", lens_line, "What each (pass, depth) predicts (`fbt-probe lens`)"),
        ("trajectory", "trajectory", trajectory_line, "How the states move over passes (`fbt-probe trajectory`)"),
    ):  # fmt: skip
        csv = res / folder / f"{stem}.csv"
        if not csv.is_file():
            continue
        df = pd.read_csv(csv, dtype={"read": str, "distractors": str})
        parts += [f"## {what}", ""] + [f"- {line(df, t)}" for t in dict.fromkeys(df.task)] + [""]
        for png in sorted((res / folder / "figures").glob("*.png")):
            parts += [f"![{png.stem}]({rel(png)})", ""]
    return parts


def write_report(results: str | Path, figures: str | Path | None = None) -> Path:
    """Write ``report.md`` next to ``probe_results.csv``, figures linked relative to it, and
    ``report.html`` beside it: the same report as one offline page (probes.report_html)."""
    from probes.report_html import write_report_html

    res = Path(results)
    df = primary(load_results(res))
    meta_path = res / "probe_results.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    figs = Path(figures) if figures is not None else res / "figures"
    rel = lambda p: p.relative_to(res) if p.is_relative_to(res) else p.resolve()  # noqa: E731
    parts = report_header(meta, df)
    for task in dict.fromkeys(df.task):
        mt = multi_target_table(df, task)
        if mt:
            parts += [f"## {task}: recurrent vs full prefill", "",
                      "Accuracy by depth (mean over targets), pooled counts 1..256:", "", mt, ""]  # fmt: skip
    iv_path = res / "interventions" / "interventions.csv"
    if iv_path.is_file():
        iv = pd.read_csv(iv_path, keep_default_na=True)
        parts += [
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
        ivfigs = res / "interventions" / "figures"
        for png in sorted(ivfigs.glob("*.png")) if ivfigs.is_dir() else []:
            parts += [f"![{png.stem}]({rel(png)})", ""]
    parts += anatomy_section(res, rel)
    if figs.is_dir():
        parts += ["## Figures", ""]
        for png in sorted(figs.glob("*.png")):
            parts += [f"![{png.stem}]({rel(png)})", ""]
    from tasks.files import atomic_write

    out, text = res / "report.md", "\n".join(parts)
    atomic_write(out, lambda tmp: Path(tmp).write_text(text))
    write_report_html(res, text, df)
    return out

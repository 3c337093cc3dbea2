"""How do the feedback designs compare on one protocol: where the fed-back state comes from,
where it enters and how it is fused? For each design's seed study
(``fbt-probe seeds run --config design-<d> --seeds 0,1 --out runs/designs/<d>``), per seed:

- answers by decoding mode (the seed's row: ``fbt-probe eval``'s held-out prompts);
- the probe at the feedback's entry depth, standard against recurrent prefill (the seed's row:
  ``fit``'s protocol at block b's input for a design whose feedback enters block b);
- whether the state is used: interchanging every fed-back state with the twin's against
  interchanging the label token's embedding, flip rates (``fbt-probe intervene``);
- the contraction of the stability analysis: the state change at pass 30 over pass 2's
  (``fbt-probe stability --prefill k30``);
- the training time (``metrics.json``).

    python research/designs.py runs/designs --out figures/designs

Writes ``designs.csv`` (one row per design and seed), ``designs.md`` (the mean over seeds, with
each seed's values) and ``designs.png``. The interventions and stability runs are kept in each
seed's folder and read again on the next call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

DESIGNS = ("paper", "top-to-2", "2-to-1", "replace", "additive", "none")
TASKS = ("delayed_memory", "done_tracking")
MODES = ("standard", "soft", "fused", "full")


def interchange(run: Path) -> dict:
    """Flip rates of the two interchanges on each task under recurrent prefill."""
    from fbt_probe.kernels.patching import STATE_HOOK
    from fbt_probe.loading import resolve_model
    from probes.intervene.registry import TOKEN_SITE
    from probes.intervene.run import intervene_battery

    out = run / "interchange"
    csv = out / "interventions.csv"
    if not csv.is_file():
        model, name = resolve_model(str(run))
        intervene_battery(
            model,
            name,
            [(t, "recurrent") for t in TASKS],
            out,
            kinds=("interchange_state", "interchange_token"),
        )
    df = pd.read_csv(csv)
    g = df[df.metric == "flip_rate"]
    row = {}
    for t in TASKS:
        st = g[
            (g.task == t)
            & (g.intervention == "interchange_state")
            & (g.site == STATE_HOOK)
            & (g.positions == "all")
        ]
        tok = g[
            (g.task == t)
            & (g.intervention == "interchange_token")
            & (g.site == TOKEN_SITE)
            & (g.positions == "label_token")
        ]
        row[f"{t}/state_flips"] = float(st.value.iloc[0]) if len(st) else float("nan")
        row[f"{t}/token_flips"] = float(tok.value.iloc[0]) if len(tok) else float("nan")
    return row


def contraction(run: Path) -> dict:
    """The state change at pass 30 over pass 2's, and the stability verdict."""
    from fbt_probe.kernels.stability import verdict
    from probes import run_stability

    out = run / "stability"
    if not (out / "stability.csv").is_file():
        run_stability([str(run)], prefill="k30", out=out, decode_tokens=0)
    df = pd.read_csv(out / "stability.csv")
    by = df.set_index("pass")
    first = by.delta_mean.get(2, float("nan"))
    ratio = by.delta_mean.get(30, 0.0) / first if first > 0 else float("nan")
    return {"contraction_30_over_2": float(ratio), "verdict": verdict(df.to_dict("records"))}


def seed_rows(study: Path) -> list[dict]:
    """One row per finished seed of one design's study."""
    rows_file = study / "seed_rows.json"
    if not rows_file.is_file():
        return []
    out = []
    for seed, r in sorted(json.loads(rows_file.read_text()).items(), key=lambda kv: int(kv[0])):
        run = study / f"seed-{seed}"
        metrics = json.loads((run / "metrics.json").read_text())
        model_cfg = json.loads((run / "train_config.json").read_text())["model"]
        row = {"seed": int(seed), "entry_depth": model_cfg.get("feedback_target", 0)}
        for t in TASKS:
            for m in MODES:
                row[f"{t}/{m}"] = r.get(f"{t}/{m}")
            for p in ("standard", "recurrent"):
                row[f"{t}/probe_{p}"] = r.get(f"probe/{t}/label/{p}")
                row[f"{t}/chance_{p}"] = r.get(f"chance/{t}/label/{p}")
        row["train_minutes"] = round(metrics["wall_seconds_this_call"] / 60, 1)
        row.update(interchange(run))
        row.update(contraction(run))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the folder holding one seed study per design")
    ap.add_argument("--out", type=Path, default=Path("figures/designs"))
    a = ap.parse_args()
    rows = []
    for d in DESIGNS:
        for r in seed_rows(a.root / d):
            rows.append({"design": d, **r})
    if not rows:
        raise SystemExit(f"error: no finished design studies under {a.root}")
    df = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "designs.csv", index=False, float_format="%.4g")
    write_markdown(df, a.out / "designs.md")
    plot(df, a.out / "designs.png")
    print(f"wrote {a.out}/designs.csv, designs.md, designs.png ({len(df)} design x seed rows)")  # noqa: T201


MEASURES = (
    [(f"{t}/{m}", f"{t}: answers, {m} decoding") for t in TASKS for m in MODES]
    + [
        (f"{t}/probe_{p}", f"{t}: probe at the entry, {p} prefill")
        for t in TASKS
        for p in ("standard", "recurrent")
    ]
    + [(f"{t}/chance_recurrent", f"{t}: the probe's chance") for t in TASKS]
    + [(f"{t}/state_flips", f"{t}: flips, interchanging every fed-back state") for t in TASKS]
    + [(f"{t}/token_flips", f"{t}: flips, interchanging the label token") for t in TASKS]
    + [
        ("contraction_30_over_2", "state change, pass 30 / pass 2"),
        ("train_minutes", "training minutes (2 CPU cores)"),
    ]
)


# a ratio that spans decades, and minutes; "–" where a value is undefined (no state change)
FORMATS = {"contraction_30_over_2": "{:.1e}", "train_minutes": "{:.1f}"}


def write_markdown(df: pd.DataFrame, path: Path) -> None:
    """One row per measure, one column per design: the mean over seeds, then each seed's value
    in parentheses, in seed order ("0.722 (1.000 / 0.444)": seeds 0 and 1)."""
    designs = list(dict.fromkeys(df.design))
    lines = ["| measure | " + " | ".join(designs) + " |", "|---" * (len(designs) + 1) + "|"]
    for col, label in MEASURES:
        fmt = FORMATS.get(col, "{:.3f}")
        show = lambda x, fmt=fmt: "–" if x != x else fmt.format(x)  # noqa: E731
        cells = []
        for d in designs:
            v = df[df.design == d][col]
            each = " / ".join(show(x) for x in v)
            cells.append(f"{show(v.mean())} ({each})" if len(v) > 1 else each)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdicts = [" / ".join(df[df.design == d].verdict) for d in designs]
    lines.append("| stability verdict | " + " | ".join(verdicts) + " |")
    seeds = [" / ".join(map(str, df[df.design == d].seed)) for d in designs]
    lines.append("| seeds | " + " | ".join(seeds) + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(df: pd.DataFrame, path: Path) -> None:
    from probes.common.figures import subplots

    means = df.groupby("design", sort=False).mean(numeric_only=True)
    panels = [
        ("answers, full decoding", [f"{t}/full" for t in TASKS]),
        ("probe at the entry, standard prefill", [f"{t}/probe_standard" for t in TASKS]),
        ("probe at the entry, recurrent prefill", [f"{t}/probe_recurrent" for t in TASKS]),
        ("flips, interchanging the state", [f"{t}/state_flips" for t in TASKS]),
        ("flips, interchanging the label token", [f"{t}/token_flips" for t in TASKS]),
    ]
    fig, axes = subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), sharey=True)
    for ax, (title, cols) in zip(axes, panels, strict=True):
        means[cols].rename(columns=lambda c: c.split("/")[0]).plot.bar(ax=ax, rot=60, legend=False)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=130)


if __name__ == "__main__":
    main()

"""The patch analysis in report.md and report.html: its findings and its heatmaps."""

from __future__ import annotations

from pathlib import Path

from fbt_probe.util.files import read_json
from probes.analysis import Figure
from probes.common.tables import read_long_table
from probes.patch.plot import findings


def section(results: Path) -> list:
    """The patching's part of the report, from ``results/patch``: the patches that move the
    answer most toward the twin's, per kind, and the heatmaps."""
    folder = results / "patch"
    if not (folder / "patch.csv").exists():
        return []
    df = read_long_table(folder / "patch.csv")
    meta = read_json(folder / "patch.json", "record of a patching", ("prefill", "pass"))
    where = f"{meta['prefill']} prefill, pass {meta['pass']}"
    parts = [
        "## Where the label's difference lives (`fbt-probe patch`)",
        "",
        f"The twin's activation patched into the clean run one site at a time ({where}, "
        f"{meta['n_pairs']} pairs); 1 = the clean answer, 0 = the twin's "
        "(normalised logit difference).",
        "",
    ]
    parts += [f"- {line}" for line in findings(df, meta["task"], where)] + [""]
    figs = folder / "figures"
    parts += [Figure(png) for png in sorted(figs.glob("*.png"))] if figs.is_dir() else []
    return parts

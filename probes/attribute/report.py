"""The attribution analysis in report.md and report.html: its findings, the agreement with the
exact patches and its figures."""

from __future__ import annotations

from pathlib import Path

from fbt_probe.util.files import read_json
from probes.analysis import Figure
from probes.attribute.plot import findings
from probes.common.tables import read_long_table


def section(results: Path) -> list:
    """The attribution's part of the report, from ``results/attribute``."""
    folder = results / "attribute"
    if not (folder / "attribution.csv").exists():
        return []
    df = read_long_table(folder / "attribution.csv")
    edges = folder / "edges.csv"
    edf = read_long_table(edges) if edges.is_file() else None
    meta = read_json(
        folder / "attribution.json", "record of an attribution", ("prefill", "n_pairs")
    )
    parts = [
        "## Attribution through the feedback loop (`fbt-probe attribute`)",
        "",
        f"Every site of every pass ({meta['prefill']} prefill, {meta['n_pairs']} pairs) "
        "scored from one clean run with its backward pass and one twin run: the normalised "
        "logit difference the patch would leave (1 = the clean answer, 0 = the twin's), "
        "checked against exact patches of a sample of sites.",
        "",
    ]
    parts += [f"- {line}" for line in findings(df, edf, meta)] + [""]
    figs = folder / "figures"
    parts += [Figure(png) for png in sorted(figs.glob("*.png"))] if figs.is_dir() else []
    return parts

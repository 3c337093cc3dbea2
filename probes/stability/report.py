"""The stability analysis in report.md and report.html: a verdict per model and the figures."""

from __future__ import annotations

from pathlib import Path

from probes.analysis import Figure
from probes.common.tables import read_table
from probes.stability.run import verdict_line


def section(results: Path) -> list:
    """The stability's part of the report, from ``results/stability``: does the feedback map
    contract, per model, and the figures."""
    folder = results / "stability"
    if not (folder / "stability.csv").exists():
        return []
    df = read_table(
        folder / "stability.csv", ("model", "pass"), ("delta_mean", "delta_max", "loss", "accuracy")
    )
    parts = ["## Does the feedback map contract? (`fbt-probe stability`)", ""]
    for name, g in df.groupby("model", sort=False):
        parts.append(f"- {verdict_line(name, g.sort_values('pass').to_dict('records'))}")
    parts.append("")
    parts += [Figure(png) for png in sorted(folder.glob("*.png"))]
    return parts

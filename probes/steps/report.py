"""The steps analysis in report.md and report.html: a finding per task and its figure."""

from __future__ import annotations

from pathlib import Path

from probes.analysis import Figure
from probes.common.tables import NUMBERS, findings, read_table
from probes.steps.plot import REQUIRED
from probes.steps.run import headline


def section(results: Path) -> list:
    """The steps part of the report, from ``results/steps``."""
    folder = results / "steps"
    if not (folder / "steps.csv").exists():
        return []
    df = read_table(
        folder / "steps.csv", REQUIRED, NUMBERS, dtype={"depth": str, "distractors": str}
    )
    parts: list = findings("The task state while generating (`fbt-probe steps`)", df, headline)
    pngs = [folder / "figures" / f"steps_{t}.png" for t in dict.fromkeys(df.task)]
    return parts + [Figure(p) for p in pngs if p.is_file()]

"""The loop analysis in report.md and report.html: a finding per task and its figure."""

from __future__ import annotations

from pathlib import Path

from probes.analysis import Figure
from probes.common.tables import NUMBERS, findings, read_table
from probes.loop.plot import REQUIRED
from probes.loop.run import headline


def section(results: Path) -> list:
    """The loop part of the report, from ``results/loop``."""
    folder = results / "loop"
    if not (folder / "loop.csv").exists():
        return []
    df = read_table(folder / "loop.csv", REQUIRED, NUMBERS)
    parts: list = findings("Closed-loop swaps while generating (`fbt-probe loop`)", df, headline)
    pngs = [folder / "figures" / f"loop_{t}.png" for t in dict.fromkeys(df.task)]
    return parts + [Figure(p) for p in pngs if p.is_file()]

"""The heads analysis in report.md and report.html: its findings and its figures."""

from __future__ import annotations

from pathlib import Path

from probes.analysis import Figure
from probes.common.tables import findings, read_long_table
from probes.heads.run import headline


def section(results: Path) -> list:
    """The heads' part of the report, from ``results/heads``: per task, the heads that read
    the label (and the token after it) most in each pass, and the figures."""
    folder = results / "heads"
    if not (folder / "heads.csv").exists():
        return []
    df = read_long_table(folder / "heads.csv", dtype={"distractors": str})
    tasks = [t for t in dict.fromkeys(df.task) if t != "-"]  # "-": the induction test's rows
    parts: list = findings("Attention by head and pass (`fbt-probe heads`)", df, headline, tasks)
    figs = folder / "figures"
    parts += [Figure(png) for png in sorted(figs.glob("*.png"))] if figs.is_dir() else []
    return parts

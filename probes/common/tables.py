"""Result tables: written whole or not at all, and their numbers as the reports print them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tasks.safe_files import atomic_write


def write_table(df: pd.DataFrame, path: Path) -> Path:
    """``df`` as a CSV at ``path`` (six significant digits), written whole or not at all."""
    atomic_write(path, lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))
    return path


def write_json(doc: dict, path: Path, indent: int = 1) -> Path:
    """``doc`` as indented JSON at ``path``, written whole or not at all."""
    text = json.dumps(doc, indent=indent)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n"))
    return path


def percent(x: float) -> str:
    """A fraction as the report prints it (``–`` for a missing value)."""
    return "–" if x != x else f"{100 * x:.1f} %"


# a long table's columns under the names of earlier releases: a results folder written then
# still reports
OLD_COLUMNS = {"n_examples": "n", "measure": "metric", "offset": "from_answer"}


def findings(title: str, df: pd.DataFrame, headline, tasks=None) -> list[str]:
    """A report section's opening: its title and one finding per task (``headline(df, task)``)."""
    tasks = list(dict.fromkeys(df.task)) if tasks is None else tasks
    return [f"## {title}", "", *(f"- {headline(df, t)}" for t in tasks), ""]


def read_long_table(path: Path, **read_csv) -> pd.DataFrame:
    """A long result table (``metric``, ``value``, ``ci_low``, ``ci_high``, ``n``), its
    columns renamed from their earlier names where it was written before the rename."""
    return pd.read_csv(path, **read_csv).rename(columns=OLD_COLUMNS)

"""Result tables: written whole or not at all, and their numbers as the reports print them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from fbt_probe.util.files import atomic_write


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


NUMBERS = ("value", "ci_low", "ci_high", "n")


def read_table(
    path: Path, required: tuple[str, ...] = (), numeric: tuple[str, ...] = (), **read_csv
) -> pd.DataFrame:
    """A results table an analysis wrote, read back (a report, a redraw): refused in one line
    naming ``path`` where it is not CSV, lacks a ``required`` column or has empty cells in
    one (cut short, or edited), or holds other than numbers in a ``numeric`` column."""
    path = Path(path)
    try:
        df = pd.read_csv(path, **read_csv)
    except (
        pd.errors.ParserError,
        pd.errors.EmptyDataError,
        UnicodeDecodeError,
        ValueError,
        OSError,
    ) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a results table ({first})") from None
    df = df.rename(columns=OLD_COLUMNS)
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"{path} is not a results table of this kind (no column {missing[0]!r})")
    for c in required:
        if df[c].isna().any():
            raise ValueError(f"{path}: column {c!r} has empty cells (cut short, or edited)")
    for c in numeric:
        if c in df.columns and not pd.api.types.is_numeric_dtype(df[c]):
            raise ValueError(f"{path}: column {c!r} holds values that are not numbers")
    return df


def read_long_table(path: Path, required: tuple[str, ...] = ("task",), **read_csv) -> pd.DataFrame:
    """A long result table (``metric``, ``value``, ``ci_low``, ``ci_high``, ``n``), checked
    (``read_table``), its columns renamed from their earlier names where it was written
    before the rename."""
    return read_table(path, (*required, "value"), NUMBERS, **read_csv)


def versions() -> dict:
    """The versions a result was computed with (recorded in its JSON)."""
    import platform

    import numpy as np
    import sklearn
    import torch

    from fbt_probe import __version__
    from tasks import vocab

    return {
        "fbt_probe": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sklearn": sklearn.__version__,
        "numpy": np.__version__,
        "vocab": vocab.VOCAB_VERSION,
    }

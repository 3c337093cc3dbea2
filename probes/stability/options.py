"""The options of ``fbt-probe stability``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.options import JACOBI_WORDS, option


@dataclass(frozen=True)
class StabilityOptions:
    model: list[str] = option(["default"], "--model", "-m")
    """'default' or a model/run folder; repeat to compare models in one figure."""
    prefill: str = option("k30", "--prefill", "-p")
    "The Jacobi passes run: " + JACOBI_WORDS + "; 1..1000 passes."
    task: str = option("all", "--task", "-t")
    """Held-out sequences of this task, or 'all'."""
    out: Path = option(Path("results/stability"), "--out", "-o")
    """Output folder."""
    decode_tokens: int = option(1000, "--decode-tokens")
    """Tokens of long SOFT decoding (0 = skip)."""
    force: bool = option(False, "--force")
    """Replace an earlier run's outputs in --out (all of them, stale ones included)."""

"""The options of ``fbt-probe heads``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.options import JACOBI_WORDS, Common, JacobiPasses, option


@dataclass(frozen=True)
class HeadsOptions(JacobiPasses, Common):
    PASSES = (1, 16)

    prefill: str = option("recurrent", "--prefill", "-p")
    "The Jacobi passes read, every one up to the last: " + JACOBI_WORDS + "; 1..16 passes."
    data: Path | None = option(None, "--data")
    """A twin dataset (default data/<task>-twins.parquet)."""
    out: Path = option(Path("results/heads"), "--out", "-o")
    """Output folder."""
    seed: int = option(0, "--seed", min=0)
    """Bootstrap seed and the induction test's tokens."""
    batch_size: int = option(64, "--batch-size", min=1)
    """Examples per batch."""

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.passes  # parsed now: a bad --prefill fails before any work
        _ = self.tasks_and_data

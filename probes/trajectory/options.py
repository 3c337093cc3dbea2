"""The options of ``fbt-probe trajectory``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.options import JACOBI_WORDS, Common, JacobiPasses, option


@dataclass(frozen=True)
class TrajectoryOptions(JacobiPasses, Common):
    PASSES = (2, 64)  # a trajectory needs a second pass

    prefill: str = option("k8", "--prefill", "-p")
    "The Jacobi passes run, distances taken to the last: " + JACOBI_WORDS + "; 2..64 passes."
    out: Path = option(Path("results/trajectory"), "--out", "-o")
    """Output folder."""
    seed: int = option(0, "--seed", min=0)
    """Bootstrap seed."""
    batch_size: int = option(64, "--batch-size", min=1)
    """Examples per batch."""

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.passes  # parsed now: a bad --prefill fails before any work
        _ = self.tasks_and_data

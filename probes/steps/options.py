"""The options of ``fbt-probe steps``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.decoding import MODES_HELP
from probes.common.options import Common, GeneratedTasks, option


@dataclass(frozen=True)
class StepsOptions(GeneratedTasks, Common):
    model: str = option("generation", "--model", "-m")
    """'generation' (the shipped model of the generation tasks), another shipped model's name or a model/run folder."""
    task: str = option("all", "--task", "-t")
    """A task whose answer is generated (count_steps, recall_bits), a comma-separated list, or 'all'."""
    modes: str = option("standard,soft,fused", "--modes")
    MODES_HELP + " Default: standard,soft,fused."
    out: Path = option(Path("results/steps"), "--out", "-o")
    """Output folder."""
    no_controls: bool = option(False, "--no-controls")
    """Skip the controls (labels permuted by group; a random-init model of the same config)."""
    folds: int = option(5, "--folds", min=2)
    """Grouped cross-validation folds."""
    seed: int = option(0, "--seed", min=0)
    """Fold, bootstrap and random-init seed."""
    jobs: int = option(2, "--jobs", min=1)
    """Probes fitted at once (worker processes)."""
    batch_size: int = option(128, "--batch-size", min=1)
    """Examples per batch."""

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.tasks, self.mode_list

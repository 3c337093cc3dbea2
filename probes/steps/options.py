"""The options of ``fbt-probe steps``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.decoding import MODES_HELP
from probes.common.options import Common, option


@dataclass(frozen=True)
class StepsOptions(Common):
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

    @cached_property
    def tasks(self) -> tuple[str, ...]:
        """``--task`` read once: the generated-answer tasks."""
        from probes.common.decoding import generation_tasks

        return generation_tasks(self.task)

    @cached_property
    def mode_list(self) -> tuple:
        """``--modes`` read once: the decoding modes."""
        from fbt_probe.prefill import parse_modes

        return tuple(parse_modes(self.modes))

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.tasks, self.mode_list

"""The options of ``fbt-probe loop``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.decoding import MODES_HELP
from probes.common.options import Common, GeneratedTasks, option


@dataclass(frozen=True)
class LoopOptions(GeneratedTasks, Common):
    model: str = option("generation", "--model", "-m")
    """'generation' (the shipped model of the generation tasks), another shipped model's name or a model/run folder."""
    task: str = option("all", "--task", "-t")
    """A task whose answer is generated (count_steps, recall_bits), a comma-separated list, or 'all'."""
    data: Path | None = option(None, "--data")
    """A twin dataset (generate --twins); default data/<task>-twins.parquet, generated if absent."""
    modes: str = option("standard,soft,fused", "--modes")
    MODES_HELP + " Default: standard,soft,fused."
    kinds: str = option("state,token,both", "--kinds")
    """What is swapped for the twin's at step s, comma-separated: state (the fed-back state h_{s-1}), token (the embedding of generated token s - 1), both."""
    out: Path = option(Path("results/loop"), "--out", "-o")
    """Output folder."""
    seed: int = option(0, "--seed", min=0)
    """Bootstrap seed."""
    batch_size: int = option(128, "--batch-size", min=1)
    """Examples per batch."""

    @cached_property
    def kind_list(self) -> tuple[str, ...]:
        """``--kinds`` read once: what is swapped."""
        from fbt_probe.kernels.generation import KINDS
        from fbt_probe.util.lists import comma_items

        kinds = comma_items(self.kinds, "--kinds")
        for k in kinds:
            if k not in KINDS:
                raise ValueError(
                    f"--kinds {self.kinds!r}: unknown kind {k!r}; choose from {', '.join(KINDS)}"
                )
        return kinds

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.tasks, self.mode_list, self.kind_list

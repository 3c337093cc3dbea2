"""The options of ``fbt-probe patch``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.options import Common, option


@dataclass(frozen=True)
class PatchOptions(Common):
    task: str = option("delayed_memory", "--task", "-t")
    """One task."""
    prefill: str = option("recurrent", "--prefill", "-p")
    """The Jacobi passes run: standard, recurrent or k<N>."""
    kinds: str = option("resid,head,path", "--kinds")
    """resid (depth x position), head (each head's output), path (the fed-back state into one block-0 head's q, k or v), comma-separated."""
    pass_number: int | None = option(None, "--pass")
    """The pass patched, counted from 1 (default: the prefill's last); an earlier one reaches the answer through the feedback."""
    depths: str | None = option(None, "--depths")
    """The residual's depths: 'all' or a list (default: 5 evenly spaced, every one of the built-in model)."""
    data: Path | None = option(None, "--data")
    """A twin dataset (default data/<task>-twins.parquet)."""
    out: Path = option(Path("results/patch"), "--out", "-o")
    """Output folder."""
    seed: int = option(0, "--seed", min=0)
    """Bootstrap seed."""
    batch_size: int = option(64, "--batch-size", min=1)
    """Examples per batch."""
    groups: int | None = option(None, "--groups", min=1)
    """Patch only the examples of this many groups (default: every one), for a quicker sweep."""

    @cached_property
    def parsed(self) -> tuple:
        """(the prefill, the kinds, the patched pass counted from 0), read once."""
        from probes.patch.run import parse_args

        return parse_args(self.prefill, self.kinds, self.pass_number)

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        from probes.common.data import one_task

        _ = self.parsed
        one_task(self.task)

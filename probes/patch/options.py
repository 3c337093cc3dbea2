"""The options of ``fbt-probe patch``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.options import Common, option

KINDS = ("resid", "head", "path")  # what --kinds may name


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
        from fbt_probe.prefill import parse_prefill
        from fbt_probe.util.lists import comma_items

        pf = parse_prefill(self.prefill)
        if pf.passes is None:
            raise ValueError(
                "--prefill full: patch acts on a Jacobi pass; use standard, recurrent or k<N>"
            )
        chosen = comma_items(self.kinds, "--kinds")
        if not chosen or any(k not in KINDS for k in chosen):
            raise ValueError(
                f"--kinds {self.kinds!r}: choose from {', '.join(KINDS)}, comma-separated"
            )
        n = self.pass_number
        if n is not None and not 1 <= n <= pf.passes:
            raise ValueError(f"--pass {n}: {pf.name} prefill has passes 1..{pf.passes}")
        return pf, chosen, pf.passes - 1 if n is None else n - 1

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        from probes.common.data import one_task

        _ = self.parsed
        one_task(self.task)

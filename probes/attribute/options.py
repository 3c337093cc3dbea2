"""The options of ``fbt-probe attribute``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.options import Common, option


@dataclass(frozen=True)
class AttributeOptions(Common):
    task: str = option("delayed_memory", "--task", "-t")
    """One task."""
    prefill: str = option("recurrent", "--prefill", "-p")
    """standard, recurrent, k<N> (N Jacobi passes; every pass is scored) or full (the exact recurrence, every step)."""
    kinds: str = option("resid,head,state,path", "--kinds")
    """resid (each depth and position), head (each head's output), state (the fed-back state entering the fusion), path (the fed-back state into one block-0 head's q, k or v), comma-separated."""
    edges: str = option("auto", "--edges")
    """Score the edges between components too: on, off, or auto (on where the model has the layout they need: the built-in one)."""
    check: str = option("20", "--check")
    """Sites patched exactly to check the estimates: a number (half the top-ranked, half at random) or 'all'; 0 checks none."""
    qk_fix: bool = option(True, "--qk-fix/--no-qk-fix")
    """AtP*'s fix for queries and keys: read the attention pattern after the patch exactly."""
    ig_steps: int = option(0, "--ig-steps", min=0)
    """Integrate the gradients over this many points between the clean and the twin's input (EAP-IG; each costs one more backward pass); 0: plain gradients (AtP)."""
    data: Path | None = option(None, "--data")
    """A twin dataset (default data/<task>-twins.parquet)."""
    out: Path = option(Path("results/attribute"), "--out", "-o")
    """Output folder."""
    seed: int = option(0, "--seed", min=0)
    """Seed of the bootstrap and of the sites checked at random."""
    batch_size: int = option(32, "--batch-size", min=1)
    """Examples per batch."""
    groups: int | None = option(None, "--groups", min=1)
    """Score only the examples of this many groups (default: every one)."""

    @cached_property
    def parsed(self) -> tuple:
        """(the prefill, the kinds, whether to score edges (None: where the model allows),
        the sites to check), read once."""
        from fbt_probe.kernels.attribution import KINDS
        from fbt_probe.prefill import parse_prefill
        from fbt_probe.util.lists import comma_items

        pf = parse_prefill(self.prefill)
        chosen = comma_items(self.kinds, "--kinds")
        if any(k not in KINDS for k in chosen):
            raise ValueError(
                f"--kinds {self.kinds!r}: choose from {', '.join(KINDS)}, comma-separated"
            )
        if self.edges not in ("on", "off", "auto"):
            raise ValueError(f"--edges {self.edges!r}: choose on, off or auto")
        if self.check != "all" and not self.check.isdigit():
            raise ValueError(f"--check {self.check!r}: give a number of sites (0: none) or 'all'")
        return pf, tuple(chosen), {"on": True, "off": False, "auto": None}[self.edges], self.check

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        from probes.common.data import one_task

        _ = self.parsed
        one_task(self.task)

"""The options of ``fbt-probe stability``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.options import JACOBI_WORDS, JacobiPasses, option


@dataclass(frozen=True)
class StabilityOptions(JacobiPasses):
    PASSES = (1, 1000)

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

    @property
    def models(self) -> tuple[str, ...]:
        """The models compared (``--model``, repeated; in the library one model or several)."""
        return tuple(self.model) if isinstance(self.model, list | tuple) else (self.model,)

    @cached_property
    def tasks(self) -> tuple[str, ...]:
        """The tasks whose held-out sequences are run."""
        from probes.common.data import one_task
        from tasks import task_names

        return task_names() if one_task(self.task, all_too=True) == "all" else (self.task,)

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        _ = self.passes  # parsed now: a bad --prefill fails before any work
        if not 0 <= self.decode_tokens <= 4000:
            raise ValueError("--decode-tokens must be in 0..4000")
        _ = self.tasks

"""The options of ``fbt-probe intervene``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from probes.common.options import PREFILLS_HELP, Common, option


@dataclass(frozen=True)
class InterveneOptions(Common):
    prefill: str = option("recurrent", "--prefill", "-p")
    PREFILLS_HELP + " State interventions need a feedback prefill."
    data: Path | None = option(None, "--data")
    """A twin dataset (generate --twins); default data/<task>-twins.parquet, generated if absent."""
    out: Path = option(Path("results/interventions"), "--out", "-o")
    """Output folder."""
    probes: Path | None = option(None, "--probes")
    """A fit's results folder whose saved probes give the steering directions (default: per fold)."""
    intervention: str | None = option(None, "--intervention", "-i")
    """Run only these kinds (comma-separated; default all): {interventions}, or one registered with probes.register_intervention."""
    seed: int = option(0, "--seed", min=0)
    """Fold, bootstrap and random-direction seed."""
    random_init: bool = option(False, "--random-init")
    """A control: the battery on a random-init model of --model's config."""
    depths: str | None = option(None, "--depths")
    """Where the erasers and steering act: 'all', or depths of the colon (0 = the embeddings), comma-separated. Default: 5 evenly spaced, first and last included (every depth of a model with up to 4 layers)."""
    batch_size: int = option(128, "--batch-size", min=1)
    """Examples per batch."""

    @cached_property
    def prefills(self) -> tuple:
        """``--prefill`` read once: each prefill (``fbt_probe.prefill.Prefill``)."""
        from fbt_probe.prefill import parse_prefills

        return tuple(parse_prefills(self.prefill))

    @cached_property
    def interventions(self) -> tuple[str, ...]:
        """``--intervention`` read once: the interventions run (default every one)."""
        from probes.intervene.registry import parse_interventions

        return tuple(parse_interventions(self.intervention))

    @cached_property
    def saved_probes(self) -> list | None:
        """The probes ``--probes`` names, read once (a missing or unreadable folder fails)."""
        from probes.common.artifacts import load_probes

        return None if self.probes is None else load_probes(self.probes)

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        from probes.intervene.registry import REGISTRY
        from tasks import get_task

        _, names = self.prefills, self.interventions
        for t in self.tasks_and_data[0]:
            if not hasattr(get_task(t), "twin"):
                raise ValueError(f"task {t} defines no twins, so it cannot be intervened on")
        if self.random_init and self.probes is not None:
            raise ValueError(
                "--random-init: saved probes belong to the trained model; drop --probes"
            )
        if self.probes is not None:
            if not any(REGISTRY[k].directions for k in names):
                raise ValueError(
                    f"--probes: none of the interventions ({', '.join(names)}) reads a "
                    "probe direction (erase_probe, steer_probe do)"
                )
            _ = self.saved_probes

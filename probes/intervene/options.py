"""The options of ``fbt-probe intervene``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
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

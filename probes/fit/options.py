"""The options of ``fbt-probe fit``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.options import PREFILLS_HELP, Common, option


@dataclass(frozen=True)
class FitOptions(Common):
    prefill: str = option("all", "--prefill", "-p")
    PREFILLS_HELP  # noqa: B018 (the docstring: the help fit and intervene share)
    out: Path = option(Path("results"), "--out", "-o")
    """Results folder."""
    seed: int = option(0, "--seed", min=0)
    """Fold, bootstrap and control seed."""
    folds: int = option(5, "--folds")
    """Grouped CV folds."""
    no_controls: bool = option(False, "--no-controls")
    """Skip the random-init and permuted-label controls."""
    probe: str = option("logistic", "--probe")
    """logistic (linear, the default), mlp (one hidden layer), or one registered with probes.register_probe."""
    site: list[str] = option(["resid"], "--site")
    """Where features come from (repeatable): resid (every depth, the default) or a hook name such as fusion.hook_state, optionally @colon-K."""

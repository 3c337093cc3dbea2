"""The options of ``fbt-probe fit``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
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

    @cached_property
    def prefills(self) -> tuple:
        """``--prefill`` read once: each prefill (``fbt_probe.prefill.Prefill``)."""
        from fbt_probe.prefill import parse_prefills

        return tuple(parse_prefills(self.prefill))

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites read (``--site``, repeated; default the residual at every depth)."""
        return tuple(self.site or ("resid",))

    @property
    def controls(self) -> bool:
        return not self.no_controls

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work."""
        from probes.common.probe import probe_class

        _, _ = self.prefills, self.tasks_and_data
        if self.folds < 2:
            raise ValueError("--folds must be at least 2")
        probe_class(self.probe)

"""The options of ``fbt-probe lens``: each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.common.options import JACOBI_WORDS, Common, JacobiPasses, option


@dataclass(frozen=True)
class LensOptions(JacobiPasses, Common):
    PASSES = (1, 16)

    prefill: str = option("k3", "--prefill", "-p")
    "The Jacobi passes read, every one up to the last: " + JACOBI_WORDS + "; 1..16 passes."
    position: str = option("answer", "--position")
    """Where each prompt is read: answer (whose next token is the answer), colon, colon-K, or a declared one."""
    out: Path = option(Path("results/lens"), "--out", "-o")
    """Output folder."""
    tuned: bool = option(True, "--tuned/--no-tuned")
    """Also fit a tuned lens on half the groups (saved in OUT/tuned_lens)."""
    tuned_lens: Path | None = option(None, "--tuned-lens")
    """Read through this saved tuned lens instead."""
    seed: int = option(0, "--seed", min=0)
    """Which groups fit the tuned lens; bootstrap seed."""
    batch_size: int = option(64, "--batch-size", min=1)
    """Examples per batch."""

    def validate(self) -> None:
        """Every option that can be wrong without the model, before any work: ``--position``
        is 'answer', 'colon', 'colon-K' or a position each task declares."""
        from probes.common.extract import parse_site
        from tasks import get_task

        _ = self.passes  # parsed now: a bad --prefill fails before any work
        if self.tuned_lens is not None and not self.tuned:
            raise ValueError(
                "--tuned-lens reads a saved tuned lens, --no-tuned reads none: give one"
            )
        tasks, position = self.tasks_and_data[0], self.position
        if position == "answer":
            return
        if not position.strip():
            raise ValueError("--position '': give answer, colon, colon-K or a declared position")
        where = parse_site(f"resid@{position}")[1]
        for t in tasks if isinstance(where, str) else ():
            declared = sorted(getattr(get_task(t), "POSITIONS", {}))
            if where not in declared:
                raise ValueError(
                    f"--position {position!r}: task {t} declares no such position "
                    f"(it declares {', '.join(declared) or 'none'})"
                )

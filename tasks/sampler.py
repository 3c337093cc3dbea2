"""The training stream: endless, seeded examples from a mixture of tasks.

Draws come from the ``STREAM_TRAIN`` seed stream, never the probe stream, so training
data and probe datasets are disjoint by construction (a test checks it by content hash).
Distractor counts follow a curriculum: ``n ~ U[0, n_max(step)]`` with ``n_max`` ramped
linearly from ``start`` to ``end`` over the first ``ramp_frac`` of training. Optionally the
multi_register overwrites ramp up too (``Curriculum.overwrite_ramp``), the first
``mixture_first_frac`` of training draws from ``mixture_first`` alone, the task weights then
move from ``mixture_start`` to ``mixture`` over the next ``mixture_ramp_frac``, and from
``mixture`` to ``mixture_late`` between the two fractions of ``mixture_late_ramp``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from tasks import get_task
from tasks.base import MAX_DISTRACTORS, STREAM_TRAIN, Example, rng_for


def ramp(progress: float, frac: float) -> float:
    """0 -> 1 linearly over the first ``frac`` of training, 1 after it (and when frac is 0)."""
    return 1.0 if frac == 0 else min(1.0, progress / frac)


def _check_frac(name: str, x: float) -> None:
    """A fraction of training (or a share): 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def _check_span(name: str, span) -> tuple[float, float]:
    """``[start, end]`` as fractions of training, 0 <= start <= end <= 1."""
    span = tuple(span)
    if len(span) != 2 or not 0.0 <= span[0] <= span[1] <= 1.0:
        raise ValueError(f"{name} needs [start, end] with 0 <= start <= end <= 1, got {list(span)}")
    return span


@dataclass(frozen=True)
class Curriculum:
    start: int = 8
    end: int = MAX_DISTRACTORS
    ramp_frac: float = 0.3
    # "uniform": n ~ U[0, n_max]; "mixed": half of the batches uniform, half log-uniform
    # (more short sequences, so more steps per second, while long ones still appear)
    dist: str = "uniform"
    # under "mixed", the share of batches whose count is drawn log-uniformly
    log_share: float = 0.5
    # (start, end) as fractions of training: multi_register draws no overwrites before
    # ``start`` and reaches its full ``max_overwrites`` at ``end``; (0, 0) = off
    overwrite_ramp: tuple[float, float] = (0.0, 0.0)
    # n_max stays at ``start`` for this first fraction of training; the ramp begins after it
    hold_frac: float = 0.0

    def __post_init__(self):
        _check_span("overwrite_ramp", self.overwrite_ramp)
        if self.dist not in ("uniform", "mixed"):
            raise ValueError(f"curriculum dist must be uniform or mixed, got {self.dist!r}")
        if not 0 <= self.start <= self.end <= MAX_DISTRACTORS:
            raise ValueError(f"curriculum needs 0 <= start <= end <= {MAX_DISTRACTORS}")
        _check_frac("curriculum ramp_frac", self.ramp_frac)
        _check_frac("curriculum log_share", self.log_share)
        _check_frac("curriculum hold_frac", self.hold_frac)

    def n_max(self, progress: float) -> int:
        """Largest distractor count at training progress in [0, 1]."""
        r = ramp(max(0.0, progress - self.hold_frac), self.ramp_frac)
        return int(round(self.start + r * (self.end - self.start)))

    def max_overwrites(self, progress: float, full: int) -> int:
        """The multi_register overwrite cap at training progress in [0, 1]."""
        a, b = self.overwrite_ramp
        if b == 0.0 or progress >= b:
            return full
        if progress < a:
            return 0
        return min(full, int(full * (progress - a) / (b - a)) + 1)


def _normalised(weights: dict[str, float], names: list[str], what: str) -> np.ndarray:
    if not weights or any(w < 0 for w in weights.values()):
        raise ValueError(f"{what} needs at least one task and non-negative weights")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"{what} weights sum to zero")
    return np.array([weights.get(n, 0.0) / total for n in names])


@dataclass
class TrainingStream:
    """``for ex in stream.examples(progress_fn)``: endless examples, reproducible by seed."""

    mixture: dict[str, float]
    seed: int = 0
    curriculum: Curriculum = field(default_factory=Curriculum)
    params: dict[str, dict] = field(default_factory=dict)
    width: int = 16  # spread of distractor counts within one batch
    # task weights at the start of training (after the first phase, if any), moving linearly
    # to ``mixture`` over the next ``mixture_ramp_frac``; None = ``mixture`` throughout
    mixture_start: dict[str, float] | None = None
    mixture_ramp_frac: float = 0.0
    # ``mixture_start`` holds this long (after the first phase) before its ramp begins
    mixture_hold_frac: float = 0.0
    # a first phase: the first ``mixture_first_frac`` of training draws from ``mixture_first``
    # alone (no ramp into it or out of it); None = no first phase
    mixture_first: dict[str, float] | None = None
    mixture_first_frac: float = 0.0
    # task weights late in training: from ``mixture`` at progress ``mixture_late_ramp[0]``
    # linearly to ``mixture_late`` at ``mixture_late_ramp[1]``; None = ``mixture`` to the end
    mixture_late: dict[str, float] | None = None
    mixture_late_ramp: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self):
        self._names = list(self.mixture)
        self._probs = _normalised(self.mixture, self._names, "mixture")
        self._start = self._other("mixture_start", self.mixture_start)
        self._late = self._other("mixture_late", self.mixture_late)
        self._first = self._other("mixture_first", self.mixture_first)
        _check_frac("mixture_ramp_frac", self.mixture_ramp_frac)
        _check_frac("mixture_first_frac", self.mixture_first_frac)
        _check_frac("mixture_hold_frac", self.mixture_hold_frac)
        if self.mixture_hold_frac and self._start is None:
            raise ValueError("mixture_hold_frac > 0 needs mixture_start")
        if (self._first is None) != (self.mixture_first_frac == 0.0):
            raise ValueError("mixture_first and mixture_first_frac > 0 go together")
        # where the mixture is reached: after the first phase and the start ramp
        reached = self.mixture_first_frac + (
            self.mixture_hold_frac + self.mixture_ramp_frac if self._start is not None else 0.0
        )
        a = _check_span("mixture_late_ramp", self.mixture_late_ramp)[0]
        if self._late is not None and a < reached:
            raise ValueError(
                f"mixture_late_ramp starts at {a}, before the first phase and the start ramp "
                f"have reached the mixture ({reached:g})"
            )
        self._mods = [get_task(n) for n in self._names]
        self._params = [
            m.Params(**self.params.get(n, {})) for n, m in zip(self._names, self._mods, strict=True)
        ]

    def _other(self, what: str, weights: dict[str, float] | None) -> np.ndarray | None:
        """``mixture_start``, ``mixture_late`` or ``mixture_first`` as shares over the
        mixture's tasks."""
        if weights is None:
            return None
        extra = set(weights) - set(self.mixture)
        if extra:
            raise ValueError(f"{what} names tasks not in the mixture: {', '.join(sorted(extra))}")
        return _normalised(weights, self._names, what)

    def probs_at(self, progress: float) -> np.ndarray:
        """Each task's share of the examples at training progress in [0, 1]."""
        if self._first is not None and progress < self.mixture_first_frac:
            return self._first
        if self._late is not None:
            a, b = self.mixture_late_ramp
            if progress >= a:
                f = ramp(progress - a, b - a)
                return (1.0 - f) * self._probs + f * self._late
        if self._start is None:
            return self._probs
        since = progress - self.mixture_first_frac - self.mixture_hold_frac
        if since < 0:
            return self._start
        f = ramp(since, self.mixture_ramp_frac)
        return (1.0 - f) * self._start + f * self._probs

    def _params_at(self, progress: float) -> list:
        """Each task's parameters at ``progress`` (the overwrite curriculum, if any)."""
        if self.curriculum.overwrite_ramp[1] == 0.0:
            return self._params
        return [
            replace(p, max_overwrites=self.curriculum.max_overwrites(progress, p.max_overwrites))
            if name == "multi_register"
            else p
            for name, p in zip(self._names, self._params, strict=True)
        ]

    def batch(
        self, index: int, size: int, progress: float, n_min: int | None = None
    ) -> list[Example]:
        """Batch number ``index``: a pure function of (seed, index, size, progress, n_min).

        ``n_min`` (optional) draws the batch's count uniformly from [min(n_min, n_max), n_max]
        instead of the curriculum's distribution: long examples for the deep-pass batches.
        """
        rng = rng_for(self.seed, "mixture", STREAM_TRAIN, index)
        n_max = self.curriculum.n_max(progress)
        params = self._params_at(progress)
        probs = self.probs_at(progress)
        out = []
        # One distractor count per batch (each example within +-width/2 of it): batches of
        # similar lengths waste little on padding, and over steps n still covers [0, n_max].
        if n_min is not None:
            center = int(rng.integers(min(n_min, n_max), n_max + 1))
        elif self.curriculum.dist == "mixed" and rng.random() < self.curriculum.log_share:
            center = int(np.exp(rng.uniform(0.0, np.log(n_max + 1)))) - 1
        else:
            center = int(rng.integers(0, n_max + 1))
        lo = max(0, center - self.width // 2)
        hi = min(n_max, lo + self.width)
        for _ in range(size):
            i = int(rng.choice(len(self._names), p=probs))
            n = int(rng.integers(lo, hi + 1))
            out.append(self._mods[i].sample(rng, n, params[i]))
        return out

    def examples(self, progress: float = 1.0) -> Iterator[Example]:
        i = 0
        while True:
            yield from self.batch(i, 64, progress)
            i += 1

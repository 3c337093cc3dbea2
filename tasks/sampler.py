"""The training stream: endless, seeded examples from a mixture of tasks.

Draws come from the ``STREAM_TRAIN`` seed stream, never the probe stream, so training
data and probe datasets are disjoint by construction (a test checks it by content hash).
What changes over training (the task shares, the largest distractor count, the overwrite
cap) is given to each ``batch`` call by the trainer's schedule; the stream itself only
knows how a count is drawn below that maximum.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from tasks import get_task
from tasks.base import MAX_DISTRACTORS, STREAM_TRAIN, Example, rng_for

# "uniform": n ~ U[0, n_max]; "mixed": a ``log_share`` of the batches log-uniform instead
# (more short sequences, so more steps per second, while long ones still appear)
COUNT_DISTS = ("uniform", "mixed")


@dataclass
class TrainingStream:
    """``stream.batch(i, size, shares, n_max)``: batch ``i``, reproducible by seed."""

    tasks: list[str]  # the order tasks are drawn in; ``shares`` follow it
    seed: int = 0
    params: dict[str, dict] = field(default_factory=dict)
    dist: str = "uniform"
    log_share: float = 0.5  # under "mixed": the share of log-uniform batches
    width: int = 16  # spread of distractor counts within one batch

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("a training stream needs at least one task")
        if self.dist not in COUNT_DISTS:
            raise ValueError(f"count distribution must be one of {COUNT_DISTS}, got {self.dist!r}")
        if not 0.0 <= self.log_share <= 1.0:
            raise ValueError(f"log_share must be in [0, 1], got {self.log_share}")
        extra = set(self.params) - set(self.tasks)
        if extra:
            raise ValueError(f"task_params names tasks not trained on: {', '.join(sorted(extra))}")
        self._mods = [get_task(n) for n in self.tasks]
        self._params = []
        for n, m in zip(self.tasks, self._mods, strict=True):
            try:
                self._params.append(m.Params(**self.params.get(n, {})))
            except TypeError as e:
                raise ValueError(f"task_params.{n}: {e}") from None

    def _params_at(self, overwrites: int | None) -> list:
        """Each task's parameters under the overwrite cap (None = none); the cap applies to
        every task with a ``max_overwrites`` parameter (multi_register)."""
        if overwrites is None:
            return self._params
        return [
            replace(p, max_overwrites=min(p.max_overwrites, overwrites))
            if hasattr(p, "max_overwrites")
            else p
            for p in self._params
        ]

    def batch(
        self,
        index: int,
        size: int,
        shares,
        n_max: int,
        overwrites: int | None = None,
        n_min: int | None = None,
    ) -> list[Example]:
        """Batch number ``index``: a pure function of (seed, index, size, and the rest).

        ``shares`` are the tasks' probabilities (in ``tasks`` order), ``n_max`` the largest
        count, ``overwrites`` multi_register's overwrite cap. ``n_min`` (optional) draws the
        batch's count uniformly from [min(n_min, n_max), n_max] instead of the count
        distribution: long examples for the deep-pass and fixed-point batches.
        """
        if not 0 <= n_max <= MAX_DISTRACTORS:
            raise ValueError(f"n_max must be in 0..{MAX_DISTRACTORS}, got {n_max}")
        rng = rng_for(self.seed, "mixture", STREAM_TRAIN, index)
        params = self._params_at(overwrites)
        probs = np.asarray(shares, dtype=float)
        out = []
        # One distractor count per batch (each example within +-width/2 of it): batches of
        # similar lengths waste little on padding, and over steps n still covers [0, n_max].
        if n_min is not None:
            center = int(rng.integers(min(n_min, n_max), n_max + 1))
        elif self.dist == "mixed" and rng.random() < self.log_share:
            center = int(np.exp(rng.uniform(0.0, np.log(n_max + 1)))) - 1
        else:
            center = int(rng.integers(0, n_max + 1))
        lo = max(0, center - self.width // 2)
        hi = min(n_max, lo + self.width)
        # rng.choice(len(tasks), p=probs) spelled out as numpy computes it (the cdf, one
        # uniform draw, searchsorted): the same draws, without choice's per-call checks,
        # which cost more than the rest of the sampling.
        if (probs < 0).any() or abs(probs.sum() - 1.0) > 1.5e-8:
            raise ValueError(f"task shares must be probabilities that sum to 1, got {shares}")
        cdf = probs.cumsum()
        cdf /= cdf[-1]
        for _ in range(size):
            i = int(cdf.searchsorted(rng.random(), side="right"))
            n = int(rng.integers(lo, hi + 1))
            out.append(self._mods[i].sample(rng, n, params[i]))
        return out

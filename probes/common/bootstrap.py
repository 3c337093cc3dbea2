"""The one bootstrap over groups: every interval fbt-probe reports (the probes', the
interventions', the lens', trajectory's and heads') resamples whole base instances, never single
examples, so that renderings of one instance never count as independent."""

from __future__ import annotations

import numpy as np

N_BOOT = 1000


class GroupBootstrap:
    """Resampling whole groups with replacement: ``n_boot`` draws of as many groups as there
    are, the same draws for every quantity measured on the same examples (fit's intervals
    and the interventions' are both taken from here)."""

    def __init__(self, groups: np.ndarray, seed: int, n_boot: int = N_BOOT):
        ug, self.inv = np.unique(groups, return_inverse=True)
        self.n_groups = len(ug)
        self.draw = np.random.default_rng(seed).integers(0, self.n_groups, size=(n_boot, len(ug)))

    def per_group(self, values: np.ndarray) -> np.ndarray:
        """(n_groups,) the sum of ``values`` (one per example) in each group."""
        return np.bincount(self.inv, weights=values.astype(float), minlength=self.n_groups)

    def sums(self, values: np.ndarray) -> np.ndarray:
        """(n_boot,) the sum of ``values`` over each draw's groups."""
        return self.per_group(values)[self.draw].sum(1)

    def mean(self, values: np.ndarray) -> np.ndarray:
        """(n_boot,) the mean of ``values`` over each draw's examples."""
        return self.sums(values) / self.sums(np.ones(len(self.inv)))

    def mean_columns(self, values: np.ndarray) -> np.ndarray:
        """(n_boot, m): ``mean`` of each column of ``values`` (n, m), in one matmul (many
        quantities measured on the same examples, such as every head of a model)."""
        times = np.zeros((len(self.draw), self.n_groups))
        np.add.at(times, (np.arange(len(self.draw))[:, None], self.draw), 1.0)
        per_group = np.zeros((self.n_groups, values.shape[1]))
        np.add.at(per_group, self.inv, values.astype(float))
        sizes = times @ np.bincount(self.inv, minlength=self.n_groups)
        return (times @ per_group) / sizes[:, None]


def bootstrap_ci(
    correct: np.ndarray, groups: np.ndarray, seed: int, n_boot: int = N_BOOT
) -> tuple[float, float]:
    """95 % percentile interval of accuracy, resampling whole groups with replacement."""
    lo, hi = np.percentile(GroupBootstrap(groups, seed, n_boot).mean(correct), [2.5, 97.5])
    return float(lo), float(hi)

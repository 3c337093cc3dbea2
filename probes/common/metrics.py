"""What the interventions measure: each (key) patched run's answer logits recorded per pair, and
the metrics (accuracy, flip rate, normalised logit difference) with bootstrap intervals over
groups (``interventions.csv``; ``patch.csv`` shares them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from probes.common.bootstrap import N_BOOT, GroupBootstrap
from probes.common.twins import Pairs

METRICS = ("accuracy", "flip_rate", "logit_diff")

# the columns an interventions.csv must have, read back by the report and plot
IV_COLUMNS = ("task", "prefill", "intervention", "metric")


COLUMNS = [
    "task",
    "prefill",
    "intervention",
    "site",
    "positions",
    "alpha",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "n",
]


@dataclass(frozen=True)
class Key:
    """A row of the table: the intervention, where it acts and the steering alpha."""

    intervention: str
    site: str
    positions: str
    alpha: float = float("nan")


CLEAN, TWIN = Key("clean", "", ""), Key("twin", "", "")


@dataclass
class Record:
    """Per intervention, per example: correct, flipped, logit difference."""

    n: int
    hits: dict = field(default_factory=dict)

    def _row(self, key: Key):
        if key not in self.hits:
            self.hits[key] = (np.zeros(self.n, bool), np.zeros(self.n, bool), np.zeros(self.n))
        return self.hits[key]

    def put(self, key: Key, idx: np.ndarray, logits: torch.Tensor, pairs: Pairs) -> None:
        c, f, ld = self._row(key)
        lg = logits.double().cpu().numpy()
        arg = lg.argmax(1)
        ci, ti = pairs.clean_id[idx], pairs.twin_id[idx]
        rows = np.arange(len(idx))
        c[idx], f[idx], ld[idx] = arg == ci, arg == ti, lg[rows, ci] - lg[rows, ti]

    def copy(self, source: Key, key: Key, idx: np.ndarray) -> None:
        """``key``'s outcome for the examples ``idx`` is ``source``'s (the same run)."""
        for into, src in zip(self._row(key), self.hits[source], strict=True):
            into[idx] = src[idx]


# ---- metrics --------------------------------------------------------------------------
def summarise(
    rec: Record, pairs: Pairs, task: str, prefill: str, seed: int, n_boot: int = N_BOOT
) -> pd.DataFrame:
    """One row per (intervention, metric) with its bootstrap interval over groups."""
    boot = GroupBootstrap(pairs.groups, seed, n_boot)
    (_, _, ld_clean), (_, _, ld_twin) = rec.hits[CLEAN], rec.hits[TWIN]
    clean_sums, twin_sums = boot.sums(ld_clean), boot.sums(ld_twin)
    rows = []
    for key, (c, f, ld) in rec.hits.items():
        if key in (CLEAN, TWIN):
            continue
        for metric, full, draws in (
            ("accuracy", c.mean(), boot.mean(c)),
            ("flip_rate", f.mean(), boot.mean(f)),
            (
                "logit_diff",
                _norm(ld.sum(), ld_clean.sum(), ld_twin.sum()),
                _norm(boot.sums(ld), clean_sums, twin_sums),
            ),
        ):
            lo, hi = (
                np.nanpercentile(draws, [2.5, 97.5]) if np.isfinite(draws).any() else (np.nan,) * 2
            )
            rows.append(
                {
                    "task": task,
                    "prefill": prefill,
                    "intervention": key.intervention,
                    "site": key.site,
                    "positions": key.positions,
                    "alpha": key.alpha,
                    "metric": metric,
                    "value": float(full),
                    "ci_low": float(lo),
                    "ci_high": float(hi),
                    "n": len(pairs),
                }
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def _norm(ld, clean, twin):
    """(ld - twin) / (clean - twin): 1 = the clean run, 0 = the twin run."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.asarray(ld) - twin) / (np.asarray(clean) - twin)


def reference(rec: Record, pairs: Pairs) -> dict:
    """Answer accuracy of the clean and the twin runs (the twin scored on its own label)."""
    c, _, _ = rec.hits[CLEAN]
    _, tw, _ = rec.hits[TWIN]
    return {"clean_accuracy": float(c.mean()), "twin_accuracy": float(tw.mean())}

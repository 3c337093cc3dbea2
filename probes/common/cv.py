"""Group-cross-validated linear probes: leakage-safe by construction, with honest baselines.

Every fit happens inside group-aware folds (``StratifiedGroupKFold``; the group is the base
instance, so all renderings of an instance sit on the same side of every split). The
regularisation ``C`` is picked per outer fold by an inner grouped CV on that fold's
training part only (nested). Reported per cell: the mean accuracy over folds, a 95 %
interval from a bootstrap over groups, the chance level of a constant-feature probe
under the same folds (it predicts the training fold's majority class) and the majority rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold, StratifiedGroupKFold
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from probes.common.bootstrap import bootstrap_ci
from probes.common.probe import LogisticProbe, probe_class

CS = LogisticProbe.grid
N_FOLDS = 5
INNER_FOLDS = 2


def make_probe(C: float) -> Pipeline:
    """The default probe as one sklearn pipeline: standardise, then (multinomial) logistic
    regression; ``probes.common.probe.LogisticProbe`` fits exactly this (tests compare the two)."""
    return make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=200, tol=1e-3))


def grouped_splits(
    y: np.ndarray, groups: np.ndarray, n_folds: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Outer folds: stratified by label where possible, never splitting a group."""
    n_groups = len(np.unique(groups))
    if n_groups < n_folds:
        raise ValueError(f"{n_groups} groups cannot fill {n_folds} grouped folds")
    splitter = StratifiedGroupKFold(n_splits=n_folds, shuffle=True, random_state=seed)
    try:
        return list(splitter.split(np.zeros(len(y)), y, groups))
    except ValueError:  # a class with fewer groups than folds: plain grouped folds
        return list(GroupKFold(n_splits=n_folds).split(np.zeros(len(y)), y, groups))


def choose_C(X, y, groups, Cs=CS, inner_folds=INNER_FOLDS, probe: str = "logistic") -> float:
    """Pick the probe's regularisation (C for logistic) by grouped CV on (X, y) alone; ties
    go to the first value of the grid (the strongest regularisation for logistic)."""
    make = probe_class(probe)
    if len(Cs) == 1 or len(np.unique(groups)) < inner_folds or len(np.unique(y)) < 2:
        return Cs[-1]
    inner = list(GroupKFold(n_splits=inner_folds).split(X, y, groups))
    scores = []
    for C in Cs:
        acc = []
        for tr, te in inner:
            if len(np.unique(y[tr])) < 2:
                acc.append(np.mean(y[te] == _majority(y[tr])))
                continue
            acc.append(np.mean(make(C).fit(X[tr], y[tr]).predict(X[te]) == y[te]))
        scores.append(np.mean(acc))
    return Cs[int(np.argmax(np.round(scores, 6)))]


def _majority(y: np.ndarray):
    vals, counts = np.unique(y, return_counts=True)
    return vals[np.argmax(counts)]


@dataclass
class CVResult:
    accuracy: float  # mean over folds
    fold_accuracies: list[float]
    correct: np.ndarray  # (n,) out-of-fold correctness
    chance: float  # constant-feature probe under the same folds
    majority: float
    Cs: list[float]  # chosen per fold


def cross_validate(
    X: np.ndarray,
    y: np.ndarray,
    splits: list[tuple[np.ndarray, np.ndarray]],
    groups: np.ndarray | None = None,
    C: float | None = None,
    Cs=None,
    probe: str = "logistic",
) -> CVResult:
    """Accuracy of ``probe`` (a registered probe type) over ``splits``; its regularisation
    ``C`` fixed, or chosen per fold from ``Cs`` (default: the probe's grid) by nested CV."""
    make = probe_class(probe)
    Cs = make.grid if Cs is None else Cs
    correct = np.zeros(len(y), dtype=bool)
    folds, chance, chosen = [], [], []
    for tr, te in splits:
        maj = _majority(y[tr])
        chance.append(float(np.mean(y[te] == maj)))
        if len(np.unique(y[tr])) < 2:  # one class only: the probe can only predict it
            pred = np.full(len(te), maj)
            c = float("nan")
        else:
            c = C if C is not None else choose_C(X[tr], y[tr], groups[tr], Cs, probe=probe)
            pred = make(c).fit(X[tr], y[tr]).predict(X[te])
        correct[te] = pred == y[te]
        folds.append(float(np.mean(pred == y[te])))
        chosen.append(c)
    _, counts = np.unique(y, return_counts=True)
    return CVResult(
        float(np.mean(folds)),
        folds,
        correct,
        float(np.mean(chance)),
        float(counts.max() / len(y)),
        chosen,
    )


def permute_by_group(y: np.ndarray, groups: np.ndarray, seed: int) -> np.ndarray:
    """Shuffle which group carries which label (labels stay constant within a group)."""
    ug, first = np.unique(groups, return_index=True)
    labels = y[first]
    perm = np.random.default_rng(seed).permutation(len(ug))
    mapping = dict(zip(ug.tolist(), labels[perm].tolist(), strict=True))
    return np.array([mapping[g] for g in groups.tolist()], dtype=y.dtype)


def fit_cell(X, y, groups, seed, folds, C=None, probe="logistic") -> dict:
    """One probe cell: nested CV (C None) or fixed C; returns the row's numbers. It lives
    here, beside what it calls, because ``fit`` runs it in worker processes: unpickling it
    imports this module (numpy and scikit-learn), not the model code (torch)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    # Probes on features that carry no signal (random init, permuted labels) often stop at
    # max_iter; the warning would drown the output and says nothing about the result.
    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    splits = grouped_splits(y, groups, folds, seed)
    res = cross_validate(X, y, splits, groups=groups, C=C, probe=probe)
    lo, hi = bootstrap_ci(res.correct, groups, seed)
    cs = [c for c in res.Cs if c == c]
    return {
        "accuracy": res.accuracy,
        "ci_low": lo,
        "ci_high": hi,
        "chance": res.chance,
        "majority": res.majority,
        "n_examples": int(len(y)),
        "n_groups": int(len(np.unique(groups))),
        "C": float(np.median(cs)) if cs else float("nan"),
    }

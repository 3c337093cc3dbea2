"""Probe types, registered by name: what ``fbt-probe fit --probe NAME`` fits in every cell.

A probe type is a class with ``name``, a grid of hyperparameters (``grid``: the values its
one regularisation knob may take, picked by nested grouped CV) and

- ``fit(X, y)`` -> self, ``predict(X)`` -> labels;
- ``direction()`` -> (n_directions, d) in the input space, or None when it is not linear;
- ``state()`` -> dict of arrays and ``config()`` -> dict, and ``from_saved(config, state)``:
  what a saved probe is made of (``probes.common.artifacts``).

Register one with ``@register_probe``; nothing else needs editing::

    @register_probe
    class Centroid:
        name, grid = "centroid", (0.0,)
        ...
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.preprocessing import StandardScaler

from fbt_probe.util.registry import Registry

PROBES: Registry = Registry("probe", identifiers=False)


def register_probe(cls: type | None = None, *, replace: bool = False):
    """Add a probe class to the registry under ``cls.name`` (a decorator, with or without
    ``replace=True``); a name already registered is refused unless ``replace``."""
    if cls is None:
        return lambda c: register_probe(c, replace=replace)
    if not getattr(cls, "name", None) or not getattr(cls, "grid", None):
        raise ValueError(f"probe class {cls.__name__} needs a name and a non-empty grid")
    return PROBES.add(cls.name, cls, replace=replace)


def probe_class(name: str) -> type:
    return PROBES.lookup(name)


def _scaler_state(s: StandardScaler) -> dict:
    return {"mean": s.mean_.astype(np.float64), "scale": s.scale_.astype(np.float64)}


def _scaler_from(state: dict) -> StandardScaler:
    s = StandardScaler()
    s.mean_, s.scale_ = state["mean"], state["scale"]
    s.var_ = s.scale_**2
    s.n_features_in_ = len(s.mean_)
    return s


@register_probe
class LogisticProbe:
    """Standardise, then (multinomial) logistic regression; ``reg`` is its C. The default:
    a linear probe, so what it finds is a direction in the residual stream."""

    name = "logistic"
    grid = (0.01, 0.1, 1.0)

    def __init__(self, reg: float = 1.0):
        self.reg = float(reg)

    def fit(self, X, y):
        self.scaler = StandardScaler().fit(X)
        self.clf = LogisticRegression(C=self.reg, max_iter=200, tol=1e-3)
        self.clf.fit(self.scaler.transform(X), y)
        return self

    def predict(self, X):
        return self.clf.predict(self.scaler.transform(X))

    def direction(self) -> np.ndarray:
        """(n_directions, d): the weight vectors in the unstandardised feature space."""
        return self.clf.coef_ / self.scaler.scale_[None, :]

    def config(self) -> dict:
        return {"probe": self.name, "reg": self.reg, "classes": self.clf.classes_.tolist()}

    def state(self) -> dict:
        return {
            **_scaler_state(self.scaler),
            "coef": self.clf.coef_.astype(np.float64),
            "intercept": self.clf.intercept_.astype(np.float64),
        }

    @classmethod
    def from_saved(cls, config: dict, state: dict) -> LogisticProbe:
        p = cls(config["reg"])
        p.scaler = _scaler_from(state)
        clf = LogisticRegression(C=p.reg)
        clf.coef_, clf.intercept_ = state["coef"], state["intercept"]
        clf.classes_ = np.array(config["classes"])
        clf.n_features_in_ = clf.coef_.shape[1]
        p.clf = clf
        return p


@register_probe
class MLPProbe:
    """Standardise, then a one-hidden-layer MLP (64 ReLU units, Adam); ``reg`` is its L2
    penalty. A nonlinear upper bound on what a linear probe misses; it has no direction."""

    name = "mlp"
    grid = (1e-3, 1e-1)
    hidden = 64

    def __init__(self, reg: float = 1e-3, seed: int = 0):
        self.reg, self.seed = float(reg), seed

    def fit(self, X, y):
        self.scaler = StandardScaler().fit(X)
        self.clf = MLPClassifier(
            hidden_layer_sizes=(self.hidden,),
            alpha=self.reg,
            max_iter=300,
            early_stopping=False,
            random_state=self.seed,
        )
        self.clf.fit(self.scaler.transform(X), y)
        return self

    def predict(self, X):
        return self.clf.predict(self.scaler.transform(X))

    def direction(self) -> None:
        return None

    def config(self) -> dict:
        return {
            "probe": self.name,
            "reg": self.reg,
            "seed": self.seed,
            "classes": self.clf.classes_.tolist(),
        }

    def state(self) -> dict:
        out = _scaler_state(self.scaler)
        for i, (w, b) in enumerate(zip(self.clf.coefs_, self.clf.intercepts_, strict=True)):
            out[f"W{i}"], out[f"b{i}"] = w.astype(np.float64), b.astype(np.float64)
        return out

    @classmethod
    def from_saved(cls, config: dict, state: dict) -> MLPProbe:
        p = cls(config["reg"], config.get("seed", 0))
        p.scaler = _scaler_from(state)
        p.classes = np.array(config["classes"])
        p.layers = [(state[f"W{i}"], state[f"b{i}"]) for i in range(2)]
        p.predict = p._predict_saved  # no sklearn object: the two layers, written out
        return p

    def _predict_saved(self, X):
        h = np.maximum(self.scaler.transform(X) @ self.layers[0][0] + self.layers[0][1], 0.0)
        z = h @ self.layers[1][0] + self.layers[1][1]
        idx = (z[:, 0] > 0).astype(int) if z.shape[1] == 1 else z.argmax(1)
        return self.classes[idx]

"""Fitted probes as artifacts: saved beside the results, loaded back to predict or to steer.

``fbt-probe fit`` refits the probe of every trained pooled cell on all of that cell's data
(with the regularisation the cross-validation chose) and writes ``<out>/probes/``:

- ``probes.safetensors``: each probe's arrays (scaler mean and scale, coefficients and
  intercepts, or an MLP's layers), keyed ``<index>.<name>``;
- ``probes.json``: per probe its cell (task, target, site, prefill, depth), probe type and
  hyperparameters, classes, and what it was fitted on: the model hash, the dataset hash,
  the fold seed.

``load_probes(folder)`` gives them back as ``SavedProbe`` objects with ``predict(X)`` and, for
linear probes, ``direction()`` (what steering and erasure need).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed
from safetensors.numpy import load_file, save_file
from sklearn.exceptions import ConvergenceWarning

from probes.fit.probe import probe_class
from tasks.safe_files import atomic_write

WEIGHTS, INDEX = "probes.safetensors", "probes.json"


@dataclass
class SavedProbe:
    """A fitted probe and the cell it belongs to."""

    meta: dict  # task, target, site, prefill, depth, probe, model_hash, dataset_hash, ...
    probe: object

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Labels for features X (n, d) taken at the probe's site, prefill and depth."""
        return self.probe.predict(np.asarray(X))

    def direction(self) -> np.ndarray | None:
        """(n_directions, d) in feature space for a linear probe; None otherwise."""
        return self.probe.direction()


def _fit(probe: str, reg: float, X, y):

    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    return probe_class(probe)(reg).fit(X, y)


def fit_and_save(folder, cells, data, probe: str, run_meta: dict, n_jobs: int = 2) -> Path:
    """Refit ``probe`` on each cell's (X, y) and write the folder (atomically per file)."""

    fitted = Parallel(n_jobs=n_jobs)(
        delayed(_fit)(probe, c.C, X, y) for c, (X, y) in zip(cells, data, strict=True)
    )
    tensors, index = {}, []
    for i, (cell, p, (_, y)) in enumerate(zip(cells, fitted, data, strict=True)):
        for k, v in p.state().items():
            tensors[f"{i}.{k}"] = np.ascontiguousarray(v)
        cell_meta = {k: v for k, v in asdict(cell).items() if k not in ("C", "model")}
        index.append({
            **cell_meta, **p.config(), "n_examples": int(len(y)),
            "model_hash": run_meta["model_hash"],
            "dataset_hash": run_meta["datasets"][cell.task]["content_hash"],
            "fold_seed": run_meta["fold_seed"], "fitted_on": "all examples of the cell (counts 1..256)",
        })  # fmt: skip
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    doc = {"model": run_meta["model"], "probes": index}
    atomic_write(folder / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    return folder


def load_probes(folder) -> list[SavedProbe]:
    """Every probe of a fit's ``probes/`` folder (or of the results folder above it)."""
    folder = Path(folder)
    if (folder / "probes" / INDEX).is_file():
        folder = folder / "probes"
    if not (folder / INDEX).is_file() or not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(f"no saved probes in {folder} (fbt-probe fit writes them)")
    try:
        doc = json.loads((folder / INDEX).read_text())
        arrays = load_file(str(folder / WEIGHTS))
    except (json.JSONDecodeError, OSError, ValueError) as e:
        raise ValueError(
            f"{folder}: saved probes cannot be read ({str(e).splitlines()[0]})"
        ) from None
    out = []
    for i, meta in enumerate(doc["probes"]):
        state = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{i}.")}
        out.append(SavedProbe(meta, probe_class(meta["probe"]).from_saved(meta, state)))
    return out


def find(probes: list[SavedProbe], **where) -> SavedProbe:
    """The one saved probe whose metadata matches ``where`` (e.g. task=, prefill=, depth=)."""
    hits = [p for p in probes if all(p.meta.get(k) == v for k, v in where.items())]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} saved probes match {where}")
    return hits[0]

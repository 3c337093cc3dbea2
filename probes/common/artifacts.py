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
from safetensors.numpy import save_file
from sklearn.exceptions import ConvergenceWarning

from fbt_probe.util.files import atomic_write, read_json, read_tensors
from probes.common.probe import probe_class

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
        index.append(
            {
                **cell_meta,
                **p.config(),
                "n_examples": int(len(y)),
                "model_hash": run_meta["model_hash"],
                "dataset_hash": run_meta["datasets"][cell.task]["content_hash"],
                "fold_seed": run_meta["fold_seed"],
                "fitted_on": "all examples of the cell (counts 1..256)",
            }
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    doc = {"model": run_meta["model"], "probes": index}
    atomic_write(folder / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    return folder


# what every entry of probes.json must hold, and of which type
FIELDS = {
    "task": str,
    "target": str,
    "prefill": str,
    "depth": int,
    "probe": str,
    "classes": list,
    "model_hash": str,
}


def load_probes(folder) -> list[SavedProbe]:
    """Every probe of a fit's ``probes/`` folder (or of the results folder above it), each
    checked as it loads: a malformed ``probes.json`` entry, arrays that are missing, not
    finite or of another shape than its probe needs are refused in one line naming the file."""
    folder = Path(folder)
    if (folder / "probes").is_dir():
        folder = folder / "probes"
    if not (folder / INDEX).exists() and not (folder / WEIGHTS).exists():
        raise FileNotFoundError(f"no saved probes in {folder} (fbt-probe fit writes them)")
    index = folder / INDEX
    doc = read_json(index, "fbt-probe fit's index of saved probes")
    arrays = read_tensors(folder / WEIGHTS, "file of saved probes' weights", numpy=True)
    entries = doc.get("probes")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{index} holds no list of probes")
    return [_saved(i, meta, arrays, folder) for i, meta in enumerate(entries)]


def _saved(i: int, meta, arrays: dict, folder: Path) -> SavedProbe:
    index, weights = folder / INDEX, folder / WEIGHTS
    if not isinstance(meta, dict):
        raise ValueError(f"{index}: probe {i} is not an object")
    for key, kind in FIELDS.items():
        v = meta.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ValueError(f"{index}: probe {i} has no valid {key!r} (got {v!r})")
    state = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{i}.")}
    if not state:
        raise ValueError(f"{weights} holds no arrays for probe {i} of {index}")
    bad = sorted(k for k, v in state.items() if not np.isfinite(v).all())
    if bad:
        raise ValueError(f"{weights}: probe {i}'s {bad[0]} holds NaN or infinite values")
    try:
        return SavedProbe(meta, probe_class(meta["probe"]).from_saved(meta, state))
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(
            f"{index}: probe {i} ({meta['probe']}) does not match its arrays in "
            f"{weights.name} ({e})"
        ) from None


def check_use(probes: list[SavedProbe], folder, model_hash: str, cells, depths, width: int) -> None:
    """Saved probes for a use that reads a linear direction of every (task, prefill) in
    ``cells`` at each of ``depths`` on the residual, for one model: anything else is refused
    in one line naming the file and what differs (another model, task, prefill, site, kind
    of probe or depths), so that nothing is refitted behind the user's back."""
    index = (
        Path(folder) / INDEX
        if (Path(folder) / INDEX).is_file()
        else Path(folder) / "probes" / INDEX
    )
    mine = [p for p in probes if p.meta["model_hash"] == model_hash]
    if not mine:
        raise ValueError(
            f"{index}: its probes were fitted on another model (hash "
            f"{probes[0].meta['model_hash'][:12]}..., this one {model_hash[:12]}...)"
        )
    for task, prefill in cells:
        have = [p for p in mine if p.meta["task"] == task and p.meta["prefill"] == prefill]
        if not have:
            held = sorted({f"{p.meta['task']} under {p.meta['prefill']}" for p in mine})
            raise ValueError(
                f"{index} has no probe of {task} under prefill {prefill} (it holds "
                f"{', '.join(held)})"
            )
        sites = {p.meta.get("site", "resid") for p in have}
        if "resid" not in sites:
            raise ValueError(
                f"{index}: the probes of {task} under {prefill} read site "
                f"{', '.join(sorted(sites))}, not the residual (resid)"
            )
        have = [p for p in have if p.meta.get("site", "resid") == "resid"]
        if all(p.direction() is None for p in have):
            raise ValueError(
                f"{index}: the probes of {task} under {prefill} are "
                f"{have[0].meta['probe']} probes, which have no direction "
                "(fit them with --probe logistic)"
            )
        missing = sorted(
            {d for d in depths} - {p.meta["depth"] for p in have if p.direction() is not None}
        )
        if missing:
            raise ValueError(
                f"{index} has no linear probe of {task} under {prefill} at depth "
                f"{', '.join(map(str, missing[:5]))}"
            )
        widths = {p.direction().shape[-1] for p in have if p.direction() is not None}
        if widths != {width}:
            raise ValueError(
                f"{index}: the probes of {task} under {prefill} read "
                f"{', '.join(map(str, sorted(widths)))} features, the model's "
                f"residual has {width}"
            )


def find(probes: list[SavedProbe], **where) -> SavedProbe:
    """The one saved probe whose metadata matches ``where`` (e.g. task=, prefill=, depth=)."""
    hits = [p for p in probes if all(p.meta.get(k) == v for k, v in where.items())]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} saved probes match {where}")
    return hits[0]

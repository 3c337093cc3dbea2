"""The whole probing protocol behind ``fbt-probe fit``: extract, fit, control, write.

For each task, target, prefill and depth it fits the grouped, nested-CV probe on the
trained model (pooled over distractor counts 1..256, per count, and for multi_register
per number of overwrites), on a random-init model of the same config (the control that
gives "decodable" a meaning) and on group-permuted labels (which must land at chance).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
from joblib import Parallel, delayed

from fbt_probe import __version__
from fbt_probe.checkpoint import model_hash
from fbt_probe.model import FBTModel
from fbt_probe.registry import random_init_like
from probes.extract import DEFAULT_CACHE, extract_cached, parse_prefill
from probes.fit import CS, N_FOLDS, bootstrap_ci, cross_validate, grouped_splits, permute_by_group
from tasks import TASK_NAMES, vocab
from tasks.dataset import Dataset, load
from tasks.generate import DEFAULT_SEED, default_path, generate_dataset

COLUMNS = [
    "task", "target", "model", "prefill", "depth", "distractors", "overwrites",
    "accuracy", "ci_low", "ci_high", "chance", "majority", "n_examples", "n_groups", "C",
]  # fmt: skip
POOLED = "1-256"


def targets_of(ds: Dataset) -> dict[str, np.ndarray]:
    """Probe targets: ``label`` for the binary tasks, one per register for multi_register."""
    labels = np.array([list(lab) for lab in ds.labels])
    if ds.task == "multi_register":
        return {vocab.REGISTERS[r]: labels[:, r] for r in range(labels.shape[1])}
    return {"label": labels[:, 0]}


def _cell(X, y, groups, seed, folds, C=None):
    """One probe cell: nested CV (C None) or fixed C; returns the row's numbers."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    # Probes on features that carry no signal (random init, permuted labels) often stop at
    # max_iter; the warning would drown the output and says nothing about the result.
    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    splits = grouped_splits(y, groups, folds, seed)
    res = cross_validate(X, y, splits, groups=groups, C=C)
    lo, hi = bootstrap_ci(res.correct, groups, seed)
    cs = [c for c in res.Cs if c == c]
    return {
        "accuracy": res.accuracy, "ci_low": lo, "ci_high": hi, "chance": res.chance,
        "majority": res.majority, "n_examples": int(len(y)), "n_groups": int(len(np.unique(groups))),
        "C": float(np.median(cs)) if cs else float("nan"),
    }  # fmt: skip


def load_or_generate(task: str, data: str | Path | None) -> Dataset:
    """The dataset file given, or the default ``data/<task>.parquet`` (generated if absent)."""
    if data is not None:
        ds = load(data)
        if ds.task != task:
            raise ValueError(f"{data} holds task {ds.task!r}, not {task!r}")
        return ds
    path = default_path(task)
    if not path.is_file():
        generate_dataset(task, path, seed=DEFAULT_SEED)
    return load(path)


def run_fit(
    model: FBTModel,
    model_name: str,
    tasks: tuple[str, ...] = TASK_NAMES,
    prefills: tuple[str, ...] = ("standard", "recurrent", "full"),
    data: dict[str, str | Path] | None = None,
    out_dir: str | Path = "results",
    seed: int = 0,
    folds: int = N_FOLDS,
    controls: bool = True,
    per_count: bool = True,
    cache_dir: str | Path | None = DEFAULT_CACHE,
    n_jobs: int = 2,
    progress=None,
) -> pd.DataFrame:
    """Run the protocol and write ``probe_results.csv`` and ``probe_results.json``."""
    t0 = time.monotonic()
    for p in prefills:
        parse_prefill(p)
    for t in tasks:
        if t not in TASK_NAMES:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(TASK_NAMES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mhash = model_hash(model)
    control = random_init_like(model, seed=seed) if controls else None
    chash = model_hash(control) if control is not None else None
    datasets = {t: load_or_generate(t, (data or {}).get(t)) for t in tasks}

    # 1. features (cached on disk by model hash and dataset hash)
    feats: dict[tuple[str, str, str], np.ndarray] = {}
    jobs = [
        (t, p, v)
        for t in tasks
        for p in prefills
        for v in (["trained", "random_init"] if controls else ["trained"])
    ]
    for i, (t, p, v) in enumerate(jobs):
        m, h = (model, mhash) if v == "trained" else (control, chash)
        feats[(t, p, v)], _ = extract_cached(m, datasets[t], p, cache_dir, mhash=h)
        if progress is not None:
            progress(i + 1, len(jobs), f"extract {t} {p} {v}")

    # 2. probe cells
    specs = []  # (row metadata, X, y, groups, C or None)
    for t in tasks:
        ds = datasets[t]
        counts, groups = ds.n_distractors, ds.group
        pooled = counts >= 1
        for target, y in targets_of(ds).items():
            for p in prefills:
                F = feats[(t, p, "trained")]
                for d in range(F.shape[1]):
                    base = {
                        "task": t,
                        "target": target,
                        "prefill": p,
                        "depth": d,
                        "overwrites": "all",
                    }
                    specs.append(
                        (
                            {**base, "model": "trained", "distractors": POOLED},
                            F[pooled, d],
                            y[pooled],
                            groups[pooled],
                            None,
                        )
                    )
                    if controls:
                        Fr = feats[(t, p, "random_init")]
                        specs.append(
                            (
                                {**base, "model": "random_init", "distractors": POOLED},
                                Fr[pooled, d],
                                y[pooled],
                                groups[pooled],
                                None,
                            )
                        )
                        yp = permute_by_group(y[pooled], groups[pooled], seed + 1)
                        specs.append(
                            (
                                {**base, "model": "permuted", "distractors": POOLED},
                                F[pooled, d],
                                yp,
                                groups[pooled],
                                1.0,
                            )
                        )
    rows = _run_cells(specs, seed, folds, n_jobs, progress, "probe (pooled)")

    # per count and per overwrites: C fixed to the pooled cell's choice (no second nesting)
    chosen = {
        (r["task"], r["target"], r["prefill"], r["depth"]): r["C"]
        for r in rows
        if r["model"] == "trained"
    }
    specs = []
    if per_count:
        for t in tasks:
            ds = datasets[t]
            counts, groups = ds.n_distractors, ds.group
            ow = np.array([list(o) for o in ds.overwrites]) if t == "multi_register" else None
            for ti, (target, y) in enumerate(targets_of(ds).items()):
                for p in prefills:
                    F = feats[(t, p, "trained")]
                    for d in range(F.shape[1]):
                        C = chosen[(t, target, p, d)]
                        C = CS[-1] if C != C else C
                        base = {
                            "task": t,
                            "target": target,
                            "prefill": p,
                            "depth": d,
                            "model": "trained",
                        }
                        for n in sorted(set(counts.tolist())):
                            m = counts == n
                            if len(np.unique(groups[m])) >= folds:
                                specs.append(
                                    (
                                        {**base, "distractors": str(n), "overwrites": "all"},
                                        F[m, d],
                                        y[m],
                                        groups[m],
                                        C,
                                    )
                                )
                        if ow is not None:
                            for k in sorted(set(ow[:, ti].tolist())):
                                m = (counts >= 1) & (ow[:, ti] == k)
                                if len(np.unique(groups[m])) >= folds:
                                    specs.append(
                                        (
                                            {**base, "distractors": POOLED, "overwrites": str(k)},
                                            F[m, d],
                                            y[m],
                                            groups[m],
                                            C,
                                        )
                                    )
    rows += _run_cells(specs, seed, folds, n_jobs, progress, "probe (per count)")

    df = pd.DataFrame(rows)[COLUMNS]
    write_results(df, out, {
        "model": model_name, "model_hash": mhash, "random_init_hash": chash,
        "datasets": {t: {"content_hash": d.content_hash, "seed": d.meta["seed"], "n_groups": d.meta["n_groups"],
                         "distractors": d.meta["distractors"], "n_examples": len(d)} for t, d in datasets.items()},
        "prefills": list(prefills), "folds": folds, "fold_seed": seed, "bootstrap_seed": seed,
        "permutation_seed": seed + 1, "random_init_seed": seed, "C_grid": list(CS),
        "cv": "StratifiedGroupKFold(shuffle=True) outer, GroupKFold inner (nested C); groups = base instance",
        "model_config": model.cfg.to_dict(), "seconds": time.monotonic() - t0, "versions": versions(),
    })  # fmt: skip
    return df


def _run_cells(specs, seed, folds, n_jobs, progress, label):
    if not specs:
        return []
    out = []
    chunk = max(1, len(specs) // 20)
    for s in range(0, len(specs), chunk):
        part = specs[s : s + chunk]
        res = Parallel(n_jobs=n_jobs)(
            delayed(_cell)(X, y, g, seed, folds, C) for _, X, y, g, C in part
        )
        out += [{**meta, **r} for (meta, *_), r in zip(part, res, strict=True)]
        if progress is not None:
            progress(min(len(specs), s + chunk), len(specs), label)
    return out


def versions() -> dict:
    import sklearn
    import torch

    return {"fbt_probe": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "sklearn": sklearn.__version__, "numpy": np.__version__, "vocab": vocab.VOCAB_VERSION}  # fmt: skip


def write_results(df: pd.DataFrame, out: Path, meta: dict) -> None:
    from tasks.dataset import atomic_write

    atomic_write(
        out / "probe_results.csv", lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g")
    )
    atomic_write(
        out / "probe_results.json",
        lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"),
    )

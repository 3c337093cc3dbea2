"""The whole probing protocol behind ``fbt-probe fit``: extract, plan, fit, control, write.

The protocol is a plan of cells (``Cell``: task, target, site, prefill, depth, subset and
control), built first and then executed. For each task, target, site, prefill and depth it
fits the grouped, nested-CV probe on the trained model (pooled over distractor counts
1..256, per count, and for multi_register per number of overwrites), on a random-init model
of the same config (the control that gives "decodable" a meaning) and on group-permuted
labels (which must land at chance).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
from joblib import Parallel, delayed

from fbt_probe.checkpoint import model_hash
from fbt_probe.feedback import FeedbackModel
from fbt_probe.loading import random_init_like, resolve_model
from fbt_probe.prefill import PREFILLS, parse_prefill
from fbt_probe.train.distributed import place
from fbt_probe.util.files import claims
from probes.analysis import Result
from probes.common.artifacts import fit_and_save
from probes.common.cv import N_FOLDS, fit_cell, permute_by_group
from probes.common.data import load_or_generate
from probes.common.extract import DEFAULT_CACHE, RESID, SiteNotFired, extract_cached, site_hooks
from probes.common.probe import probe_class
from probes.common.probe_results import entry_depth, format_layer0, layer0_table
from probes.common.tables import versions, write_json, write_table
from probes.common.work import check_data_work, prefill_passes
from probes.fit.options import FitOptions
from probes.fit.plot import plot_all
from tasks import TASK_NAMES, get_task, stratum, target_names
from tasks.base import POOLED
from tasks.dataset import Dataset

COLUMNS = [
    "task",
    "target",
    "model",
    "prefill",
    "depth",
    "distractors",
    "overwrites",
    "accuracy",
    "ci_low",
    "ci_high",
    "chance",
    "majority",
    "n_examples",
    "n_groups",
    "C",
    "probe",
    "site",
]
CONTROLS = ("random_init", "permuted")


def targets_of(ds: Dataset) -> dict[str, np.ndarray]:
    """Probe targets as the task declares them (``tasks.target_names``), one per answer word:
    ``label`` for delayed_memory and done_tracking, one per register for multi_register."""
    labels = np.array([list(lab) for lab in ds.labels])
    names = target_names(ds.task, ds.meta.get("params"))
    if len(names) != labels.shape[1]:
        raise ValueError(
            f"task {ds.task} declares {len(names)} targets, its data has {labels.shape[1]} labels"
        )
    return {n: labels[:, i] for i, n in enumerate(names)}


@dataclass(frozen=True)
class Cell:
    """One probe fit of the protocol: which features, which labels, which examples.

    ``model``: the trained model, its random-init control, or the trained model's features
    with group-permuted labels. ``distractors``/``overwrites``: the subset ("1-256" = counts
    1..256 pooled, "all" = every overwrite count). ``C``: the probe's regularisation, or None
    to choose it by nested grouped CV."""

    task: str
    target: str
    site: str
    prefill: str
    depth: int
    model: str = "trained"
    distractors: str = POOLED
    overwrites: str = "all"
    C: float | None = None

    @property
    def features(self) -> tuple[str, str, str, str]:
        """The feature table the cell reads: (task, prefill, site, model whose features)."""
        return (
            self.task,
            self.prefill,
            self.site,
            "random_init" if self.model == "random_init" else "trained",
        )


def _overwrites(ds: Dataset) -> np.ndarray | None:
    """The task's own per-target stratum (multi_register: overwrites), if it declares one."""
    return np.array([list(o) for o in ds.overwrites]) if stratum(ds.task) else None


def pooled_plan(tasks, datasets, prefills, sites, n_depths, controls: bool) -> list[Cell]:
    """The headline cells: every task, target, site, prefill and depth, counts 1..256."""
    models = ("trained", *CONTROLS) if controls else ("trained",)
    return [
        Cell(t, target, site, p, d, model=m, C=1.0 if m == "permuted" else None)
        for t in tasks
        for target in target_names(t, datasets[t].meta.get("params"))
        for site in sites
        for p in prefills
        for d in range(n_depths[(t, site)])
        for m in models
    ]


def subset_plan(pooled_rows, datasets, targets, folds: int, grid) -> list[Cell]:
    """Per distractor count, and for multi_register per number of overwrites, of each trained
    pooled cell, with C fixed to the pooled cell's choice (no second nesting). A subset with
    fewer groups than folds is left out."""
    out = []
    for r in pooled_rows:
        if r["model"] != "trained":
            continue
        ds = datasets[r["task"]]
        C = grid[-1] if r["C"] != r["C"] else r["C"]
        base = Cell(r["task"], r["target"], r["site"], r["prefill"], r["depth"], C=C)
        counts, groups = ds.n_distractors, ds.group
        for n in sorted(set(counts.tolist())):
            if len(np.unique(groups[counts == n])) >= folds:
                out.append(replace(base, distractors=str(n)))
        ow = _overwrites(ds)
        if ow is not None:
            ti = list(targets[r["task"]]).index(r["target"])
            for k in sorted(set(ow[:, ti].tolist())):
                m = (counts >= 1) & (ow[:, ti] == k)
                if len(np.unique(groups[m])) >= folds:
                    out.append(replace(base, overwrites=str(k)))
    return out


def cell_data(
    cell: Cell, ds: Dataset, targets: dict[str, np.ndarray], feats: np.ndarray, seed: int
):
    """(X, y, groups) of a cell; ``targets`` is ``targets_of(ds)``."""
    counts, groups = ds.n_distractors, ds.group
    y = targets[cell.target]
    if cell.distractors == POOLED:
        m = counts >= 1
    else:
        m = counts == int(cell.distractors)
    if cell.overwrites != "all":
        ti = list(targets).index(cell.target)
        m = m & (_overwrites(ds)[:, ti] == int(cell.overwrites))
    X, y, g = feats[m, cell.depth], y[m], groups[m]
    if cell.model == "permuted":
        y = permute_by_group(y, g, seed + 1)
    return X, y, g


@claims("out_dir")
def fit_protocol(
    model: FeedbackModel,
    model_name: str,
    tasks: tuple[str, ...] = TASK_NAMES,
    prefills: tuple[str, ...] = PREFILLS,
    data: dict[str, str | Path] | None = None,
    out_dir: str | Path = "results",
    *,
    seed: int = 0,
    folds: int = N_FOLDS,
    controls: bool = True,
    per_count: bool = True,
    cache_dir: str | Path | None = DEFAULT_CACHE,
    n_jobs: int = 2,
    progress=None,
    probe: str = "logistic",
    sites: tuple[str, ...] = (RESID,),
    save_probes: bool = True,
) -> pd.DataFrame:
    """Run the protocol and write ``probe_results.csv``, ``probe_results.json`` and (with
    ``save_probes``) every trained pooled cell's probe, refit on all its data, to
    ``probes/`` (``probes.common.artifacts``)."""
    t0 = time.monotonic()
    # Prefill objects from here on (a word is read here, a Prefill passes as it is)
    by_name = {p.name: p for p in map(parse_prefill, prefills)}
    prefills = tuple(by_name)
    grid = probe_class(probe).grid
    for t in tasks:
        get_task(t, "--task")
    for site in sites:
        site_hooks(model, site)
    control = random_init_like(model, seed=seed) if controls else None
    models = {
        "trained": (model, model_hash(model)),
        "random_init": (control, model_hash(control) if control is not None else None),
    }
    datasets = {t: load_or_generate(t, (data or {}).get(t), model) for t in tasks}
    for t, ds in datasets.items():  # before the features are extracted, not after
        if folds > (n_groups := len(np.unique(ds.group))):
            raise ValueError(f"--folds {folds}: the {t} dataset has only {n_groups} groups")
    passes = sum(prefill_passes(p) for p in by_name.values())
    check_data_work(
        model,
        datasets.values(),
        passes,
        len(sites) * (1 + controls),
        "--prefill" + ", --site" * (len(sites) > 1),
    )
    # 1. features (cached on disk by model hash, dataset hash, prefill and site)
    feats, skipped = extract_all(models, datasets, by_name, sites, controls, cache_dir, progress)
    for site in sites:
        if all((site, p) in skipped for p in prefills):
            raise ValueError(f"{site} fires under none of the prefills {', '.join(prefills)}")
    n_depths = {
        (t, site): next(f.shape[1] for k, f in feats.items() if k[0] == t and k[2] == site)
        for t in tasks
        for site in sites
    }
    # 2. the plan of cells, then its execution
    targets = {t: targets_of(ds) for t, ds in datasets.items()}

    def data_of(c: Cell):
        return cell_data(c, datasets[c.task], targets[c.task], feats[c.features], seed)

    def execute(cells, label):
        return _run_cells(
            [(c, *data_of(c)) for c in cells], seed, folds, n_jobs, progress, label, probe
        )

    plan = [
        c
        for c in pooled_plan(tasks, datasets, prefills, sites, n_depths, controls)
        if (c.site, c.prefill) not in skipped
    ]
    rows = execute(plan, "probe (pooled)")
    if per_count:
        rows += execute(subset_plan(rows, datasets, targets, folds, grid), "probe (per count)")
    meta = fit_meta(
        model, model_name, models, datasets, prefills, probe, sites, skipped, folds, seed, grid
    )
    savable = all(hasattr(probe_class(probe), a) for a in ("state", "config", "from_saved"))
    meta["probes_saved"] = bool(save_probes and savable)
    if save_probes and savable:
        save_pooled_probes(rows, data_of, grid, probe, meta, Path(out_dir) / "probes", n_jobs)
    meta["seconds"] = time.monotonic() - t0
    df = pd.DataFrame(rows)[COLUMNS]
    write_results(df, Path(out_dir), meta)
    return df


def fit_meta(
    model, model_name, models, datasets, prefills, probe, sites, skipped, folds, seed, grid
) -> dict:
    """What ``probe_results.json`` says of a fit: the models, data, folds and seeds."""
    return {
        "model": model_name,
        "model_hash": models["trained"][1],
        "random_init_hash": models["random_init"][1],
        "datasets": {
            t: {
                "content_hash": d.content_hash,
                "seed": d.meta["seed"],
                "n_groups": d.meta["n_groups"],
                "distractors": d.meta["distractors"],
                "n_examples": len(d),
            }
            for t, d in datasets.items()
        },
        "prefills": list(prefills),
        "probe": probe,
        "sites": list(sites),
        "skipped": [f"{s} under {p} prefill (does not fire)" for s, p in skipped],
        "folds": folds,
        "fold_seed": seed,
        "bootstrap_seed": seed,
        "permutation_seed": seed + 1,
        "random_init_seed": seed,
        "C_grid": list(grid),
        "cv": "StratifiedGroupKFold(shuffle=True) outer, GroupKFold inner (nested C); groups = base instance",
        "model_config": model.cfg.to_dict(),
        "entry_depth": model.entry_depth,
        "versions": versions(),
    }


def save_pooled_probes(rows, data_of, grid, probe, meta, folder: Path, n_jobs: int) -> None:
    """Every trained pooled cell's probe, refit on all its data, as artifacts in ``folder``."""

    trained = [
        r
        for r in rows
        if r["model"] == "trained" and r["distractors"] == POOLED and r["overwrites"] == "all"
    ]
    cells = [
        Cell(
            r["task"],
            r["target"],
            r["site"],
            r["prefill"],
            r["depth"],
            C=grid[-1] if r["C"] != r["C"] else r["C"],
        )
        for r in trained
    ]
    fit_and_save(folder, cells, [data_of(c)[:2] for c in cells], probe, meta, n_jobs)


def extract_all(models, datasets, prefills, sites, controls, cache_dir, progress=None):
    """Features of every (task, prefill, site, model) the protocol reads: {key: array} and
    the (site, prefill) pairs whose hook does not fire (e.g. fusion.* in pass 1), keyed by
    the prefill's name. ``models``: {"trained": (model, hash), "random_init": (control,
    hash)}; ``prefills``: {name: Prefill}."""
    feats: dict[tuple[str, str, str, str], np.ndarray] = {}
    jobs = [
        (t, p, site, v)
        for t in datasets
        for site in sites
        for p in prefills
        for v in (["trained", "random_init"] if controls else ["trained"])
    ]
    skipped = []
    for i, (t, p, site, v) in enumerate(jobs):
        m, h = models[v]
        if (site, p) in skipped:
            continue
        try:
            feats[(t, p, site, v)], _ = extract_cached(
                m, datasets[t], prefills[p], cache_dir, mhash=h, site=site
            )
        except SiteNotFired:
            skipped.append((site, p))
        if progress is not None:
            progress(i + 1, len(jobs), f"extract {t} {p} {site} {v}")
    return feats, skipped


def prefetch_features(
    model,
    tasks,
    prefills,
    data=None,
    sites=(RESID,),
    controls=True,
    seed=0,
    cache_dir=DEFAULT_CACHE,
    progress=None,
) -> None:
    """Under torchrun: every rank extracts its share of the features ``fit_protocol`` reads
    and rank 0 writes them to the disk cache, where ``fit_protocol`` on rank 0 then finds
    them. ``prefills``: Prefill objects (or their words)."""
    if cache_dir is None:
        raise ValueError("extraction across ranks needs the feature cache (cache_dir)")
    control = random_init_like(model, seed=seed) if controls else None
    models = {
        "trained": (model, model_hash(model)),
        "random_init": (control, model_hash(control) if control is not None else None),
    }
    datasets = {t: load_or_generate(t, (data or {}).get(t), model) for t in tasks}
    by_name = {p.name: p for p in map(parse_prefill, prefills)}
    extract_all(models, datasets, by_name, sites, controls, cache_dir, progress)


def _run_cells(specs, seed, folds, n_jobs, progress, label, probe="logistic"):
    if not specs:
        return []
    out = []
    chunk = max(1, len(specs) // 20)
    for s in range(0, len(specs), chunk):
        part = specs[s : s + chunk]
        res = Parallel(n_jobs=n_jobs)(
            delayed(fit_cell)(X, y, g, seed, folds, c.C, probe) for c, X, y, g in part
        )
        for (c, *_), r in zip(part, res, strict=True):
            row = asdict(c)
            row.pop("C")
            out.append({**row, **r, "probe": probe})
        if progress is not None:
            progress(min(len(specs), s + chunk), len(specs), label)
    return out


def write_results(df: pd.DataFrame, out: Path, meta: dict) -> None:

    write_table(df, out / "probe_results.csv")
    write_json(meta, out / "probe_results.json", indent=2)


def run(options: FitOptions, progress=None) -> Result:
    """``fbt-probe fit``: the protocol on the model ``--model`` names, on options checked
    before any work, then the table at the feedback's entry depth in the lines it reports.
    Under torchrun the ranks share the extraction and rank 0 fits and writes (the others
    return no tables)."""
    o, out = options, Path(options.out)
    task_list, data_map = o.tasks_and_data
    dev, world = place(o.device)
    m, name = resolve_model(o.model, dev)
    for site in o.sites:
        site_hooks(m, site)
    if world.size > 1:  # torchrun: the ranks share the extraction, rank 0 fits and writes
        prefetch_features(
            m,
            task_list,
            o.prefills,
            data_map,
            o.sites,
            o.controls,
            o.seed,
            progress=progress if world.main else None,
        )
        world.barrier()
        if not world.main:
            return Result()
    df = fit_protocol(
        m,
        name,
        task_list,
        o.prefills,
        data_map,
        out,
        seed=o.seed,
        folds=o.folds,
        controls=o.controls,
        progress=progress,
        probe=o.probe,
        sites=o.sites,
    )
    d = entry_depth(out)
    where = "layer 0" if d == 0 else f"depth {d} (block {d}'s input, where the feedback enters)"
    return Result(
        {"probe_results": df},
        [
            f"wrote {out / 'probe_results.csv'} ({len(df)} rows), probe_results.json and the "
            f"fitted probes in {out / 'probes'}",
            "",
            f"{where} at the colon, pooled over distractor counts 1..256:",
            format_layer0(layer0_table(df, d)),
        ],
    )


def reproduce(model, name: str, results: Path, out: Path, progress=None) -> list[str]:
    """``fbt-probe reproduce``'s fit: every task, prefill and control into ``out`` (what
    becomes ``results``), its figures, and the table at the feedback's entry depth."""

    df = fit_protocol(model, name, out_dir=out, progress=progress)
    plot_all(out)
    return format_layer0(layer0_table(df, model.entry_depth)).splitlines()

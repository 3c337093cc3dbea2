"""A seed study: one recipe trained on several seeds, one after another (resumable), then a
table per seed and pooled, and a figure (``fbt-probe train --seeds 0-4``).

Per seed: held-out answer accuracy (``fbt-probe eval``: each task x standard / soft / fused /
full, pooled over counts 1..256; multi_register also per register) and the layer-0 probe at
the colon for each prefill (``fbt-probe fit``'s protocol, without controls), with its
bootstrap interval (in ``seed_rows.json`` and the markdown table's seed cells). Pooled: the
mean, the minimum and how many seeds meet each target.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from fbt_probe.kernels.evaluate import evaluate
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import PREFILLS
from fbt_probe.runtime.device import resolve_device
from fbt_probe.train.loop import train
from fbt_probe.train.recipes import build_recipe
from fbt_probe.train.state import saved_train_config, without_sharding
from fbt_probe.util.files import atomic_write, claim
from fbt_probe.util.lists import comma_numbers
from fbt_probe.util.transaction import transaction
from probes.common.figures import save_figure, subplots
from probes.common.probe_results import layer0_table
from probes.fit.run import fit_protocol
from tasks import task_names
from tasks.base import POOLED
from tasks.dataset import int_range
from tasks.generate import generate_dataset

# what write_study writes
STUDY_FILES = ("seed_table.*", "seed_rows.json", "seeds.*")

# what a recipe must reach on a seed (issue: a recipe that holds across seeds)
TARGETS = {
    "answers": 0.99,  # delayed_memory and done_tracking, every decoding mode
    "register": 0.95,  # multi_register, every register, every mode
    "probe_recurrent": 0.99,  # layer 0 under recurrent prefill, delayed_memory and done_tracking
    "standard_margin": 0.05,  # layer 0 under standard prefill within this of chance
}


def parse_seeds(spec: str) -> list[int]:
    """'0-4' -> [0..4]; '0,3,7' -> [0, 3, 7]."""

    usage = f"--seeds {spec!r}: use a range '0-4' or a list '0,3,7'"
    out = list(comma_numbers(spec, "--seeds", int_range, usage))
    if not out or min(out) < 0:
        raise ValueError(f"--seeds {spec!r}: seeds are integers >= 0")
    return sorted(set(out))


def seed_row(run: Path, eval_groups: int = 48, probe_groups: int = 128, progress=None) -> dict:
    """Eval accuracy and the layer-0 probe of one finished run folder."""

    model, name = resolve_model(str(run))
    tasks = task_names()[:3]  # the built-in tasks
    summary, per_reg = evaluate(model, tasks, n_groups=eval_groups, progress=progress)
    row: dict = {}
    for task, by_mode in summary.items():
        for mode, accs in by_mode.items():
            row[f"{task}/{mode}"] = accs[POOLED]
            if len(per_reg[task][mode]) > 1:
                row[f"{task}/{mode}/min_register"] = float(min(per_reg[task][mode]))
    data = {}
    for t in tasks:  # the probe datasets of fit, generated into the study folder once
        path = run.parent / "data" / f"{t}-{probe_groups}.parquet"
        if not path.is_file():
            generate_dataset(t, path, n_groups=probe_groups)
        data[t] = path
    df = fit_protocol(
        model,
        name,
        tasks,
        PREFILLS,
        data,
        run / "probe",
        controls=False,
        per_count=False,
        cache_dir=run.parent / ".cache",
        progress=progress,
    )
    row.update(probe_entries(df, model.entry_depth))
    return row


# kept beside a row's numbers, not tabulated as measures of their own
SIDE = ("chance/", "ci_low/", "ci_high/")


def probe_entries(df: pd.DataFrame, depth: int = 0) -> dict:
    """The probe entries of a seed's row from ``fit``'s results, at the feedback's entry
    ``depth`` (layer 0 in the paper's design): accuracy, chance and the accuracy's interval
    per task x target x prefill."""

    out = {}
    for r in layer0_table(df, depth).itertuples():
        key = f"{r.task}/{r.target}/{r.prefill}"
        out[f"probe/{key}"] = r.accuracy
        out[f"chance/{key}"] = r.chance
        out[f"ci_low/{key}"] = r.ci_low
        out[f"ci_high/{key}"] = r.ci_high
    return out


def meets(row: dict) -> dict[str, bool]:
    """Which targets one seed meets."""
    modes = ("standard", "soft", "fused", "full")
    one = ("delayed_memory", "done_tracking")
    std = [k for k in row if k.startswith("probe/") and k.endswith("/standard")]
    return {
        "answers >= 0.99": all(row[f"{t}/{m}"] >= TARGETS["answers"] for t in one for m in modes),
        "multi_register >= 0.95 per register": all(
            row.get(f"multi_register/{m}/min_register", 0.0) >= TARGETS["register"] for m in modes
        ),
        "layer-0 probe recurrent >= 0.99": all(
            row[f"probe/{t}/label/recurrent"] >= TARGETS["probe_recurrent"] for t in one
        ),
        "standard prefill at chance": all(
            row[k] <= row[k.replace("probe/", "chance/")] + TARGETS["standard_margin"] for k in std
        ),
    }


def seed_table(rows: dict[int, dict]) -> pd.DataFrame:
    """One row per seed, then mean, min and the number of seeds meeting each target."""
    df = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    df = df[[c for c in df.columns if not c.startswith(SIDE)]]
    hits = pd.DataFrame({s: meets(r) for s, r in rows.items()}).T.sort_index()
    out = pd.concat([df, hits], axis=1)
    out.index = [f"seed {s}" for s in out.index]
    num = df.astype(float)
    summary = pd.DataFrame([num.mean(), num.min()], index=["mean", "min"])
    count = pd.DataFrame([hits.sum().astype(int)], index=["seeds meeting"])
    return pd.concat([out, summary, count])


def with_interval_cells(table: pd.DataFrame, rows: dict[int, dict]) -> pd.DataFrame:
    """``seed_table`` with each seed's probe cells as text, "0.981 [0.971, 0.990]" (the
    probe's interval, where its row has one): for the markdown table."""
    out = table.astype(object)
    for s, r in rows.items():
        for col in (c for c in out.columns if c.startswith("probe/")):
            lo, hi = (r.get(col.replace("probe/", f"ci_{e}/", 1)) for e in ("low", "high"))
            if lo is not None and hi is not None:
                out.loc[f"seed {s}", col] = f"{r[col]:.3f} [{lo:.3f}, {hi:.3f}]"
    return out


def markdown(df: pd.DataFrame) -> str:
    """A DataFrame as a markdown table (numbers to 3 decimals; text as it is)."""
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| | " + " | ".join(map(str, df.columns)) + " |", "|---" * (len(df.columns) + 1) + "|"]
    lines += [
        "| " + str(i) + " | " + " | ".join(fmt(v) for v in r) + " |" for i, r in df.iterrows()
    ]
    return "\n".join(lines) + "\n"


def plot_seeds(rows: dict[int, dict], out: Path) -> Path:
    """Per-seed dots over the recipe's mean, for every answer and layer-0 probe column."""
    df = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    cols = [c for c in df.columns if not c.startswith(SIDE)]
    fig, ax = subplots(figsize=(max(6, 0.35 * len(cols)), 4))
    x = np.arange(len(cols))
    for j, (seed, r) in enumerate(df[cols].iterrows()):
        ax.scatter(x + (j - (len(df) - 1) / 2) * 0.08, r.values, s=14, label=f"seed {seed}")
    ax.bar(x, df[cols].mean().values, color="lightgrey", zorder=0, label="mean")
    ax.set_xticks(x, cols, rotation=90, fontsize=7)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("accuracy (answers: exact match; probes: layer 0 at the colon)")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, out, "seeds")
    return out / "seeds.png"


def recipe_key(cfg):
    """What makes two seeds' runs the same recipe: the config without its name (it enters no
    arithmetic), its seed or how the states were sharded."""

    return without_sharding(replace(cfg, name="recipe", run=replace(cfg.run, seed=0)))


def _json_object(path: Path) -> dict:
    """A JSON object read from ``path``, or one line naming the file."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a JSON object")
    return d


def _same_recipe(run: Path, scfg) -> None:
    """A finished seed is kept only if it was trained with this recipe: another recipe's run
    in the folder would otherwise enter the table under this one's name."""

    try:
        saved = saved_train_config(run)
    except (OSError, ValueError) as e:
        raise ValueError(f"{run}: cannot read the finished seed's recipe ({e})") from None
    if recipe_key(saved) != recipe_key(scfg):
        raise ValueError(
            f"{run} was trained with another recipe than {scfg.name} (its train_config.json "
            "differs); use another --out"
        )
    if saved.run.seed != scfg.run.seed:  # a seed's folder moved or copied to another's place
        raise ValueError(
            f"{run} was trained with seed {saved.run.seed}, not seed {scfg.run.seed} (its "
            "train_config.json says so); put it back in its own seed's folder"
        )


def run_seed_study(
    cfg,
    seeds: list[int],
    out: Path,
    train_fn,
    eval_groups: int = 48,
    probe_groups: int = 128,
    bars=None,
) -> pd.DataFrame:
    """Train ``cfg`` for every seed into ``out/seed-<s>`` (a finished seed is kept, a stopped
    one resumed), then write ``seed_table.csv``, ``seed_table.md``, ``seed_rows.json`` and
    ``seeds.png``. ``train_fn(cfg, run_dir, resume)`` trains one seed; ``bars(label)``, a
    context manager giving a progress callable, shows the measuring of each seed."""

    rows = {}
    for s in seeds:
        run = out / f"seed-{s}"
        scfg = cfg.with_overrides({"run.seed": s, "name": f"{cfg.name}-seed{s}"})
        done = run / "metrics.json"
        finished = done.is_file() and _json_object(done).get("finished")
        if finished:
            _same_recipe(run, scfg)
        if not finished:
            train_fn(scfg, run, (run / "state.pt").is_file())
        cached = run / "seed_row.json"
        if cached.is_file():
            rows[s] = _json_object(cached)
            bad = [k for k, v in rows[s].items() if not isinstance(v, int | float)]
            if bad:
                raise ValueError(
                    f"{cached} is damaged: {bad[0]!r} is not a number; delete it "
                    "to measure the seed again"
                )
        else:
            with bars(f"measure seed {s}") if bars else nullcontext() as bar:
                rows[s] = seed_row(run, eval_groups, probe_groups, bar)
            atomic_write(cached, lambda tmp, r=rows[s]: Path(tmp).write_text(json.dumps(r)))
    return write_study(rows, out)


def write_study(rows: dict[int, dict], out: Path) -> pd.DataFrame:
    """Write a study's ``seed_table.csv``, ``seed_table.md``, ``seed_rows.json`` and
    ``seeds.png`` into ``out`` from its rows (seed -> measured row), seeds in order."""

    rows = {s: rows[s] for s in sorted(rows)}
    out.mkdir(parents=True, exist_ok=True)
    table = seed_table(rows)
    atomic_write(out / "seed_table.csv", lambda tmp: table.to_csv(tmp, float_format="%.4g"))
    md = markdown(with_interval_cells(table, rows).T)
    atomic_write(out / "seed_table.md", lambda tmp: Path(tmp).write_text(md))
    atomic_write(
        out / "seed_rows.json", lambda tmp: Path(tmp).write_text(json.dumps(rows, indent=1))
    )
    plot_seeds(rows, out)
    return table


def study_rows(study: Path) -> dict[int, dict]:
    """A study's rows, seed -> row, from its ``seed_rows.json``."""
    path = study / "seed_rows.json"
    if not path.exists():
        raise ValueError(f"{study}: no seed_rows.json (is it a folder `train --seeds` wrote?)")
    try:
        found = json.loads(path.read_text(), object_pairs_hook=_once)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    except ValueError as e:  # a key written twice
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(found, dict) or not all(isinstance(r, dict) for r in found.values()):
        raise ValueError(f"{path}: not a study's rows (seed -> measured row)")
    rows: dict[int, dict] = {}
    for key, row in found.items():  # each seed written once, as write_study writes it: "0", "7"
        if not (key.isdigit() and str(int(key)) == key):
            raise ValueError(f"{path}: {key!r} is not a seed (an integer >= 0, as written)")
        rows[int(key)] = row
    return rows


def _once(pairs: list) -> dict:
    """A JSON object whose every key comes once (``json`` keeps the last of two silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"{k!r} is written twice")
        out[k] = v
    return out


def recipe_of(study: Path, seed: int):
    """The seed's ``probes.seeds.study.recipe_key``, or None where no run folder is kept."""

    run = study / f"seed-{seed}"
    if not (run / "train_config.json").is_file():
        return None
    return recipe_key(saved_train_config(run))


def merge_studies(studies: list[Path], out: Path, force: bool = False) -> list[str]:
    """Merge seed studies of one recipe run in parts (other seeds later, another machine) into
    one study in ``out`` (``write_study``, all its files or none; an earlier merge's are
    replaced only with ``force``): a seed in two studies must have the same row in both, and
    where a study keeps its run folders their recipes must agree but for the seed and the
    name. Returns the ``study/seed`` entries whose recipe could not be checked."""
    rows: dict[int, dict] = {}
    where: dict[int, Path] = {}
    recipe, recipe_from, unchecked = None, None, []
    for study in studies:
        for s, row in study_rows(study).items():
            if s in rows and rows[s] != row:
                raise ValueError(f"seed {s} has different rows in {where[s]} and {study}")
            rows[s], where[s] = row, where.get(s, study)
            r = recipe_of(study, s)
            if r is None:
                unchecked.append(f"{study}/seed-{s}")
            elif recipe is None:
                recipe, recipe_from = r, f"{study}/seed-{s}"
            elif r != recipe:
                raise ValueError(
                    f"{study}/seed-{s} was trained with another recipe than {recipe_from}"
                )
    if not rows:
        raise ValueError("the studies hold no seed")
    with transaction(Path(out), STUDY_FILES, force=force) as stage:
        write_study(rows, stage)
    return unchecked


def study(
    *,
    seeds: str,
    config: str | None = None,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
    init_from: str | Path | None = None,
    device: str = "cpu",
    max_minutes: float = 0.0,
    argv: list[str] | None = None,
    bars=None,
) -> tuple[Path, pd.DataFrame]:
    """``fbt-probe seeds run``: the recipe trained on each of ``seeds`` ('0-4', '0,3,7') into
    OUT/seed-<s> (a stopped seed resumes, a finished one is kept), then measured and
    tabulated (``run_seed_study``); ``bars(label, total)`` makes progress bars. Returns the
    study folder and its table."""

    resolve_device(device)  # a bad --device fails before anything is written
    cfg = build_recipe(config=config, overrides=overrides, init_from=init_from)
    seed_list = parse_seeds(seeds)
    folder = Path(out) if out is not None else Path("runs") / f"{cfg.name}-seeds"

    def one(scfg, run, again):
        with bars(f"train {scfg.name}", scfg.steps) if bars else nullcontext() as bar:
            train(
                scfg,
                run,
                resume=again,
                progress=bar,
                argv=argv,
                device=device,
                max_minutes=max_minutes,
            )

    with claim(folder):
        table = run_seed_study(
            cfg, seed_list, folder, one, bars=(lambda label: bars(label, 1)) if bars else None
        )
    return folder, table

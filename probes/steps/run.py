"""``fbt-probe steps``: the task state while the model generates, step by step.

Each prompt of a generated-answer task (``tasks.count_steps``, ``tasks.recall_bits``) is
decoded greedily in every mode (no teacher forcing), and the residual at every depth of every
generated step is kept (``fbt_probe.kernels.generation.step_residuals``; step 0 is the prompt's last
position). Per task, mode, step and depth (``steps.csv``):

- ``probe``: a linear probe of the state that step must carry (the task's ``step_states``:
  count_steps, how many STEPs are still to come; recall_bits, the value to emit), under
  ``fit``'s protocol (nested grouped CV, intervals over groups, a constant-feature chance),
  with ``fit``'s controls (``probe_permuted``: labels permuted by group; ``probe_random_init``:
  a random-init model of the same config, decoding on its own);
- ``lens``: the logit lens, whether the residual read through the final norm and the head
  gives the oracle's word of that step; at depth ``state`` the fed-back state h_{s-1} read the
  same way;
- ``answer``: the generated word of the step against the oracle's; ``exact``: whole answers,
  by distractor count (``distractors``) and by answer length (``length``).

Counts >= 1 are pooled, as everywhere. Writes ``steps.csv``, ``steps.json`` and figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fbt_probe.kernels.generation import step_residuals
from fbt_probe.loading import random_init_like, resolve_model
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.common.cv import fit_cell, permute_by_group
from probes.common.data import load_or_generate
from probes.common.decoding import (
    by_length,
    mean_ci,
    oracle,
    prompts,
    require_words,
)
from probes.common.tables import write_json, write_table
from probes.common.work import check_data_work
from probes.steps.plot import plot_steps
from tasks import get_task, vocab
from tasks.base import POOLED
from tasks.dataset import Dataset

COLUMNS = [
    "task",
    "mode",
    "metric",
    "step",
    "depth",
    "distractors",
    "length",
    "value",
    "ci_low",
    "ci_high",
    "chance",
    "n",
]
STATE = "state"  # the depth name of the fed-back state's lens


def decode_all(
    model, ds: Dataset, rows: np.ndarray, mode: str, n_steps: int, batch_size: int, tick=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``rows`` decoded in ``mode``: generated ids (n, steps), residuals (n, steps,
    depths, d_model) and top states (n, steps, d_model), in the order of ``rows``."""
    device = next(model.parameters()).device
    names = model.depth_hooks()
    n, D = len(rows), model.cfg.d_model
    ids = np.zeros((n, n_steps), np.int64)
    resid = np.zeros((n, n_steps, len(names), D), np.float32)
    top = np.zeros((n, n_steps, D), np.float32)
    where = {int(r): i for i, r in enumerate(rows)}
    for idx in by_length(ds, rows, batch_size):
        d, res = step_residuals(model, prompts(ds, idx, device), mode, n_steps, names)
        at = [where[int(r)] for r in idx]
        ids[at] = d.tokens.cpu().numpy()
        resid[at] = np.stack([res[h].cpu().numpy() for h in names], 2)
        top[at] = d.states.cpu().numpy()
        if tick is not None:
            tick(len(idx))
    return ids, resid, top


def probe_cells(
    resid: np.ndarray,
    states: np.ndarray,
    groups: np.ndarray,
    folds: int,
    seed: int,
    metric: str,
    permute: bool = False,
) -> list[tuple[dict, tuple]]:
    """The probes to fit, one per (step, depth) of the step's state: (the row's keys, the
    arguments of ``fit_cell``). A step whose state is the same for every example (nothing to
    decode) is left out."""
    cells = []
    for s in range(states.shape[1]):
        y = states[:, s]
        if len(np.unique(y)) < 2 or len(np.unique(groups)) < folds:
            continue
        if permute:
            y = permute_by_group(y, groups, seed)
        for d in range(resid.shape[2]):
            cells.append(
                (
                    {"metric": metric, "step": s, "depth": str(d)},
                    (resid[:, s, d], y, groups, seed, folds),
                )
            )
    return cells


def fit_cells(cells, jobs: int, progress=None) -> list[dict]:
    """Every cell's probe under fit's protocol (nested grouped CV), ``jobs`` at a time."""
    from joblib import Parallel, delayed

    out = []
    chunk = max(1, len(cells) // 20)
    for i in range(0, len(cells), chunk):
        part = cells[i : i + chunk]
        res = Parallel(n_jobs=jobs)(delayed(fit_cell)(*args) for _, args in part)
        for (keys, _), r in zip(part, res, strict=True):
            out.append(
                {
                    **keys,
                    "value": r["accuracy"],
                    "ci_low": r["ci_low"],
                    "ci_high": r["ci_high"],
                    "chance": r["chance"],
                    "n": r["n_examples"],
                }
            )
        if progress is not None:
            progress(min(len(cells), i + chunk), len(cells), "steps: probes")
    return out


def lens_rows(model, resid, top, want: np.ndarray, groups, seed: int) -> list[dict]:
    """The logit lens of every step and depth (and of the fed-back state) against the
    oracle's word of the step, ``want`` (n, steps) ids."""
    import torch

    rows = []
    with torch.no_grad():
        lens = model.read_resid(torch.from_numpy(resid)).argmax(-1).numpy()  # (n, steps, depths)
        fed = model.read_state(torch.from_numpy(top)).argmax(-1).numpy()  # (n, steps)
    for s in range(want.shape[1]):
        reads = [(str(d), lens[:, s, d]) for d in range(lens.shape[2])]
        if s >= 1:
            reads.append((STATE, fed[:, s - 1]))  # what step s reads: h_{s-1}
        for depth, got in reads:
            v, lo, hi, n = mean_ci((got == want[:, s]).astype(float), groups, seed)
            rows.append(
                {
                    "metric": "lens",
                    "step": s,
                    "depth": depth,
                    "value": v,
                    "ci_low": lo,
                    "ci_high": hi,
                    "n": n,
                }
            )
    return rows


def answer_rows(ids, want, counts, lengths, groups, seed: int) -> list[dict]:
    """Each step's word, and whole answers by distractor count and by answer length."""
    rows = []
    pooled = counts >= 1
    for s in range(want.shape[1]):
        v, lo, hi, n = mean_ci(
            (ids[pooled, s] == want[pooled, s]).astype(float), groups[pooled], seed
        )
        rows.append(
            {"metric": "answer", "step": s, "value": v, "ci_low": lo, "ci_high": hi, "n": n}
        )
    exact = (ids == want).all(1).astype(float)
    cuts = [(POOLED, -1, pooled)] + [
        (str(c), -1, counts == c) for c in sorted(set(counts.tolist()))
    ]
    cuts += [(POOLED, k, pooled & (lengths == k)) for k in sorted(set(lengths.tolist()))]
    for dist, length, keep in cuts:
        v, lo, hi, n = mean_ci(exact[keep], groups[keep], seed)
        rows.append(
            {
                "metric": "exact",
                "distractors": dist,
                "length": length,
                "value": v,
                "ci_low": lo,
                "ci_high": hi,
                "n": n,
            }
        )
    return rows


def task_rows(model, control, ds: Dataset, modes, opts, tick) -> tuple[list[dict], list]:
    """Every row of ``steps.csv`` for one dataset but the probes', and the probe cells."""
    mod = get_task(ds.task)
    answers = oracle(ds)
    n_steps = len(answers[0])
    want = np.array([vocab.encode(a) for a in answers])
    counts, groups = np.asarray(ds.n_distractors), np.asarray(ds.group)
    lengths = np.array([int(mod.answer_length(a)) for a in answers])
    states = np.array([[str(x) for x in mod.step_states(a)] for a in answers])
    every, pooled = np.arange(len(ds)), counts >= 1
    out, cells = [], []
    for mode in modes:
        ids, resid, top = decode_all(model, ds, every, mode, n_steps, opts.batch_size, tick)
        rows = answer_rows(ids, want, counts, lengths, groups, opts.seed)
        rows += lens_rows(
            model, resid[pooled], top[pooled], want[pooled], groups[pooled], opts.seed
        )
        out += [{"task": ds.task, "mode": mode, **r} for r in rows]
        p = (resid[pooled], states[pooled], groups[pooled], opts.folds, opts.seed)
        found = probe_cells(*p, "probe")
        if control is not None:
            found += probe_cells(*p, "probe_permuted", permute=True)
            rand = decode_all(control, ds, every, mode, n_steps, opts.batch_size, tick)[1]
            found += probe_cells(rand[pooled], *p[1:], "probe_random_init")
        cells += [({"task": ds.task, "mode": mode, **keys}, args) for keys, args in found]
    return out, cells


def headline(df: pd.DataFrame, task: str) -> str:
    """The finding for one task: the entry-depth probe over the generated steps, by mode, with
    its random-init control, and whole answers."""
    parts = []
    for mode, g in df[df.task == task].groupby("mode", sort=False):
        pr = g[(g.metric == "probe") & (g.depth == "0") & (g.step >= 1)]
        rnd = g[(g.metric == "probe_random_init") & (g.depth == "0") & (g.step >= 1)]
        ex = g[(g.metric == "exact") & (g.distractors == POOLED) & (g.length == -1)]
        txt = (
            f"{mode}: layer-0 probe {pr.value.mean():.3f} over steps 1+" if len(pr) else f"{mode}:"
        )
        if len(rnd):
            txt += f" (random init {rnd.value.mean():.3f})"
        if len(ex):
            r = ex.iloc[0]
            txt += f", answers {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
        parts.append(txt)
    return f"**{task}**: " + "; ".join(parts)


def run(opts, progress=None) -> Result:
    """``fbt-probe steps`` (``probes.steps.options.StepsOptions``)."""
    task_list, modes = opts.tasks, opts.mode_list
    model, name = resolve_model(opts.model, resolve_device(opts.device))
    require_words(model)
    datasets = [
        load_or_generate(t, opts.data if len(task_list) == 1 else None, model) for t in task_list
    ]
    runs = len(modes) * (1 if opts.no_controls else 2)
    check_data_work(model, datasets, 1, runs, "--modes, --task")
    control = None if opts.no_controls else random_init_like(model, opts.seed)
    total, done = sum(len(ds) for ds in datasets) * runs, [0]

    def tick(k: int) -> None:
        done[0] += k
        if progress is not None:
            progress(done[0], total, "steps: decoding")

    rows, cells = [], []
    for ds in datasets:
        found = task_rows(model, control, ds, modes, opts, tick)
        rows, cells = rows + found[0], cells + found[1]
    rows += fit_cells(cells, opts.jobs, progress)
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df["step"] = df["step"].fillna(-1).astype(int)
    df["length"] = df["length"].fillna(-1).astype(int)
    df["depth"] = df["depth"].fillna("")
    df["distractors"] = df["distractors"].fillna(POOLED)
    write_table(df, opts.out / "steps.csv")
    write_json(
        {
            "model": name,
            "tasks": list(task_list),
            "modes": list(modes),
            "datasets": {ds.task: ds.content_hash for ds in datasets},
            "folds": opts.folds,
            "seed": opts.seed,
            "controls": not opts.no_controls,
        },
        opts.out / "steps.json",
    )
    figs = plot_steps(df, opts.out / "figures")
    lines = [headline(df, t) for t in task_list]
    lines.append(f"wrote {opts.out / 'steps.csv'} and {len(figs) // 2} figures")
    return Result({"steps": df}, lines)

"""``fbt-probe lens``: the logit lens and a tuned lens at every (pass, depth), and the
fed-back state read through the head, at one position of each prompt: by default the one
whose next token is the answer (the first label's first token; the colon of delayed_memory
and done_tracking).

The tasks' groups are split in two by the seed: a tuned lens is fitted on the first half's
prompts (every position after the first, every pass; ``fbt_probe.kernels.lens``) and saved in
``<out>/tuned_lens/``; every measure is taken on the other half. With ``--tuned-lens DIR``
(a saved one, checked against the model's hash) or ``--no-tuned`` nothing is fitted and every
example is measured. Writes ``lens.csv`` (one row per task, lens, read, pass, distractor
count and measure, with 95 % intervals over groups), ``lens.json`` and a heatmap of pass x
depth per task.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.kernels.lens import LensReads, RidgeStats, Translators, accumulate, lens_batch
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.common.bootstrap import N_BOOT, GroupBootstrap
from probes.common.data import load_or_generate
from probes.common.extract import length_batches, max_batch_tokens
from probes.common.prompts import answer_positions, prompts
from probes.common.tables import write_json, write_table
from probes.common.work import check_data_work
from probes.lens.options import LensOptions
from probes.lens.plot import plot_lens
from tasks.base import POOLED
from tasks.dataset import Dataset

COLUMNS = [
    "task",
    "lens",
    "read",
    "pass",
    "distractors",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "n",
]


def split_groups(ds: Dataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, measure) example indices: half the groups each, drawn by ``seed``."""
    groups = np.unique(ds.group)
    fit = set(np.random.default_rng(seed).permutation(groups)[: len(groups) // 2].tolist())
    mask = np.array([g in fit for g in ds.group.tolist()])
    return np.flatnonzero(mask), np.flatnonzero(~mask)


def fit_translators(
    model,
    sets: list[tuple[Dataset, np.ndarray]],
    passes: int,
    meta: dict,
    batch_size: int,
    progress=None,
) -> Translators:
    """Ridge translators from the prompts ``sets`` names ((dataset, example indices)); every
    prompt position but the first (a model's first position is its own kind of state)."""
    device = next(model.parameters()).device
    stats = RidgeStats(len(model.depth_hooks()), model.cfg.d_model)
    total, done = sum(len(i) for _, i in sets), 0
    for ds, chosen in sets:
        lengths = ds.colon_index + 1
        for part in length_batches(lengths[chosen], batch_size, max_batch_tokens(model)):
            idx = chosen[part]
            toks = prompts(ds, idx, lengths, device)
            t = torch.arange(toks.shape[1], device=device)[None]
            keep = (t >= 1) & (t < torch.as_tensor(lengths[idx], device=device)[:, None])
            accumulate(model, stats, toks, keep, passes)
            done += len(idx)
            if progress is not None:
                progress(done, total, "tuned lens: fitting")
    return stats.solve(meta)


def measure(
    model,
    ds: Dataset,
    idx: np.ndarray,
    where: tuple[np.ndarray, np.ndarray],
    passes: int,
    tuned: Translators | None,
    batch_size: int,
    progress=None,
) -> dict[str, LensReads]:
    """Every read of the examples ``idx`` at ``where`` (positions and answer ids, one each per
    example of ``ds``)."""
    device = next(model.parameters()).device
    lengths = np.maximum(ds.colon_index, where[0]) + 1
    parts: dict[str, list] = {}
    order: list[np.ndarray] = []  # positions in ``idx`` of each batch's examples
    for part in length_batches(lengths[idx], batch_size, max_batch_tokens(model)):
        b = idx[part]
        toks = prompts(ds, b, lengths, device)
        at, answer = (torch.as_tensor(w[b], device=device) for w in where)
        for name, r in lens_batch(model, toks, at, answer, passes, tuned).items():
            parts.setdefault(name, []).append(r)
        order.append(part)
        if progress is not None:
            progress(sum(len(o) for o in order), len(idx), f"{ds.task}: lens")
    back = np.argsort(np.concatenate(order))  # each example back to its place in ``idx``
    return {
        name: LensReads(
            rs[0].reads,
            *(np.concatenate([getattr(r, f) for r in rs])[back] for f in ("kl", "prob", "rank")),
        )
        for name, rs in parts.items()
    }


def summarise(
    task: str,
    reads: dict[str, LensReads],
    groups: np.ndarray,
    counts: np.ndarray,
    seed: int,
    n_boot: int = N_BOOT,
) -> list[dict]:
    """Rows of ``COLUMNS``: per lens, read, pass and distractor count (each, and all pooled),
    the mean KL, answer probability and top-1 rate with group-bootstrap intervals, and the
    median rank."""
    rows = []
    cells = [(POOLED, np.ones(len(groups), bool))] + [
        (str(int(c)), counts == c) for c in np.unique(counts)
    ]
    for label, mask in cells:
        boot = GroupBootstrap(groups[mask], seed, n_boot)
        for name, r in reads.items():
            for k in range(r.kl.shape[1]):
                for j, read in enumerate(r.reads):
                    kl, prob, rank = r.kl[mask, k, j], r.prob[mask, k, j], r.rank[mask, k, j]
                    if np.isnan(kl).all():
                        continue  # the fed-back state in pass 1
                    base = {
                        "task": task,
                        "lens": name,
                        "read": read,
                        "pass": k + 1,
                        "distractors": label,
                        "n": int(mask.sum()),
                    }
                    for metric, v in (
                        ("kl", kl),
                        ("answer_prob", prob),
                        ("answer_top1", (rank == 0).astype(float)),
                    ):
                        lo, hi = np.percentile(boot.mean(v), [2.5, 97.5])
                        rows.append(
                            {
                                **base,
                                "metric": metric,
                                "value": float(v.mean()),
                                "ci_low": float(lo),
                                "ci_high": float(hi),
                            }
                        )
                    rows.append(
                        {
                            **base,
                            "metric": "answer_rank",
                            "value": float(np.median(rank)),
                            "ci_low": np.nan,
                            "ci_high": np.nan,
                        }
                    )
    return rows


def headline(df: pd.DataFrame, task: str) -> str:
    """Per pass, the first depth whose logit lens puts the answer on top for most examples;
    the tuned lens at depth 0 (the fed-back input, from pass 2 on); the fed-back state's
    median rank of the answer."""
    g = df[(df.task == task) & (df.distractors == POOLED)]
    top = g[(g.metric == "answer_top1") & g.read.str.isdigit()].copy()
    top["depth"] = top.read.astype(int)
    parts = []
    for k, gk in top[top.lens == "logit"].groupby("pass"):
        hit = gk[gk.value > 0.5].sort_values("depth")
        parts.append(
            f"depth {int(hit.depth.iloc[0])} in pass {k}" if len(hit) else f"no depth of pass {k}"
        )
    line = f"{task}: the answer first tops the logit lens at " + ", ".join(parts)
    d0 = top[(top.lens == "tuned") & (top.depth == 0)].sort_values("pass")
    if len(d0):
        line += "; the tuned lens reads it at depth 0 for " + ", ".join(
            f"{r.value:.3f} in pass {r['pass']}" for _, r in d0.iterrows()
        )
    fed = g[(g.read == "fed_state") & (g.metric == "answer_rank") & (g.lens == "logit")]
    if len(fed):
        r = fed.sort_values("pass").iloc[0]
        line += f"; the fed-back state ranks it {r.value:.0f} (median, pass {r['pass']})"
    return line + "."


def _fit_on_halves(m, name, mhash, datasets, split, passes, seed, batch_size, progress):
    meta = {
        "model": name,
        "model_hash": mhash,
        "passes": passes,
        "seed": seed,
        "fitted_on": {
            t: {"dataset_hash": ds.content_hash, "n_examples": len(split[t][0])}
            for t, ds in datasets.items()
        },
    }
    return fit_translators(
        m, [(ds, split[t][0]) for t, ds in datasets.items()], passes, meta, batch_size, progress
    )


def _write(out: Path, df: pd.DataFrame, doc: dict, fitted: Translators | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if fitted is not None:
        fitted.save(out / "tuned_lens")
    write_table(df, out / "lens.csv")
    write_json(doc, out / "lens.json")


def run(options: LensOptions, progress=None) -> Result:
    """``fbt-probe lens`` (see the module docstring), on options checked before any work;
    its table and the lines it reports."""
    o, out = options, Path(options.out)
    task_list, data_map = o.tasks_and_data
    m, name = resolve_model(o.model, resolve_device(o.device))
    m.eval()
    mhash = model_hash(m)
    loaded = Translators.load(o.tuned_lens, m, mhash) if o.tuned_lens is not None else None
    datasets = {t: load_or_generate(t, (data_map or {}).get(t), m) for t in task_list}
    fitting = o.tuned and loaded is None
    check_data_work(m, datasets.values(), o.passes, 1 + fitting, "--prefill")
    where = {t: answer_positions(ds, m, o.position) for t, ds in datasets.items()}
    split = {
        t: split_groups(ds, o.seed) if fitting else (np.array([], int), np.arange(len(ds)))
        for t, ds in datasets.items()
    }
    translators = loaded if o.tuned else None
    if fitting:
        translators = _fit_on_halves(
            m, name, mhash, datasets, split, o.passes, o.seed, o.batch_size, progress
        )
    rows, lines = [], []
    for t, ds in datasets.items():
        idx = split[t][1]
        reads = measure(m, ds, idx, where[t], o.passes, translators, o.batch_size, progress)
        rows += summarise(t, reads, ds.group[idx], ds.n_distractors[idx], o.seed)
    df = pd.DataFrame(rows, columns=COLUMNS)
    doc = {
        "model": name,
        "model_hash": mhash,
        "passes": o.passes,
        "position": o.position,
        "seed": o.seed,
        "tuned_lens": None if translators is None else translators.meta,
        "datasets": {
            t: {"content_hash": ds.content_hash, "n_measured": len(split[t][1])}
            for t, ds in datasets.items()
        },
    }
    _write(out, df, doc, translators if fitting else None)
    for t in datasets:
        plot_lens(df, t, out / "figures")
        lines.append(headline(df, t))
    lines.append(
        f"wrote {out / 'lens.csv'} ({len(df)} rows) and figures in {out / 'figures'}"
        + (f"; the tuned lens in {out / 'tuned_lens'}" if fitting else "")
    )
    return Result({"lens": df}, lines)

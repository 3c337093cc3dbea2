"""``fbt-probe loop``: closed-loop interventions while the model generates.

Every example of a twin dataset of a generated-answer task is decoded greedily, and so is its
twin (``generate --twins``: the same words but the one that changes one answer word). Then, at
each generated step s, what the step reads is swapped for what the twin's step s read
(``fbt_probe.kernels.generation.closed_loop``: the fed-back state h_{s-1}, the embedding of token
s - 1, or both), and the model keeps generating on its own. Per task, mode, kind and step
(``loop.csv``, intervals over groups):

- ``follows_example`` / ``follows_twin`` / ``follows_neither``: whether the tokens from s on are
  the example's own, the twin's, or neither, over the pairs whose own generations differ from
  s on (``informative``: their share of all pairs);
- ``diverged``: the share whose tokens differ from the example's anywhere from s on, and
  ``divergence_step``: the first step where they do (over those that diverge);
- by later step t (``later_step``): ``diverged_by`` (the divergence curve: the share diverged
  at or before t) and ``logit_diff``, the normalised logit difference between the example's
  and the twin's token at t (1 = the example's run, 0 = the twin's), where the two differ;
- ``clean_accuracy`` / ``twin_accuracy``: the generations against the oracle's answers.

Counts >= 1 only. Writes ``loop.csv``, ``loop.json`` and a figure per task.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from fbt_probe.kernels.generation import closed_loop
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
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
from probes.loop.plot import plot_loop
from tasks import vocab
from tasks.dataset import Dataset

COLUMNS = [
    "task",
    "mode",
    "kind",
    "step",
    "later_step",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "n",
]
FOLLOWS = ("example", "twin", "neither")


def pair_measures(r, kind: str, s: int) -> dict:
    """Per pair of one batch, for the swap of ``kind`` at step ``s``: which run the tokens from
    s on follow, the first divergent step and the normalised logit difference at each step."""
    clean, twin, got = r.clean.tokens, r.twin.tokens, r.tokens[kind, s]
    rest = slice(s, None)
    same_c = (got[:, rest] == clean[:, rest]).all(1)
    same_t = (got[:, rest] == twin[:, rest]).all(1)
    differs = got != clean
    differs[:, :s] = False
    first = torch.where(differs.any(1), differs.float().argmax(1), torch.full_like(clean[:, 0], -1))
    ld = lambda x: x[..., 0] - x[..., 1]  # noqa: E731 (logit of the example's token minus the twin's)
    lc, lt, lp = ld(r.pair_logits[None]), ld(r.pair_logits["twin"]), ld(r.pair_logits[kind, s])
    ok = (clean != twin) & ((lc - lt).abs() > 1e-6)
    norm = torch.where(ok, (lp - lt) / torch.where(ok, lc - lt, torch.ones_like(lc)), torch.nan)
    norm[:, :s] = torch.nan
    return {
        "informative": (clean[:, rest] != twin[:, rest]).any(1).numpy(),
        "example": same_c.numpy(),
        "twin": same_t.numpy() & ~same_c.numpy(),
        "first": first.numpy(),
        "logit_diff": norm.numpy(),
    }


def battery(
    model, ds: Dataset, rows: np.ndarray, mode: str, kinds, n_steps: int, batch_size: int, tick=None
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Every pair of ``rows`` through ``closed_loop``: {(kind, s): measures over the rows, in
    order}, and the example's and the twin's own generations (n, steps)."""
    device = next(model.parameters()).device
    parts: dict = {}
    clean, twin, order = [], [], []
    for idx in by_length(ds, rows, batch_size):
        r = closed_loop(
            model,
            prompts(ds, idx, device),
            prompts(ds, idx, device, twin=True),
            mode,
            n_steps,
            kinds,
        )
        for kind in kinds:
            for s in r.steps:
                parts.setdefault((kind, s), []).append(pair_measures(r, kind, s))
        clean.append(r.clean.tokens.numpy())
        twin.append(r.twin.tokens.numpy())
        order.append(idx)
        if tick is not None:
            tick(len(idx))
    back = np.argsort(np.concatenate(order))  # batches are by length: put rows back in order
    joined = {
        k: {m: np.concatenate([p[m] for p in v])[back] for m in v[0]} for k, v in parts.items()
    }
    return joined, np.concatenate(clean)[back], np.concatenate(twin)[back]


def measure_rows(m: dict, s: int, n_steps: int, groups: np.ndarray, seed: int) -> list[dict]:
    """The rows of one (kind, step): follows, divergence and the curves by later step."""
    info = m["informative"]
    rows = [{"metric": "informative", **_ci(info.astype(float), groups, seed)}]
    for f in FOLLOWS:
        v = m[f] if f != "neither" else ~(m["example"] | m["twin"])
        rows.append({"metric": f"follows_{f}", **_ci(np.where(info, v, np.nan), groups, seed)})
    div = m["first"] >= 0
    rows.append({"metric": "diverged", **_ci(div.astype(float), groups, seed)})
    rows.append(
        {
            "metric": "divergence_step",
            **_ci(np.where(div, m["first"], np.nan).astype(float), groups, seed),
        }
    )
    for t in range(s, n_steps):
        by_t = (div & (m["first"] <= t)).astype(float)
        rows.append({"metric": "diverged_by", "later_step": t, **_ci(by_t, groups, seed)})
        rows.append(
            {"metric": "logit_diff", "later_step": t, **_ci(m["logit_diff"][:, t], groups, seed)}
        )
    return rows


def _ci(values: np.ndarray, groups: np.ndarray, seed: int) -> dict:
    v, lo, hi, n = mean_ci(np.asarray(values, dtype=float), groups, seed)
    return {"value": v, "ci_low": lo, "ci_high": hi, "n": n}


def pair_rows(ds: Dataset) -> np.ndarray:
    """The rows that have a twin, at 1 or more distractors."""
    rows = np.flatnonzero((np.asarray(ds.twin_target) >= 0) & (np.asarray(ds.n_distractors) >= 1))
    if len(rows) == 0:
        raise ValueError(f"{ds.task}: the dataset has no pairs with 1 or more distractors")
    return rows


def task_rows(model, ds: Dataset, modes, kinds, opts, tick) -> list[dict]:
    """Every row of ``loop.csv`` for one twin dataset."""
    answers = oracle(ds)
    n_steps = len(answers[0])
    rows = pair_rows(ds)
    groups = np.asarray(ds.group)[rows]
    want = np.array([vocab.encode(answers[i]) for i in rows])
    want_twin = np.array([vocab.encode(ds.twin_labels[i]) for i in rows])
    out = []
    for mode in modes:
        measures, clean, twin = battery(
            model, ds, rows, mode, kinds, n_steps, opts.batch_size, tick
        )
        found = [
            {
                "kind": "none",
                "metric": "clean_accuracy",
                **_ci((clean == want).all(1), groups, opts.seed),
            },
            {
                "kind": "none",
                "metric": "twin_accuracy",
                **_ci((twin == want_twin).all(1), groups, opts.seed),
            },
        ]
        for (kind, s), m in measures.items():
            found += [
                {"kind": kind, "step": s, **r}
                for r in measure_rows(m, s, n_steps, groups, opts.seed)
            ]
        out += [{"task": ds.task, "mode": mode, **r} for r in found]
    return out


def headline(df: pd.DataFrame, task: str) -> str:
    """The finding for one task: after a swap at step 1, how often the rest of the answer
    follows the twin, by mode and kind."""
    parts = []
    for mode, g in df[df.task == task].groupby("mode", sort=False):
        f = g[(g.metric == "follows_twin") & (g.step == 1)]
        acc = g[g.metric == "clean_accuracy"]
        bits = [f"{r.kind} {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]" for r in f.itertuples()]
        clean = f" (answers {acc.value.iloc[0]:.3f})" if len(acc) else ""
        parts.append(f"{mode}{clean}: " + ", ".join(bits))
    return f"**{task}**, share following the twin after a swap at step 1: " + "; ".join(parts)


def run(opts, progress=None) -> Result:
    """``fbt-probe loop`` (``probes.loop.options.LoopOptions``)."""
    task_list, modes, kinds = opts.tasks, opts.mode_list, opts.kind_list
    model, name = resolve_model(opts.model, resolve_device(opts.device))
    require_words(model)
    datasets = [
        load_or_generate(t, opts.data if len(task_list) == 1 else None, model, twins=True)
        for t in task_list
    ]
    check_data_work(model, datasets, 2, len(modes), "--modes, --task")
    total, done = sum(len(pair_rows(ds)) for ds in datasets) * len(modes), [0]

    def tick(k: int) -> None:
        done[0] += k
        if progress is not None:
            progress(done[0], total, "loop: generating")

    rows = [r for ds in datasets for r in task_rows(model, ds, modes, kinds, opts, tick)]
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df["step"] = df["step"].fillna(-1).astype(int)
    df["later_step"] = df["later_step"].fillna(-1).astype(int)
    write_table(df, opts.out / "loop.csv")
    write_json(
        {
            "model": name,
            "tasks": list(task_list),
            "modes": list(modes),
            "kinds": list(kinds),
            "datasets": {ds.task: ds.content_hash for ds in datasets},
            "seed": opts.seed,
        },
        opts.out / "loop.json",
    )
    figs = plot_loop(df, opts.out / "figures")
    lines = [headline(df, t) for t in task_list]
    lines.append(f"wrote {opts.out / 'loop.csv'} and {len(figs) // 2} figures")
    return Result({"loop": df}, lines)

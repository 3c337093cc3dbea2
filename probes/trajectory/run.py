"""``fbt-probe trajectory``: how the states move over Jacobi passes 1..K, per task.

- ``convergence``: ||h^(k) - h^(K)|| / ||h^(K)|| by pass and position, counted back from the
  position whose next token is the answer (``from_answer`` 0; ``probes.lens.run
  .answer_positions``), mean over examples;
- ``accuracy`` and ``flip_rate``: the answer as the top token at that position in each pass,
  and how many examples change their top token from pass k - 1 to pass k, by distractor count;
- ``gate``: the fusion's gate sigma(W_G e_t), mean over its width, by token class: the
  label-bearing token (where the counterfactual twin differs), the colon, distractors (the
  built-in vocabulary's; a tokenizer's are counted as other words) and the other prompt words;
- ``trajectory_pca.csv``: the read position's states of every pass on the first two
  principal components (fitted on all passes together), with each example's label.

Writes ``trajectory.csv``, ``trajectory_pca.csv``, ``trajectory.json`` and one figure per task.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fbt_probe.kernels.trajectory import distance_to_last, pass_states, pca_2d
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.common.bootstrap import N_BOOT, GroupBootstrap
from probes.common.data import load_or_generate
from probes.common.extract import length_batches, max_batch_tokens
from probes.common.prompts import answer_positions, prompts
from probes.common.tables import write_json, write_table
from probes.common.work import check_data_work
from probes.trajectory.options import TrajectoryOptions
from probes.trajectory.plot import plot_trajectory
from tasks import vocab
from tasks.base import POOLED
from tasks.dataset import Dataset

COLUMNS = [
    "task",
    "metric",
    "pass",
    "from_answer",
    "distractors",
    "token_class",
    "value",
    "ci_low",
    "ci_high",
    "n",
]
WINDOW = 32  # positions before the read one shown in the convergence map
CLASSES = ("label-bearing", "colon", "distractor", "other")


def token_classes(ds: Dataset, i: int, built_in: bool) -> np.ndarray:
    """(prompt length,) the class index (``CLASSES``) of each prompt position of example i;
    -1 for the first position (no feedback enters there)."""
    c = int(ds.colon_index[i])
    ids = np.asarray(ds.token_ids[i][: c + 1])
    cls = np.full(c + 1, CLASSES.index("other"))
    if built_in:
        cls[np.isin(ids, vocab.DISTRACTOR_IDS)] = CLASSES.index("distractor")
    if ds.has_twins and ds.twin_target[i] >= 0:
        cls[int(ds.twin_position[i])] = CLASSES.index("label-bearing")
    cls[c] = CLASSES.index("colon")
    cls[0] = -1
    return cls


def collect(model, ds: Dataset, passes: int, batch_size: int, progress=None) -> dict:
    """Per example of ``ds``: distances to the last pass over the window, the top token at
    the read position in each pass, the read position's states and the gates by class."""
    device = next(model.parameters()).device
    at, answer = answer_positions(ds, model, "answer")
    lengths = np.maximum(ds.colon_index, at) + 1
    n = len(ds)
    dist = np.full((n, passes, WINDOW + 1), np.nan)
    top = np.zeros((n, passes), np.int64)
    read = np.zeros((n, passes, model.cfg.d_model), np.float32)
    gates: list[list[float]] = [[] for _ in CLASSES]
    built_in = getattr(model, "encoding", None) is None
    done = 0
    for idx in length_batches(lengths, batch_size, max_batch_tokens(model)):
        toks = prompts(ds, idx, lengths, device)
        ps = pass_states(model, toks, torch.as_tensor(lengths[idx], device=device), passes)
        d = distance_to_last(ps.states).cpu().numpy()  # (passes, b, T)
        rows = torch.arange(len(idx), device=device)
        pos = torch.as_tensor(at[idx], device=device)
        for k, p in enumerate(ps.out.passes):
            top[idx, k] = p.logits_at(rows, pos).argmax(-1).cpu().numpy()
            read[idx, k] = p.states[rows, pos].float().cpu().numpy()
        for j, i in enumerate(idx):
            lo = max(0, at[i] - WINDOW)
            w = int(at[i] - lo) + 1
            dist[i, :, WINDOW + 1 - w :] = d[:, j, lo : at[i] + 1]
            if ps.gate is not None:
                g = ps.gate[j].cpu().numpy()
                for c, v in zip(
                    token_classes(ds, i, built_in), g[: int(ds.colon_index[i]) + 1], strict=True
                ):
                    if c >= 0:
                        gates[c].append(float(v))
        done += len(idx)
        if progress is not None:
            progress(done, n, f"{ds.task}: trajectory")
    return {
        "dist": dist,
        "correct": top == answer[:, None],
        "top": top,
        "read": read,
        "gates": gates,
    }


def _mean_ci(v: np.ndarray, boot: GroupBootstrap) -> tuple[float, float, float]:
    lo, hi = np.percentile(boot.mean(v), [2.5, 97.5])
    return float(v.mean()), float(lo), float(hi)


def summarise(task: str, ds: Dataset, got: dict, seed: int, n_boot: int = N_BOOT) -> list[dict]:
    """Rows of ``COLUMNS`` (see the module docstring)."""
    rows = []
    base = dict.fromkeys(COLUMNS)
    passes = got["dist"].shape[1]
    for k in range(passes):
        for o in range(WINDOW + 1):
            v = got["dist"][:, k, o]
            v = v[~np.isnan(v)]
            if len(v):
                rows.append(
                    {
                        **base,
                        "task": task,
                        "metric": "convergence",
                        "pass": k + 1,
                        "from_answer": o - WINDOW,
                        "value": float(v.mean()),
                        "n": len(v),
                    }
                )
    counts = ds.n_distractors
    cells = [(POOLED, np.ones(len(ds), bool))] + [
        (str(int(c)), counts == c) for c in np.unique(counts)
    ]
    for label, mask in cells:
        boot = GroupBootstrap(ds.group[mask], seed, n_boot)
        for k in range(passes):
            acc = got["correct"][mask, k].astype(float)
            cell = {**base, "task": task, "pass": k + 1, "distractors": label, "n": int(mask.sum())}
            rows.append({**cell, "metric": "accuracy", **_vals(_mean_ci(acc, boot))})
            if k:
                flip = (got["top"][mask, k] != got["top"][mask, k - 1]).astype(float)
                rows.append({**cell, "metric": "flip_rate", **_vals(_mean_ci(flip, boot))})
    for c, vals in zip(CLASSES, got["gates"], strict=True):
        if vals:
            v = np.asarray(vals)
            rows.append(
                {
                    **base,
                    "task": task,
                    "metric": "gate",
                    "token_class": c,
                    "value": float(v.mean()),
                    "ci_low": float(np.percentile(v, 2.5)),
                    "ci_high": float(np.percentile(v, 97.5)),
                    "n": len(v),
                }
            )
    return rows


def _vals(t: tuple[float, float, float]) -> dict:
    return dict(zip(("value", "ci_low", "ci_high"), t, strict=True))


def pca_rows(task: str, ds: Dataset, read: np.ndarray) -> tuple[pd.DataFrame, list[float]]:
    n, passes, d = read.shape
    xy, var = pca_2d(torch.from_numpy(read.reshape(n * passes, d)))
    xy = xy.numpy().reshape(n, passes, 2)
    df = pd.DataFrame(
        {
            "task": task,
            "example": np.repeat(np.arange(n), passes),
            "pass": np.tile(np.arange(1, passes + 1), n),
            "label": np.repeat([lab[0] for lab in ds.labels], passes),
            "pc1": xy[..., 0].ravel(),
            "pc2": xy[..., 1].ravel(),
        }
    )
    return df, [float(x) for x in var]


def headline(df: pd.DataFrame, task: str) -> str:
    g = df[df.task == task]
    acc = g[(g.metric == "accuracy") & (g.distractors == POOLED)].sort_values("pass")
    flips = g[(g.metric == "flip_rate") & (g.distractors == POOLED)].sort_values("pass")
    conv = g[(g.metric == "convergence") & (g.from_answer == 0)].sort_values("pass")
    line = (
        f"{task}: answer top-1 by pass "
        + " / ".join(f"{v:.3f}" for v in acc.value)
        + "; flips pass 1->2 "
        + (f"{flips.value.iloc[0]:.3f}" if len(flips) else "-")
    )
    if len(conv) > 2:
        line += (
            f"; distance to pass {len(conv)} at the read position: pass 2 "
            f"{conv.value.iloc[1]:.3g}, pass {len(conv) - 1} {conv.value.iloc[-2]:.3g}"
        )
    gates = g[g.metric == "gate"]
    if len(gates):
        line += "; mean gate " + ", ".join(
            f"{r.token_class} {r.value:.3f}" for _, r in gates.iterrows()
        )
    return line + "."


def run(options: TrajectoryOptions, progress=None) -> Result:
    """``fbt-probe trajectory`` (see the module docstring), on options checked before any
    work; its table and the lines it reports."""
    o, out = options, Path(options.out)
    task_list, data_map = o.tasks_and_data
    m, name = resolve_model(o.model, resolve_device(o.device))
    m.eval()
    rows, pcas, var, lines = [], [], {}, []
    datasets = {
        t: load_or_generate(t, (data_map or {}).get(t), m, twins=o.data is None) for t in task_list
    }
    check_data_work(m, datasets.values(), o.passes, 1, "--prefill")
    for t, ds in datasets.items():
        got = collect(m, ds, o.passes, o.batch_size, progress)
        rows += summarise(t, ds, got, o.seed)
        p, var[t] = pca_rows(t, ds, got["read"])
        pcas.append(p)
    df, pca = pd.DataFrame(rows, columns=COLUMNS), pd.concat(pcas, ignore_index=True)
    df = df.astype({"pass": "Int64", "from_answer": "Int64", "n": "Int64"})
    out.mkdir(parents=True, exist_ok=True)
    write_table(df, out / "trajectory.csv")
    write_table(pca, out / "trajectory_pca.csv")
    write_json(
        {"model": name, "passes": o.passes, "seed": o.seed, "pca_variance": var},
        out / "trajectory.json",
    )
    for t in task_list:
        plot_trajectory(df, pca, t, out / "figures")
        lines.append(headline(df, t))
    lines.append(
        f"wrote {out / 'trajectory.csv'} ({len(df)} rows), trajectory_pca.csv and figures in {out / 'figures'}"
    )
    return Result({"trajectory": df}, lines)

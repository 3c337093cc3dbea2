"""Which done_tracking prompts does the layer-0 probe at the colon get wrong?

Fits the probe of `fbt-probe fit` (the same grouped folds and nested choice of C, pooled over
counts 1..256) on one depth under one prefill, and tabulates its out-of-fold errors by the
distractor count n, the required steps k, s - k (s STEP events; the label is DONE iff
s >= k) and how many tokens before the colon the last STEP sits. With ``--probe mlp`` it
asks whether a nonlinear probe finds what the linear one misses.

    python research/probe_errors.py runs/seeds-X/seed0 --groups 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from fbt_probe.loading import resolve_model
from fbt_probe.prefill import parse_prefill
from probes.common.cv import N_FOLDS, cross_validate, grouped_splits
from probes.common.extract import RESID, extract_features
from probes.common.probe import probe_class
from probes.fit.run import Cell, cell_data, targets_of
from tasks import vocab
from tasks.dataset import load
from tasks.generate import generate_dataset

GAPS = ((0, 0), (1, 3), (4, 15), (16, 63), (64, 10**6))


def prompt_facts(tokens: np.ndarray, colon: int) -> tuple[int, int, int]:
    """(k, s, gap) of one done_tracking prompt: required steps, STEP events, and tokens
    between the last STEP and the colon (-1 when there is none)."""
    t = np.asarray(tokens[:colon])
    k = vocab.COUNTS.index(vocab.TOKENS[int(t[2])]) + 1
    steps = np.flatnonzero(t == vocab.TOKEN_TO_ID[vocab.STEP])
    gap = int(colon - 1 - steps[-1]) if len(steps) else -1
    return k, len(steps), gap


def probe_errors(model, ds, prefill="recurrent", depth=0, probe="logistic", seed=0, folds=N_FOLDS):
    """``{"accuracy", "n", "k", "s", "gap", "correct"}`` over the pooled rows (n >= 1),
    ``correct`` out of fold; the accuracy is fit's pooled cell for that depth."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    warnings.filterwarnings("ignore", category=ConvergenceWarning)  # as fit does
    if ds.task != "done_tracking":
        raise ValueError(f"the dataset is {ds.task}, not done_tracking")
    feats = extract_features(model, ds, prefill)
    cell = Cell(ds.task, "label", RESID, prefill, depth)  # fit's pooled cell: counts 1..256
    X, y, g = cell_data(cell, ds, targets_of(ds), feats, seed)
    res = cross_validate(X, y, grouped_splits(y, g, folds, seed), groups=g, probe=probe)
    m = ds.n_distractors >= 1  # the rows cell_data keeps, in order
    facts = np.array([prompt_facts(ds.token_ids[i], ds.colon_index[i]) for i in np.flatnonzero(m)])
    return {
        "accuracy": res.accuracy,
        "n": ds.n_distractors[m],
        "k": facts[:, 0],
        "s": facts[:, 1],
        "gap": facts[:, 2],
        "correct": res.correct,
    }


def table(r: dict, long_from: int = 64) -> str:
    """Markdown: errors by count, then (counts >= long_from) by k, s - k and the gap."""
    wrong = ~r["correct"]
    lines = ["| rows | examples | errors | error rate |", "|---|---|---|---|"]

    def row(name, sel):
        if sel.any():
            lines.append(f"| {name} | {sel.sum()} | {wrong[sel].sum()} | {wrong[sel].mean():.3f} |")

    for n in np.unique(r["n"]):
        row(f"n = {n}", r["n"] == n)
    long = r["n"] >= long_from
    for k in np.unique(r["k"]):
        row(f"n >= {long_from}, k = {k}", long & (r["k"] == k))
    for d in np.unique(r["s"] - r["k"]):
        row(f"n >= {long_from}, s - k = {d}", long & (r["s"] - r["k"] == d))
    for lo, hi in GAPS:
        span = f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**6 else f">= {lo}")
        row(
            f"n >= {long_from}, last STEP {span} before the colon",
            long & (r["gap"] >= lo) & (r["gap"] <= hi),
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="'default' or a model/run folder")
    ap.add_argument("--groups", type=int, default=128, help="probe dataset groups (fit's: 128)")
    ap.add_argument("--prefill", default="recurrent")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--probe", default="logistic", help="logistic or mlp")
    a = ap.parse_args(argv)
    try:
        probe_class(a.probe)
        parse_prefill(a.prefill)
        model, _ = resolve_model(a.model)
        if not 0 <= a.depth <= model.cfg.n_layers:
            raise ValueError(f"--depth {a.depth}: the model has depths 0..{model.cfg.n_layers}")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "done_tracking.parquet"
            generate_dataset("done_tracking", path, n_groups=a.groups)
            r = probe_errors(model, load(path), a.prefill, a.depth, a.probe)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"done_tracking, depth {a.depth}, {a.prefill} prefill, {a.probe} probe: "
        f"accuracy {r['accuracy']:.4f} on {len(r['n'])} prompts"
    )
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

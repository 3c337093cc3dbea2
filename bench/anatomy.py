"""Anatomy benchmark: what ``lens`` and ``trajectory`` cost against one feature extraction
over the same passes and examples (goal: at most 1.5x each).

- lens: the logit and tuned lenses and the fed-back state's reads at every (pass, depth) of
  K = 3 passes, against ``extract_features`` at prefill k3 (the same 3 passes); fitting the
  tuned lens, a one-off per model, is timed apart;
- trajectory: K = 8 passes with every position's states, the gate and the answer's top token,
  against ``extract_features`` at prefill k8.

Run: .venv/bin/python -m bench.anatomy [--model DIR]   (prints a table, writes bench/anatomy.json;
with --model, bench/anatomy_<folder name>.json)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from bench.common import best_of, machine, table, write_json
from fbt_probe.registry import resolve_model
from probes.extract import extract_features
from probes.lens_run import answer_positions, fit_translators, measure
from probes.trajectory_run import collect
from tasks.dataset import load
from tasks.generate import generate_dataset

COUNTS = (1, 4, 16, 64)
GOAL = 1.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--n-groups", type=int, default=64)
    args = ap.parse_args()
    model, name = resolve_model(args.model)
    model.eval()
    enc = getattr(model, "encoding", None)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate_dataset("delayed_memory", Path(tmp) / "dm.parquet", n_groups=args.n_groups,
                                distractors=COUNTS, seed=99,
                                tokenizer=None if enc is None else enc.source)  # fmt: skip
        ds = load(path)
    idx, where = np.arange(len(ds)), answer_positions(ds, model, "answer")
    reps = 3 if enc is None else 1
    ex3 = best_of(lambda: extract_features(model, ds, "k3", batch_size=64), repeats=reps)
    fit_s = best_of(lambda: fit_translators(model, [(ds, idx)], 3, {}, 64), repeats=1, warmup=0)
    tuned = fit_translators(model, [(ds, idx)], 3, {}, 64)
    logit = best_of(lambda: measure(model, ds, idx, where, 3, None, 64), repeats=reps)
    both = best_of(lambda: measure(model, ds, idx, where, 3, tuned, 64), repeats=reps)
    ex8 = best_of(lambda: extract_features(model, ds, "k8", batch_size=64), repeats=reps)
    traj = best_of(lambda: collect(model, ds, 8, 64), repeats=reps)
    rows = [
        {"what": "extract, 3 passes", "seconds": round(ex3, 3), "ratio": 1.0},
        {"what": "lens: logit lens + fed-back reads", "seconds": round(logit, 3), "ratio": round(logit / ex3, 2)},
        {"what": "lens: logit + tuned lens + fed-back reads", "seconds": round(both, 3), "ratio": round(both / ex3, 2)},
        {"what": "lens: fitting the tuned lens (once per model)", "seconds": round(fit_s, 3), "ratio": round(fit_s / ex3, 2)},
        {"what": "extract, 8 passes", "seconds": round(ex8, 3), "ratio": 1.0},
        {"what": "trajectory, 8 passes", "seconds": round(traj, 3), "ratio": round(traj / ex8, 2)},
    ]  # fmt: skip
    print(f"model {name}; delayed_memory, {len(ds)} examples (counts {COUNTS}); goal <= {GOAL}x")
    print(table(rows, ["what", "seconds", "ratio"]))
    stem = "anatomy" if args.model == "default" else f"anatomy_{Path(args.model).name}"
    out = write_json(stem, {"model": name, "examples": len(ds), "goal": GOAL, "rows": rows,
                            "machine": machine()})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Probe benchmark: extract + fit the whole grid (3 tasks x 3 prefills x (L+1) depths x 5 folds,
1024 examples per task), its peak memory, and recurrent-over-standard extraction time.

Run: .venv/bin/python -m bench.probe [--model DIR]   (prints a table, writes bench/probe.json)
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import best_of, machine, table, write_json
from fbt_probe.loading import resolve_model
from probes.common.extract import extract_features
from probes.fit.run import fit_protocol
from tasks import TASK_NAMES
from tasks.dataset import load
from tasks.generate import generate_dataset

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)  # 128 groups x 8 counts = 1024 examples per task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    model, name = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        data = {}
        for t in TASK_NAMES:
            data[t] = Path(tmp) / f"{t}.parquet"
            generate_dataset(t, data[t], n_groups=128, distractors=COUNTS, seed=99)
        ds = load(data["delayed_memory"])
        t_std = best_of(lambda: extract_features(model, ds, "standard"), repeats=2)
        t_rec = best_of(lambda: extract_features(model, ds, "recurrent"), repeats=2)
        t_full = best_of(lambda: extract_features(model, ds, "full"), repeats=1, warmup=0)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        df = fit_protocol(
            model,
            name,
            TASK_NAMES,
            ("standard", "recurrent", "full"),
            data,
            Path(tmp) / "res",
            controls=False,
            per_count=False,
            cache_dir=None,
        )
        grid_s = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = [
        {"what": "extract standard (1024 ex)", "seconds": round(t_std, 2)},
        {"what": "extract recurrent (1024 ex)", "seconds": round(t_rec, 2)},
        {"what": "extract full recurrence (1024 ex)", "seconds": round(t_full, 2)},
        {"what": "recurrent / standard (ideal 2.0)", "seconds": round(t_rec / t_std, 2)},
        {
            "what": f"whole grid: extract+fit, {len(df)} cells x 5 folds",
            "seconds": round(grid_s, 1),
        },
        {"what": "peak RSS (MB)", "seconds": round(max(rss0, rss1) / 1024)},
    ]
    print(
        f"model {name}; 3 tasks x 3 prefills x {model.cfg.n_layers + 1} depths, nested grouped CV, 1024 examples per task"
    )
    print(table(rows, ["what", "seconds"]))
    out = write_json(
        "probe",
        {
            "machine": machine(),
            "model": name,
            "extract_standard_s": t_std,
            "extract_recurrent_s": t_rec,
            "extract_full_s": t_full,
            "recurrent_over_standard": t_rec / t_std,
            "grid_seconds": grid_s,
            "grid_cells": len(df),
            "peak_rss_mb": max(rss0, rss1) / 1024,
            "mean_layer0_recurrent": float(
                np.mean(df[(df.depth == 0) & (df.prefill == "recurrent")].accuracy)
            ),
        },
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

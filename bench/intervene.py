"""Intervention benchmark: the cost of the default battery (``fbt-probe intervene``, recurrent
prefill) per task, and of the exact-recurrence battery on done_tracking, in units of one
standard-prefill extraction of the same dataset, measured in the same run. Goal: <= 40.

Run: .venv/bin/python -m bench.intervene [--model DIR]   (prints a table, writes
bench/intervene.json)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import best_of, machine, table, write_json
from fbt_probe.loading import resolve_model
from probes.common.extract import extract_features
from probes.intervene.run import run_battery
from tasks.dataset import load
from tasks.generate import DEFAULT_SEED, generate_dataset

CELLS = (
    ("delayed_memory", "recurrent"),
    ("done_tracking", "recurrent"),
    ("multi_register", "recurrent"),
    ("done_tracking", "full"),
)
GOAL = 40.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    model, name = resolve_model(args.model)
    rows, cells = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = {}
        for task, prefill in CELLS:
            if task not in data:  # the default twin dataset: 128 groups x 10 counts
                path = Path(tmp) / f"{task}.parquet"
                generate_dataset(task, path, seed=DEFAULT_SEED, twins=True)
                data[task] = load(path)
            ds = data[task]
            unit = best_of(lambda ds=ds: extract_features(model, ds, "standard"), repeats=2)
            t0 = time.perf_counter()
            _, pairs, info = run_battery(model, ds, prefill, cache_dir=None)
            battery = time.perf_counter() - t0
            ratio = battery / unit
            rows.append(
                {
                    "battery": f"{task} {prefill}",
                    "examples": f"{len(ds)} ({info['n_pairs']} with twins)",
                    "patched runs": info["patched_runs"],
                    "unit (s)": round(unit, 2),
                    "battery (s)": round(battery, 1),
                    "units": round(ratio, 1),
                    "goal": "met" if ratio <= GOAL else "missed",
                }
            )
            cells.append(
                {
                    "task": task,
                    "prefill": prefill,
                    "n_examples": len(ds),
                    "n_pairs": info["n_pairs"],
                    "patched_runs": info["patched_runs"],
                    "standard_extraction_s": unit,
                    "battery_s": battery,
                    "units": ratio,
                    "seconds": info["seconds"],
                }
            )
    print(f"model {name}; unit = one standard-prefill extraction of the same dataset")
    print(table(rows, list(rows[0])))
    out = write_json(
        "intervene", {"machine": machine(), "model": name, "goal_units": GOAL, "cells": cells}
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

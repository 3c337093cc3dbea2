"""Closed-loop benchmark: what ``fbt-probe loop``'s battery (``fbt_probe.kernels.generation
.closed_loop``) costs against generating each example once per intervention.

On the same batches of twins of a generated-answer task, for each decoding mode:
- the reference: every intervention (kind x step s) as a user would run it with hooks alone,
  one whole ``decode`` of the example per intervention (prompt prefill and every step);
- the battery: the example and its twin decoded once, then each intervention re-runs only
  steps s .. S-1 from the clean run's KV cache.
Goal: the battery costs at most 1.5x the reference (it should cost far less: the prompt's
prefill runs once instead of once per intervention).

Run: .venv/bin/python -m bench.loop [--model NAME] [--task count_steps]   (prints the table,
writes bench/loop.json)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.common import best_of, machine, table, write_json
from fbt_probe.decode import decode
from fbt_probe.hooks import at
from fbt_probe.kernels.generation import KINDS, SITES, closed_loop
from fbt_probe.loading import resolve_model
from probes.common.decoding import by_length, prompts
from tasks.dataset import load
from tasks.generate import generate_dataset

GOAL = 1.5


def one_per_intervention(model, p, q, mode: str, n_steps: int) -> None:
    """Every intervention of the battery, each a whole decoding of the example with hooks."""
    twin = decode(model, q, mode, n_steps)
    emb = model.embed(twin.tokens)
    swap = {"fusion.hook_state": twin.states, "hook_embed": emb}
    for kind in KINDS:
        for s in range(1, n_steps):
            hooks = [
                (site, at(lambda x, hook, v=swap[site][:, s - 1 : s]: v, decode_steps=s))
                for site in SITES[kind]
            ]
            decode(model, p, mode, n_steps, fwd_hooks=hooks, keep_logits=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="generation")
    ap.add_argument("--task", default="count_steps")
    ap.add_argument("--counts", default="16,64,256", help="distractor counts of the batches")
    args = ap.parse_args(argv)
    model = resolve_model(args.model)[0].eval()
    counts = tuple(int(c) for c in args.counts.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = generate_dataset(
            args.task, Path(tmp) / "d.parquet", n_groups=32, distractors=counts, seed=11, twins=True
        )
        ds = load(path)
        n_steps = len(ds.labels[0])
        for idx in by_length(ds, np.arange(len(ds)), 32):
            p, q = prompts(ds, idx, "cpu"), prompts(ds, idx, "cpu", twin=True)
            for mode in ("standard", "soft", "fused"):
                ref = best_of(
                    lambda p=p, q=q, m=mode: one_per_intervention(model, p, q, m, n_steps),
                    repeats=2,
                )
                bat = best_of(
                    lambda p=p, q=q, m=mode: closed_loop(model, p, q, m, n_steps), repeats=2
                )
                rows.append(
                    {
                        "prompt": p.shape[1],
                        "mode": mode,
                        "batch": len(idx),
                        "interventions": len(KINDS) * (n_steps - 1),
                        "reference_s": round(ref, 3),
                        "battery_s": round(bat, 3),
                        "ratio": round(bat / ref, 3),
                    }
                )
    worst = max(r["ratio"] for r in rows)
    print(table(rows, list(rows[0])))
    print(f"\nworst ratio {worst:.3f} (goal: at most {GOAL}x generating once per intervention)")
    doc = {
        "model": args.model,
        "task": args.task,
        "steps": n_steps,
        "rows": rows,
        "worst_ratio": worst,
        "goal": GOAL,
        "machine": machine(),
        "threads": torch.get_num_threads(),
    }
    print(f"wrote {write_json('loop', doc)}")
    return doc


if __name__ == "__main__":
    main()

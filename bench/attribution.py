"""Attribution benchmark: what one attribution sweep (``fbt_probe.kernels.attribution``) costs, and how
well it agrees with exact patching.

Cost, on the same batches of aligned twins (the task's first ``--batches`` batches):
- one forward of the prefill (inference mode): the unit, a forward-equivalent;
- one attribution sweep over every site of ``patch --kinds resid,head,path`` in every pass, and
  every depth (goal: at most 5 forward-equivalents);
- the exact sweep over the same sites: ``patch``'s patched runs for each pass (``--pass p``), every
  depth (goal: the attribution at least 20x faster);
- peak tensor memory (the profiler's record of allocations and frees) of the sweep on the longest
  batch against one clean run that caches the same activations of every pass (goal: at most 3x).

Agreement (``--agreement``): ``fbt-probe attribute --check all`` (every site patched exactly) for
each task and prefill; Spearman's rank correlation and top-10 recall over the resid and head
sites (goal: at least 0.9 and 0.8), as its ``attribution.json`` records them.

Run: .venv/bin/python -m bench.attribution [--model NAME] [--agreement]   (prints the tables,
writes bench/attribution.json, or bench/attribution_<name>.json for another model)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.common import best_of, machine, peak_tensor_memory, table, write_json
from fbt_probe.kernels.attribution import attribute, site_names
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import parse_prefill
from probes.attribute.check import batch_inputs
from probes.common.extract import max_batch_tokens
from probes.common.metrics import Record
from probes.common.twins import batches, pairs_of
from probes.patch.run import patch_batch
from tasks.dataset import load
from tasks.generate import generate_dataset

KINDS = ("resid", "head", "path")
GOALS = {"forwards": 5.0, "speedup": 20.0, "memory": 3.0, "rank": 0.9, "recall": 0.8}


def twin_batches(model, task: str, n_groups: int, n_batches: int, tmp: Path):
    enc = getattr(model, "encoding", None)
    path = generate_dataset(
        task,
        tmp / f"{task}.parquet",
        n_groups=n_groups,
        distractors=(1, 4, 16),
        seed=7,
        twins=True,
        tokenizer=None if enc is None else enc.source,
    )
    pairs = pairs_of(load(path))
    pairs = pairs.subset(np.flatnonzero(pairs.shift == 0))
    bs = batches(pairs, 32, "cpu", max_tokens=max_batch_tokens(model))
    return pairs, bs[:n_batches]


def cost_rows(model, pairs, bs, prefill: str) -> list[dict]:
    pf = parse_prefill(prefill)
    depths = range(len(model.depth_hooks()))

    def forward():
        with torch.inference_mode():
            for b in bs:
                pf.run(model, b.tokens)

    def sweep():
        for b in bs:
            attribute(model, prefill=pf, kinds=KINDS, edges=False, **batch_inputs(b, pairs))

    def exact():
        rec = Record(len(pairs))
        with torch.inference_mode():
            for b in bs:
                for p in range(pf.passes):
                    patch_batch(model, b, pf, KINDS, rec, pairs, depths, p)

    fwd = best_of(forward, repeats=3)
    att = best_of(sweep, repeats=2)
    ex = best_of(exact, repeats=1, warmup=0)
    return [
        {"what": f"forward, {prefill} prefill", "seconds": round(fwd, 3), "ratio": 1.0, "goal": ""},
        {
            "what": "attribution sweep (resid, head, path; every pass)",
            "seconds": round(att, 3),
            "ratio": round(att / fwd, 2),
            "goal": f"<= {GOALS['forwards']}",
        },
        {
            "what": "exact sweep, the same sites",
            "seconds": round(ex, 2),
            "ratio": round(ex / fwd, 1),
            "goal": "",
        },
        {
            "what": "speed-up of the attribution over the exact sweep",
            "seconds": "",
            "ratio": round(ex / att, 1),
            "goal": f">= {GOALS['speedup']}",
        },
    ]


def memory_row(model, pairs, bs, prefill: str) -> dict:
    """Peak tensor memory of the attribution sweep on the longest batch against one clean run
    that caches the same activations of every pass."""
    pf, b = parse_prefill(prefill), bs[-1]
    inputs = batch_inputs(b, pairs)

    def cached():
        with torch.inference_mode():
            model.run_with_pass_caches(
                b.tokens, passes=pf.passes, names_filter=site_names(model, KINDS)
            )

    att = peak_tensor_memory(
        lambda: attribute(model, prefill=pf, kinds=KINDS, edges=False, **inputs)
    )
    ref = peak_tensor_memory(cached)
    return {
        "what": "peak memory: attribution vs one cached clean run (MiB)",
        "seconds": f"{att:.1f} vs {ref:.1f}",
        "ratio": round(att / ref, 2),
        "goal": f"<= {GOALS['memory']}",
    }


def agreement_rows(model_name: str, tasks, prefills, groups: int) -> list[dict]:
    from probes import run_attribute

    rows = []
    for task in tasks:
        for prefill in prefills:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    run_attribute(
                        model_name,
                        task=task,
                        prefill=prefill,
                        kinds="resid,head,state,path",
                        check="all",
                        groups=groups,
                        data=None,
                        out=Path(tmp) / "a",
                    )
                except ValueError as e:  # e.g. no aligned twins through this tokenizer
                    rows.append({"task": task, "prefill": prefill, "note": str(e)})
                    continue
                meta = json.loads((Path(tmp) / "a" / "attribution.json").read_text())
            for scope in ("resid_head", "all"):
                a = meta["agreement"][scope]
                miss = a["misses"][0] if a["misses"] else {}
                rows.append(
                    {
                        "task": task,
                        "prefill": prefill,
                        "sites": scope,
                        "checked": a["checked"],
                        "rank_corr": round(a["rank_correlation"], 3),
                        "top10_recall": round(a["top_k_recall"], 2),
                        "hidden": a.get("hidden", 0),
                        "largest_miss": f"{miss.get('pass')} {miss.get('site')} "
                        f"{miss.get('positions')}: {miss.get('estimate', 0):.2f} vs "
                        f"{miss.get('exact', 0):.2f}"
                        if miss
                        else "",
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--task", default="done_tracking")
    ap.add_argument("--prefill", default="recurrent")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--agreement-groups", type=int, default=16)
    args = ap.parse_args()
    model, name = resolve_model(args.model)
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        pairs, bs = twin_batches(model, args.task, args.groups, args.batches, Path(tmp))
    rows = cost_rows(model, pairs, bs, args.prefill)
    rows.append(memory_row(model, pairs, bs, args.prefill))
    n = sum(len(b.idx) for b in bs)
    print(
        f"model {name}; {args.task} twins, {n} pairs in {len(bs)} batches, {args.prefill} prefill"
    )
    print(table(rows, ["what", "seconds", "ratio", "goal"]))
    agree = []
    if args.agreement:
        agree = agreement_rows(
            args.model,
            ("delayed_memory", "done_tracking"),
            ("recurrent", "full"),
            args.agreement_groups,
        )
        print(
            table(
                agree,
                [
                    "task",
                    "prefill",
                    "sites",
                    "checked",
                    "rank_corr",
                    "top10_recall",
                    "hidden",
                    "largest_miss",
                    "note",
                ],
            )
        )
    stem = "attribution" if args.model == "default" else f"attribution_{Path(args.model).name}"
    out = write_json(
        stem,
        {
            "model": name,
            "task": args.task,
            "prefill": args.prefill,
            "pairs": n,
            "goals": GOALS,
            "rows": rows,
            "agreement": agree,
            "machine": machine(),
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

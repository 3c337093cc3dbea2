"""Anatomy benchmark: what ``lens`` and ``trajectory`` cost against one feature extraction
over the same passes and examples (goal: at most 1.5x each).

- lens: the logit and tuned lenses and the fed-back state's reads at every (pass, depth) of
  K = 3 passes, against ``extract_features`` at prefill k3 (the same 3 passes); fitting the
  tuned lens, a one-off per model, is timed apart;
- trajectory: K = 8 passes with every position's states, the gate and the answer's top token,
  against ``extract_features`` at prefill k8;
- heads: attention by pass (every head's pattern reduced in its hook), 2 passes, against the
  plain 2-pass forward of the same batches of done_tracking's twins (reported, no goal);
- patch by head, per layer l, on the longest batch of done_tracking's twins under recurrent
  prefill: the layer's
  ``heads`` head patches against (heads + 1) patched runs from layer l (goal: at most 1.0x),
  and one patched run from layer l against one from layer 0 (goal: at most (L - l) / L + 0.1:
  the layers below l are not re-run, on the built-in model and on a Hugging Face one).

Run: .venv/bin/python -m bench.anatomy [--model DIR] [--only patch]   (prints a table, writes
bench/anatomy.json; with --model, bench/anatomy_<folder name>.json; --only patch: the patch
rows alone, into *_patch.json)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.common import best_of, machine, table, write_json
from fbt_probe.loading import resolve_model
from probes.common.extract import extract_features, max_batch_tokens
from probes.heads.run import collect as heads_collect
from probes.lens.run import answer_positions, fit_translators, measure
from probes.trajectory.run import collect
from tasks.dataset import load
from tasks.generate import generate_dataset

COUNTS = (1, 4, 16, 64)
GOAL = 1.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--n-groups", type=int, default=64)
    ap.add_argument(
        "--only", choices=("patch",), help="only the patched runs' rows (quick on a large model)"
    )
    args = ap.parse_args()
    model, name = resolve_model(args.model)
    model.eval()
    enc = getattr(model, "encoding", None)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate_dataset(
            "delayed_memory",
            Path(tmp) / "dm.parquet",
            n_groups=args.n_groups,
            distractors=COUNTS,
            seed=99,
            tokenizer=None if enc is None else enc.source,
        )
        ds = load(path)
        # done_tracking's twins line up through a tokenizer too (SmolLM2's delayed_memory
        # twins are all shifted by one token, and patching needs aligned ones)
        twins = load(
            generate_dataset(
                "done_tracking",
                Path(tmp) / "tw.parquet",
                n_groups=args.n_groups,
                distractors=COUNTS,
                seed=99,
                twins=True,
                tokenizer=None if enc is None else enc.source,
            )
        )
    if args.only == "patch":
        return report(args, name, len(twins), head_patch_rows(model, twins))
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
        {
            "what": "lens: logit lens + fed-back reads",
            "seconds": round(logit, 3),
            "ratio": round(logit / ex3, 2),
        },
        {
            "what": "lens: logit + tuned lens + fed-back reads",
            "seconds": round(both, 3),
            "ratio": round(both / ex3, 2),
        },
        {
            "what": "lens: fitting the tuned lens (once per model)",
            "seconds": round(fit_s, 3),
            "ratio": round(fit_s / ex3, 2),
        },
        {"what": "extract, 8 passes", "seconds": round(ex8, 3), "ratio": 1.0},
        {"what": "trajectory, 8 passes", "seconds": round(traj, 3), "ratio": round(traj / ex8, 2)},
    ]
    rows += head_patch_rows(model, twins)
    rows += heads_rows(model, twins, reps)
    report(args, name, len(ds), rows)


def report(args, name: str, n: int, rows: list[dict]) -> None:
    print(f"model {name}; delayed_memory, {n} examples (counts {COUNTS}); goal <= {GOAL}x")
    print(table(rows, ["what", "seconds", "ratio", "goal"]))
    stem = "anatomy" if args.model == "default" else f"anatomy_{Path(args.model).name}"
    stem += "_patch" if args.only else ""
    out = write_json(
        stem, {"model": name, "examples": n, "goal": GOAL, "rows": rows, "machine": machine()}
    )
    print(f"wrote {out}")


def head_patch_rows(model, twins) -> list[dict]:
    """Per layer: its head patches against (heads + 1) runs from it, and one run from it
    against one from layer 0 (one batch of twins, recurrent prefill)."""
    from fbt_probe.kernels.patching import clean_run, patched_output, replace_where
    from fbt_probe.prefill import parse_prefill
    from probes.common.patching import head_hook, layer_from
    from probes.common.twins import batches, pairs_of
    from probes.patch.run import twin_acts

    pairs = pairs_of(twins)
    pairs = pairs.subset(np.flatnonzero(pairs.shift == 0))
    b = batches(pairs, 64, "cpu", max_tokens=max_batch_tokens(model))[-1]  # the longest prompts
    pf, L, H = parse_prefill("recurrent"), model.cfg.n_layers, model.n_heads
    z = [f"blocks.{i}.attn.hook_z" for i in range(L)]
    resid = [f"blocks.{i}.hook_resid_pre" for i in range(L)]
    _, acts = twin_acts(model, b, pf, z + resid)
    trace = clean_run(model, b.tokens, pf)
    t = torch.arange(b.tokens.shape[1])[None]
    after = (t <= b.answer[:, None]) & (t >= b.label_pos[:, None])
    start = int(b.label_pos.min())

    def one(layer):
        hook = [(resid[layer], replace_where(after, acts[resid[layer]]))]
        patched_output(model, trace, start, hook, None, layer_from(model, layer))

    def heads(layer):
        for h in range(H):
            hook = [(z[layer], head_hook(h, after, acts[z[layer]]))]
            patched_output(model, trace, start, hook, None, layer_from(model, layer))

    # a large model: its first, middle and last layers, timed once (hundreds of full runs)
    layers = range(L) if L <= 8 else sorted({0, L // 2, L - 1})
    reps = 3 if L <= 8 else 1
    rows, base = [], best_of(lambda: one(0), repeats=reps)
    for layer in layers:
        run = best_of(lambda layer=layer: one(layer), repeats=reps)
        allh = best_of(lambda layer=layer: heads(layer), repeats=reps)
        rows.append(
            {
                "what": f"patch: layer {layer}'s {H} heads vs {H + 1} runs from it",
                "seconds": round(allh, 3),
                "ratio": round(allh / ((H + 1) * run), 2),
            }
        )
        # the layers from l up, and a tenth for what every run pays (the head, the cache)
        rows.append(
            {
                "what": f"patch: one run from layer {layer} vs from layer 0",
                "seconds": round(run, 4),
                "ratio": round(run / base, 2),
                "goal": f"<= {(L - layer) / L + 0.1:.2f}",
            }
        )
    return rows


def heads_rows(model, twins, reps: int) -> list[dict]:
    """``heads``' attention reads over 2 passes against the plain 2-pass forward of the same
    batches (what any reading of them costs at least)."""
    from probes.common.twins import batches, pairs_of

    pairs = pairs_of(twins)
    bs = batches(pairs, 64, "cpu", max_tokens=max_batch_tokens(model))

    def forward():
        with torch.inference_mode():
            for b in bs:
                model(b.tokens, passes=2, keep_all=False)

    ex = best_of(forward, repeats=reps)
    got = best_of(lambda: heads_collect(model, pairs, 2, 0, 64), repeats=reps)
    return [
        {"what": "forward, 2 passes (the same batches)", "seconds": round(ex, 3), "ratio": 1.0},
        {
            "what": "heads: attention by pass, 2 passes",
            "seconds": round(got, 3),
            "ratio": round(got / ex, 2),
        },
    ]


if __name__ == "__main__":
    main()

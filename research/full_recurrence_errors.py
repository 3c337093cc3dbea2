"""Which done_tracking prompts does full recurrence answer wrongly, and from which pass on?

Decodes `fbt-probe eval`'s held-out done_tracking prompts (counts 1..256) in full mode, lists
the wrong ones by distractor count n, required steps k and STEP events s (the label is DONE
iff s >= k), and runs the Jacobi passes on them (teacher-forced, the answer read at the
colon): how many of them pass 1, 2, ... still answer right. Full recurrence is the limit of
those passes, so the table shows at which depth the answer drifts.

    python research/full_recurrence_errors.py default runs/D
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import numpy as np
import torch

from fbt_probe.decode import generate_ragged
from fbt_probe.kernels.evaluate import heldout_examples
from fbt_probe.loading import resolve_model
from tasks import vocab

SHOW_PASSES = (1, 2, 3, 4, 6, 8, 12, 16, 30)


@torch.no_grad()
def full_errors(model, n_groups: int = 48, passes: int = 30) -> dict:
    """``{"n_prompts", "wrong": [(n, k, s, label), ...], "wrong_index": [i, ...],
    "right_at_pass": {p: count}}``; i indexes eval's held-out prompts with n >= 1."""
    exs = [e for e in heldout_examples("done_tracking", n_groups) if e.n_distractors >= 1]
    prompts = [vocab.encode(e.prompt) for e in exs]
    answer = np.array([vocab.TOKEN_TO_ID[e.answer[0]] for e in exs])
    got = np.array(generate_ragged(model, prompts, "full", 1))[:, 0]
    bad = np.flatnonzero(got != answer)
    wrong = []
    for i in bad:
        toks = exs[i].prompt
        wrong.append((exs[i].n_distractors, int(toks[2][1:]), toks.count("STEP"), exs[i].answer[0]))
    right = {}
    if len(bad):
        lengths = torch.tensor([len(prompts[i]) for i in bad])
        x = torch.zeros(len(bad), int(lengths.max()), dtype=torch.long)
        for j, i in enumerate(bad):
            x[j, : len(prompts[i])] = torch.tensor(prompts[i])
        out = model(x, passes=passes, lengths=lengths)
        at = torch.arange(len(bad))
        for p in range(1, passes + 1):
            pred = out.passes[p - 1].logits[at, lengths - 1].argmax(-1).numpy()
            right[p] = int((pred == answer[bad]).sum())
    return {
        "n_prompts": len(exs),
        "wrong": wrong,
        "wrong_index": [int(i) for i in bad],
        "right_at_pass": right,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="'default' or model/run folders")
    ap.add_argument("--n-groups", type=int, default=48, help="held-out groups (default 48)")
    a = ap.parse_args()
    if a.n_groups < 1:
        sys.exit("error: --n-groups must be >= 1")
    models = []
    for spec in a.models:
        try:
            models.append(resolve_model(spec))
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: {e}")
    for model, name in models:
        r = full_errors(model.eval(), a.n_groups)
        print(f"{name}: {len(r['wrong'])} of {r['n_prompts']} wrong under full recurrence")
        for (n, k, s, label), c in sorted(Counter(r["wrong"]).items()):
            print(f"  {c:3d} x  n={n:<3d} k={k} s={s} label {label}")
        if r["wrong"]:
            cells = [f"{p}:{r['right_at_pass'][p]}" for p in SHOW_PASSES]
            print("  still right at Jacobi pass  " + "  ".join(cells))


if __name__ == "__main__":
    main()

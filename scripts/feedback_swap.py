"""Does pass 2 *use* the done bit that the feedback carries? A causal swap test.

For held-out done_tracking prompts (probe stream, counts 1..256), run pass 1, then pass 2
three ways and read the answer at the colon (DONE vs MORE):

- as is;
- with pass 1's top state at the position before the colon (the vector that the colon's
  fused input is made from) replaced by the same state from a prompt with the *opposite*
  label: ``follow`` is how often pass 2 then answers the swapped-in label;
- with a prompt of the *same* label (``keep``, a control: near 1 when the swap itself does
  no harm), and with that state zeroed (``zeroed``: how often the answer survives).

A model whose pass 2 reads the bit from the feedback follows the swap; one that recounts
the STEP events by attention over the other positions ignores it.

    python scripts/feedback_swap.py runs/D default --n 200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fbt_probe.hooks import at  # noqa: E402
from fbt_probe.registry import resolve_model  # noqa: E402
from tasks import done_tracking, vocab  # noqa: E402

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def swap_test(model, n: int, seed: int) -> dict[str, float]:
    exs = done_tracking.generate(max(1, n // len(COUNTS) + 1), COUNTS, seed=seed)
    rng = np.random.default_rng(seed)
    exs = [exs[i] for i in rng.choice(len(exs), size=min(n, len(exs)), replace=False)]
    y = np.array([ex.answer[0] == vocab.DONE for ex in exs], dtype=int)
    done, more = vocab.TOKEN_TO_ID[vocab.DONE], vocab.TOKEN_TO_ID[vocab.MORE]
    prompts = [torch.tensor([vocab.encode(ex.prompt)]) for ex in exs]
    with torch.no_grad():
        # pass 1's top state before the colon: what the colon's fused input is made from
        pre = [model(x, passes=1).states[0, -2].clone() for x in prompts]

        def pass2(x, state=None) -> int:
            """Pass 2's answer at the colon; with ``state``, the fed-back state there (the
            colon's ``fusion.hook_state`` in pass 2) is replaced by it."""
            hooks = []
            if state is not None:
                swap = at(
                    lambda t, hook: state.expand_as(t), passes=[1], positions=[x.shape[1] - 1]
                )
                hooks = [("fusion.hook_state", swap)]
            logits = model.run_with_hooks(x, passes=2, fwd_hooks=hooks).logits[0, -1]
            return int(logits[done] > logits[more])

        out = {"pass2": [], "follow": [], "keep": [], "zeroed": []}
        for i, x in enumerate(prompts):
            out["pass2"].append(pass2(x) == y[i])
            for key, pool in (("follow", y != y[i]), ("keep", y == y[i])):
                pool = np.flatnonzero(pool)
                j = int(rng.choice(pool[pool != i]))
                out[key].append(pass2(x, pre[j]) == y[j])
            out["zeroed"].append(pass2(x, torch.zeros_like(pre[i])) == y[i])
    return {k: float(np.mean(v)) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="'default' or model/run folders")
    ap.add_argument("--n", type=int, default=200, help="held-out prompts (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    models = []
    for spec in a.models:
        try:
            models.append(resolve_model(spec))
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: {e}")
    print(f"{'model':40s} {'pass2':>6s} {'follow':>7s} {'keep':>6s} {'zeroed':>7s}")
    for model, name in models:
        r = swap_test(model.eval(), a.n, a.seed)
        print(
            f"{name:40s} {r['pass2']:6.3f} {r['follow']:7.3f} {r['keep']:6.3f} {r['zeroed']:7.3f}"
        )


if __name__ == "__main__":
    main()

"""Which attention heads read multi_register's binding, per trained model: at each answer
position (a register's name after the colon, which predicts its final value), the attention
weight of every head on the value of that register's last write, on an earlier write's value,
and on the last write's register name; and at each written value, the weight on the register
name just before it (a previous-token head, which lets the value's position carry its
register). A model that answers from its own pass (standard prefill) needs both, as an
induction circuit does: this shows whether it has them.

    python research/binding_heads.py runs/seeds-default/seed-*/model [--passes 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fbt_probe.kernels.evaluate import heldout_examples
from fbt_probe.kernels.heads import pair_weights
from fbt_probe.loading import resolve_model
from tasks import vocab


def examples(n_groups: int, counts: tuple[int, ...], seed: int):
    """Held-out prompts (the stream eval reads), never trained or probed on."""
    return heldout_examples("multi_register", n_groups, counts, seed)


@torch.no_grad()
def measure(model, exs, passes: int) -> dict:
    """Each example's attention weights in the last pass, from ``fbt_probe.kernels.heads.pair_weights``
    (the pass-aware weights of chosen query positions on chosen key positions)."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    last = np.zeros((n_layers, n_heads))
    earlier = np.zeros((n_layers, n_heads))
    name = np.zeros((n_layers, n_heads))
    prev_token = np.zeros((n_layers, n_heads))
    n_reads = n_earlier = n_values = 0
    correct = total = 0
    for ex in exs:
        ids = torch.tensor([vocab.encode(ex.tokens)])
        toks, c = ex.tokens, ex.colon_index
        values = [i + 1 for i in range(1, c) if toks[i][:1] == "R" and toks[i + 1][:1] == "V"]
        pairs = [(v, v - 1) for v in values]  # each written value on its register's name
        reads = []
        for r, off in enumerate(ex.label_offsets):
            at = c + 1 + off - 1  # the register's name after the colon
            writes = [i for i in range(1, c) if toks[i] == toks[at] and toks[i + 1].startswith("V")]
            reads.append((r, at, writes))
            pairs += [(at, writes[-1] + 1), (at, writes[-1])] + [(at, i + 1) for i in writes[:-1]]
        q, k = (torch.tensor([[p[j] for p in pairs]]) for j in (0, 1))
        w = pair_weights(model, ids, q, k, passes)[-1, :, 0].double().numpy()  # (L, n, H)
        logits = model(ids, passes=passes).logits[0]
        prev_token += w[:, : len(values)].sum(1)
        n_values += len(values)
        j = len(values)
        for r, at, writes in reads:
            correct += int(logits[at].argmax()) == vocab.TOKEN_TO_ID[ex.answer[r]]
            total += 1
            n_reads += 1
            last += w[:, j]
            name += w[:, j + 1]
            if len(writes) > 1:
                earlier += w[:, j + 2 : j + 1 + len(writes)].sum(1)
            n_earlier += len(writes) > 1
            j += 1 + len(writes)
    return {
        "accuracy": correct / total,
        "last_value": (last / n_reads).tolist(),
        "earlier_values": (earlier / max(n_earlier, 1)).tolist(),
        "last_name": (name / n_reads).tolist(),
        "previous_token": (prev_token / max(n_values, 1)).tolist(),
        "reads": n_reads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model folders (or 'default')")
    ap.add_argument("--passes", type=int, default=1, help="Jacobi passes; the last is measured")
    ap.add_argument("--n-groups", type=int, default=24)
    ap.add_argument("--counts", default="0,4,16", help="distractor counts")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    a = ap.parse_args()
    exs = examples(a.n_groups, tuple(int(x) for x in a.counts.split(",")), 4321)
    res = {}
    print(f"multi_register, pass {a.passes}, {len(exs)} prompts (counts {a.counts})")
    print(
        "model | answers | per layer: the head reading the last write's value most (its weight;"
        " the same head on earlier writes' values) | per layer: the strongest previous-token head"
    )
    for spec in a.models:
        m, label = resolve_model(spec)
        r = measure(m.eval(), exs, a.passes)
        res[spec] = r
        cells = []
        for layer, row in enumerate(r["last_value"]):
            h = int(np.argmax(row))
            cells.append(f"L{layer} h{h} {row[h]:.2f} ({r['earlier_values'][layer][h]:.2f})")
        prev = [
            f"L{layer} h{int(np.argmax(row))} {max(row):.2f}"
            for layer, row in enumerate(r["previous_token"])
        ]
        print(f"{spec} | {r['accuracy']:.3f} | " + "  ".join(cells) + " | " + "  ".join(prev))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

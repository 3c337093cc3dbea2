"""What the exact recurrence costs when the feedback enters block b instead of block 0.

The paper's design runs every block once per position, one position after another (T steps of
L blocks). A design whose feedback enters block b runs the blocks below it once, over every
position at once, and only blocks b.. L-1 one position at a time. This times the recurrence
on the default model's shape (d_model 128, 4 layers, 16 heads), batch 16 x 256 tokens, for
targets 0..3 (the source the top state). 5 rounds, each timing every variant once; each
ratio is the median over rounds of the ratio to target 0 within a round.

Run: .venv/bin/python -m bench.designs   (prints a table, writes bench/designs.json)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import machine, table, write_json
from fbt_probe.config import FBTConfig
from fbt_probe.model import FBTModel
from fbt_probe.recurrence import run_recurrence

B, T, ROUNDS = 16, 256, 5


def model_of(target: int) -> FBTModel:
    cfg = FBTConfig(n_heads=16, feedback_target=target, n_ctx=T)
    return FBTModel(cfg, seed=0).eval()


def main() -> None:
    tokens = torch.randint(4, 60, (B, T), generator=torch.Generator().manual_seed(0))
    models = {b: model_of(b) for b in range(4)}
    secs = {b: [] for b in models}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for b, m in models.items():
                t0 = time.perf_counter()
                run_recurrence(m, tokens)
                secs[b].append(time.perf_counter() - t0)
    rows = []
    for b in models:
        ratio = float(np.median(np.array(secs[b]) / np.array(secs[0])))
        rows.append({"target": b, "blocks run per position": 4 - b,
                     "recurrence_s": round(float(np.median(secs[b])), 3),
                     "vs_target_0": round(ratio, 3), "blocks_ratio": round((4 - b) / 4, 3)})  # fmt: skip
    print(table(rows, list(rows[0])))  # noqa: T201
    write_json("designs", {"machine": machine(), "batch": B, "tokens": T, "rounds": ROUNDS,
                           "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()

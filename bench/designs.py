"""What the exact recurrence costs when the feedback enters block b instead of block 0.

The paper's design runs every block once per position, one position after another (T steps of
L blocks). A design whose feedback enters block b runs the blocks below it once, over every
position at once, and only blocks b.. L-1 one position at a time. This times the recurrence
on the default model's shape (d_model 128, 4 layers, 16 heads), batch 16 x 256 tokens, for
targets 0..3 (the source the top state). 5 rounds, each timing every variant once; each
ratio is the median over rounds of the ratio to target 0 within a round.

Training: each of the six ``design-*`` recipes (the same schedule, seed and batches) takes a
forward and backward step (``train_step``) on the batches of steps STEPS, spread over the
schedule's phases; 3 rounds, each timing every design once; each design's cost is its summed
time over those steps, as a ratio to the paper's within a round (median over rounds). A
seed study's own training minutes (``metrics.json``) are read by ``research/designs.py``, but
a run that shared the machine's cores is slowed by whatever else ran: these ratios are not.

Run: .venv/bin/python -m bench.designs   (prints two tables, writes bench/designs.json)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import machine, table, write_json
from fbt_probe.config import FBTConfig
from fbt_probe.recurrence import run_recurrence
from fbt_probe.stack import FBTModel

B, T, ROUNDS = 16, 256, 5
DESIGNS = ("paper", "top-to-2", "2-to-1", "replace", "additive", "none")
STEPS, TRAIN_ROUNDS = (50, 150, 250, 350, 450, 550), 3


def model_of(target: int) -> FBTModel:
    cfg = FBTConfig(n_heads=16, feedback_target=target, n_ctx=T)
    return FBTModel(cfg, seed=0).eval()


def train_cost() -> list[dict]:
    """Seconds of forward and backward per design on the same batches (see the docstring)."""
    from fbt_probe.train.distributed import World
    from fbt_probe.train.objective import train_step
    from fbt_probe.train.recipes import named_config
    from fbt_probe.train.start import build_model
    from fbt_probe.train.steps import draw_step

    cfgs = {d: named_config(f"design-{d}") for d in DESIGNS}
    models = {d: build_model(c) for d, c in cfgs.items()}
    stream = cfgs["paper"].stream()  # the same stream for every design: one schedule and seed
    draws = [draw_step(cfgs["paper"], stream, s) for s in STEPS]
    secs = {d: [] for d in DESIGNS}
    for _ in range(TRAIN_ROUNDS):
        for d in DESIGNS:
            t0 = time.perf_counter()
            for draw in draws:
                models[d].zero_grad(set_to_none=True)
                train_step(models[d], models[d], draw, cfgs[d], World(), torch.device("cpu"))
            secs[d].append(time.perf_counter() - t0)
    base = np.array(secs["paper"])
    return [
        {
            "design": d,
            "steps_timed": len(STEPS),
            "train_s": round(float(np.median(secs[d])), 2),
            "vs_paper": round(float(np.median(np.array(secs[d]) / base)), 3),
        }
        for d in DESIGNS
    ]


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
        rows.append(
            {
                "target": b,
                "blocks run per position": 4 - b,
                "recurrence_s": round(float(np.median(secs[b])), 3),
                "vs_target_0": round(ratio, 3),
                "blocks_ratio": round((4 - b) / 4, 3),
            }
        )
    print(table(rows, list(rows[0])))  # noqa: T201
    train_rows = train_cost()
    print(table(train_rows, list(train_rows[0])))  # noqa: T201
    write_json(
        "designs",
        {
            "machine": machine(),
            "batch": B,
            "tokens": T,
            "rounds": ROUNDS,
            "rows": rows,
            "train_steps": list(STEPS),
            "train_rounds": TRAIN_ROUNDS,
            "train_rows": train_rows,
        },
    )


if __name__ == "__main__":
    main()

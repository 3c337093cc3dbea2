"""Training benchmark: tokens/s, achieved FLOP/s against this machine's matmul rate measured
in the same run, and the cost of a k-pass step relative to k single-pass steps.

The first table counts the padded batch of one point of the schedule; the honest figure is
``useful_fraction_of_peak``: FLOPs on real tokens only over 20 steps drawn evenly across the
default schedule (fixed-point steps included), against the matmul peak measured in the same run,
for the recipe's length-bucketed steps and for one padded batch per step (the speed-up of
bucketing is the ratio of the two, measured step by step in the same run).

Also the cost of a fixed-point step (the default's fixed-point batches: warm states from the
exact sequential recurrence without gradient, then ``fixed_point.passes`` passes with
gradient) on the same batch, relative to a plain step of as many passes.

And the run's fixed-point steps as a whole: every 8th of them timed with its own batch, how
much of the run they and their exact warm states (one token at a time) take, and the warm
states computed as one recurrence over the step's whole batch instead of one per length
bucket (fewer sequential token steps; checked for bitwise equality).

And the ceiling this model's shapes allow: every matmul of the sample's gradient passes (each
length bucket's own shape; forward, input-gradient and weight-gradient products) and their
causal attention (16 heads of 8), each timed alone on random tensors, with no norms, no
elementwise work, no Python between them: the fraction of the matmul peak those operations
reach at best, and what that leaves for the useful (real-token) rate; scaled to a whole run
with its warm states (the table before) kept as they are, the most the run could speed up.

And the throughput of the same training under torch.distributed: 2 gloo processes of one
thread each against one process of 2 threads, the first 200 steps of the default recipe, the
same global batches (on 2 cores no speed-up is expected: the processes share them).

Run: .venv/bin/python -m bench.train [--skip-distributed]   (prints six tables and a
whole-run bound, writes
bench/train.json)
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import machine, matmul_flops, table, write_json
from fbt_probe.batch import make_batch
from fbt_probe.stack import FBTModel
from fbt_probe.train.objective import multipass_loss, warm_states
from fbt_probe.train.recipes import named_config
from fbt_probe.train.steps import plan_of


def step_flops(cfg, batch) -> float:
    """Forward+backward FLOPs of one pass over ``batch`` (matmuls, attention, unembedding)."""
    D, L, F, V = cfg.model.d_model, cfg.model.n_layers, cfg.model.d_mlp, cfg.model.d_vocab
    B, T = batch.tokens.shape
    per_token = L * (4 * D * D + 2 * D * F) + D * V + 2 * D * D  # multiply-adds (+ fusion)
    attn = L * 2 * (T / 2) * D  # causal QK^T and AV, on average T/2 keys
    return 3 * 2 * B * T * (per_token + attn)  # x2 FLOP per MAC, x3 forward + backward


DIST_STEPS = 200
SAMPLE_STEPS = 20  # training steps drawn evenly across the default schedule


def useful_flops(cfg, examples, passes: int, warm: int, exact: bool, grad_only=False) -> float:
    """FLOPs of one training step on its real tokens only (no padding): every pass with
    gradient 3 x its forward; the warm states of a fixed-point step are forward only (the
    exact recurrence runs each token once, a Jacobi warm-up ``warm`` times). A forward pass
    is 2 FLOPs per weight of every matmul per token (the fusion in feedback passes) plus
    causal attention, 2·2·L·D·n(n+1)/2 for a sequence of n tokens."""
    from fbt_probe.train.costs import matmul_flops

    L, D = cfg.model.n_layers, cfg.model.d_model
    lens = [len(ex.tokens) for ex in examples]
    tokens = sum(lens)
    attn = sum(2 * 2 * L * D * n * (n + 1) / 2 for n in lens)

    def forward(feedback: bool) -> float:
        return tokens * matmul_flops(cfg.model, feedback) + attn

    grad_passes = sum(3 * forward(feedback=warm > 0 or k > 0) for k in range(passes))
    warm_passes = 0.0
    if warm and not grad_only:
        warm_passes = forward(feedback=True) if exact else warm * forward(feedback=True)
    return grad_passes + warm_passes


def representative_steps(cfg, model, opt) -> dict:
    """Time SAMPLE_STEPS real training steps (``train.train_step``: their own batches, pass
    counts and fixed-point draws) drawn evenly across the schedule, with the recipe's
    settings and again with one forward per step (``run.length_buckets`` off), alternating
    step by step so that drift of a shared machine hits both alike; their useful FLOPs."""
    import time

    from fbt_probe.train.distributed import World
    from fbt_probe.train.objective import train_step
    from fbt_probe.train.steps import draw_step, step_parts

    stream = cfg.stream()
    picks = [int(i * cfg.steps / SAMPLE_STEPS) for i in range(SAMPLE_STEPS)]
    draws = [draw_step(cfg, stream, s) for s in picks]
    variants = {"buckets": cfg, "one_batch": cfg.with_overrides({"run.length_buckets": False})}
    dev = torch.device("cpu")

    def run(c, d):
        opt.zero_grad()
        train_step(model, model, d, c, World(), dev)
        opt.step()

    run(cfg, draws[len(draws) // 2])  # warm-up
    secs = dict.fromkeys(variants, 0.0)
    for d in draws:
        for name, c in variants.items():
            t0 = time.perf_counter()
            run(c, d)
            secs[name] += time.perf_counter() - t0
    flops = sum(
        useful_flops(cfg, d.examples, d.passes, d.warm, cfg.fixed_point.exact) for d in draws
    )
    grad = sum(useful_flops(cfg, d.examples, d.passes, d.warm, True, grad_only=True) for d in draws)
    real = sum(len(ex.tokens) for d in draws for ex in d.examples)

    def padded(c):
        total = 0
        for d in draws:
            lens = [len(ex.tokens) for ex in d.examples]
            for p in step_parts(len(lens), lens, c, World()):
                total += len(p) * max(lens[i] for i in p)
        return total

    shapes = []  # (rows, padded length, passes with gradient, of them feedback passes)
    warm_s = 0.0  # the fixed-point steps' warm states, as train_step computes them
    for d in draws:
        lens = [len(ex.tokens) for ex in d.examples]
        for p in step_parts(len(lens), lens, cfg, World()):
            shapes.append(
                (len(p), max(lens[i] for i in p), d.passes, d.passes if d.warm else d.passes - 1)
            )
            if d.warm:
                mb = make_batch([d.examples[i] for i in p])
                t0 = time.perf_counter()
                warm_states(model, mb, d.warm, cfg.fixed_point.exact)
                warm_s += time.perf_counter() - t0

    return {
        "steps": picks,
        "fixed_point_steps": sum(d.warm > 0 for d in draws),
        "passes": [d.passes for d in draws],
        "seconds": secs["buckets"],
        "seconds_one_batch": secs["one_batch"],
        "useful_flops": flops,
        "useful_grad_flops": grad,
        "real_tokens": real,
        "padded_tokens": padded(cfg),
        "padded_tokens_one_batch": padded(variants["one_batch"]),
        "warm_states_s": warm_s,
        "shapes": shapes,
    }


def shape_ceiling(cfg, sample: dict, peak: float) -> dict:
    """The best rate the gradient passes' own operations reach, each timed alone: per length
    bucket of the sampled steps, every matmul (forward X·W, input gradient dY·Wᵀ, weight
    gradient Xᵀ·dY) of the blocks, the unembedding and (in feedback passes) the fusion, and the
    causal attention forward and backward. FLOPs of those padded shapes over the summed best
    times, against ``peak``; ``useful_grad_flops`` (the same passes on real tokens) over the
    same times is the most the useful rate of these passes could be with every other cost
    (norms, elementwise, allocation, Python, the optimizer) removed; the sample's seconds over
    those times plus its warm states' own is the most the wall time could fall by that."""
    import torch.nn.functional as F

    from bench.common import best_of

    m = cfg.model
    D, Fm, V, L, H = m.d_model, m.d_mlp, m.d_vocab, m.n_layers, m.n_heads
    block = [(D, D)] * 4 + [(D, Fm), (Fm, D)]  # Q, K, V, O, MLP in, MLP out
    fusion = [(D, D)] * (2 if m.fusion == "gated" else 1 if m.fusion == "additive" else 0)
    cache: dict = {}

    def mm_time(n, i, o):  # forward, input-gradient and weight-gradient matmuls
        key = ("mm", n, i, o)
        if key not in cache:  # weights stored (out, in) as the model's, used as x @ W.T
            x, w, dy = torch.randn(n, i), torch.randn(o, i), torch.randn(n, o)
            cache[key] = sum(
                best_of(f, repeats=3) for f in (lambda: x @ w.T, lambda: dy @ w, lambda: dy.T @ x)
            )
        return cache[key]

    def attn_time(b, t):  # forward and backward of the causal attention of one layer
        key = ("attn", b, t)
        if key not in cache:
            q, k, v = (torch.randn(b, H, t, D // H, requires_grad=True) for _ in range(3))
            g = torch.randn(b, H, t, D // H)

            def fb():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

            cache[key] = best_of(fb, repeats=3)
        return cache[key]

    mm_s = attn_s = mm_flops = attn_flops = 0.0
    for b, t, passes, feedback in sample["shapes"]:
        n = b * t
        mm_s += passes * (L * sum(mm_time(n, i, o) for i, o in block) + mm_time(n, D, V))
        mm_s += feedback * sum(mm_time(n, i, o) for i, o in fusion)
        attn_s += passes * L * attn_time(b, t)
        per_token = 2 * (L * sum(i * o for i, o in block) + D * V)
        mm_flops += 3 * n * (passes * per_token + feedback * 2 * sum(i * o for i, o in fusion))
        attn_flops += 3 * passes * 2 * 2 * L * D * t * (t + 1) / 2 * b
    secs = mm_s + attn_s
    return {
        "buckets": len(sample["shapes"]),
        "sample_s": round(sample["seconds"], 2),
        "warm_states_s": round(sample["warm_states_s"], 2),
        "ops_alone_s": round(secs, 2),
        "attention_share_of_time": round(attn_s / secs, 3),
        "matmuls_fraction_of_peak": round(mm_flops / mm_s / peak, 3),
        "attention_fraction_of_peak": round(attn_flops / attn_s / peak, 3),
        "ops_alone_fraction_of_peak": round((mm_flops + attn_flops) / secs / peak, 3),
        "useful_ceiling_fraction_of_peak": round(sample["useful_grad_flops"] / secs / peak, 3),
        "ops_flops": mm_flops + attn_flops,
        "wall_speedup_bound": round(sample["seconds"] / (secs + sample["warm_states_s"]), 3),
    }


FP_EVERY = 8  # every 8th fixed-point step of the default schedule is timed


def warm_up_share(cfg, model) -> dict:
    """How much of a whole run the fixed-point steps and their warm states take: every
    FP_EVERY-th fixed-point step of the schedule (its own batch and parts), timed whole
    (``train_step``), its warm states as trained (one exact recurrence per length bucket),
    and the same warm states as one recurrence over the step's whole batch (a candidate:
    fewer sequential token steps), scaled to the run's fixed-point steps. Whether the merged
    states equal the per-bucket ones bit for bit is checked (if not, adopting it would change
    every trained model)."""
    import time

    from fbt_probe.train.distributed import World
    from fbt_probe.train.objective import train_step
    from fbt_probe.train.steps import draw_step, example_lengths, fixed_point_draw, step_parts

    stream = cfg.stream()  # which steps are fixed-point ones, without drawing their examples
    fp = [s for s in range(cfg.steps) if fixed_point_draw(cfg, s, plan_of(cfg, s).fixed_point)]
    secs = {"step": 0.0, "warm": 0.0, "merged": 0.0}
    bitwise = True
    for s in fp[::FP_EVERY]:
        d = draw_step(cfg, stream, s)
        lens = example_lengths(d.examples, None)
        parts = step_parts(len(lens), lens, cfg, World())
        t0 = time.perf_counter()
        per_part = [
            warm_states(model, make_batch([d.examples[i] for i in idx]), d.warm, True)
            for idx in parts
        ]
        t1 = time.perf_counter()
        merged = warm_states(model, make_batch(d.examples), d.warm, True)
        t2 = time.perf_counter()
        model.zero_grad()
        train_step(model, model, d, cfg, World(), torch.device("cpu"))
        t3 = time.perf_counter()
        secs["warm"] += t1 - t0
        secs["merged"] += t2 - t1
        secs["step"] += t3 - t2
        for idx, st in zip(parts, per_part, strict=True):
            bitwise &= torch.equal(st, merged[idx][:, : st.shape[1]])
    k = len(fp) / len(fp[::FP_EVERY])
    return {
        "fixed_point_steps": len(fp),
        "timed": len(fp[::FP_EVERY]),
        "fixed_point_steps_s": round(secs["step"] * k, 1),
        "warm_states_s": round(secs["warm"] * k, 1),
        "merged_warm_states_s": round(secs["merged"] * k, 1),
        "merged_speedup_of_warm_states": round(secs["warm"] / secs["merged"], 3),
        "merged_bitwise": bool(bitwise),
    }


def run_bound(cfg, ceiling: dict, warm: dict) -> dict:
    """The sample's bound scaled to a whole run: its steps without warm states (evenly drawn,
    so their mean stands for every step) times ``cfg.steps``, plus the run's exact warm
    states (``warm_up_share``). With the gradient passes shrunk to their operations alone and
    the warm states kept as they are, the run can be at most this much faster."""
    per_run = cfg.steps / SAMPLE_STEPS
    run = (ceiling["sample_s"] - ceiling["warm_states_s"]) * per_run + warm["warm_states_s"]
    least = ceiling["ops_alone_s"] * per_run + warm["warm_states_s"]
    return {"run_estimate_s": round(run), "run_wall_speedup_bound": round(run / least, 3)}


def _train_part(world, out: str) -> None:
    from fbt_probe.train.loop import train

    train(named_config("default"), out, stop_after=DIST_STEPS, world=world)


def distributed_throughput() -> list[dict]:
    """Tokens/s of 1 process x 2 threads and 2 gloo processes x 1 thread, same batches."""
    import json
    import tempfile

    from fbt_probe.train.distributed import spawn_local
    from fbt_probe.train.loop import train

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            train(named_config("default"), Path(tmp) / "one", stop_after=DIST_STEPS)
        finally:
            torch.set_num_threads(threads)
        spawn_local(_train_part, 2, str(Path(tmp) / "two"), threads=1)
        for name, sub in (("1 process x 2 threads", "one"), ("2 gloo processes x 1 thread", "two")):
            m = json.loads((Path(tmp) / sub / "metrics.json").read_text())
            rows.append(
                {
                    "run": name,
                    "steps": m["steps_done"],
                    "wall_s": round(m["wall_seconds_this_call"], 1),
                    "tokens_per_s": round(m["tokens_per_second"]),
                }
            )
    for r in rows:
        r["vs_one_process"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-distributed", action="store_true", help="only the one-process tables")
    args = ap.parse_args()
    peak_before = matmul_flops()
    cfg = named_config("default")
    model = FBTModel(cfg.model, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = plan_of(cfg, int(0.75 * cfg.steps))  # counts up to 256, the full task mixture
    batch = make_batch(cfg.stream().batch(0, cfg.data.batch_size, plan.tasks, plan.n_max))

    def step(k):
        loss, _ = multipass_loss(model, batch, k, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()

    import time

    g = cfg.fixed_point.passes

    def fp_step():  # returns the seconds spent on the warm states
        t0 = time.perf_counter()
        init = warm_states(model, batch, 0, exact=True)
        t_warm = time.perf_counter() - t0
        loss, _ = multipass_loss(model, batch, g, cfg, init_states=init, first_pass=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return t_warm

    best = {1: float("inf"), 2: float("inf"), 3: float("inf")}
    best_fp, best_warm = float("inf"), float("inf")
    step(1)
    fp_step()
    for _ in range(5):  # round-robin, best of 5: drift of a shared machine hits every k alike
        for k in best:
            t0 = time.perf_counter()
            step(k)
            best[k] = min(best[k], time.perf_counter() - t0)
        t0 = time.perf_counter()
        t_warm = fp_step()
        best_fp = min(best_fp, time.perf_counter() - t0)
        best_warm = min(best_warm, t_warm)
    rows, t1 = [], best[1]
    for k, t in best.items():
        fl = k * step_flops(cfg, batch)
        rows.append(
            {
                "passes": k,
                "step_s": round(t, 4),
                "tokens_per_s": round(batch.n_tokens / t),
                "pass_tokens_per_s": round(k * batch.n_tokens / t),
                "achieved_gflops": round(fl / t / 1e9, 1),
                "cost_vs_k_single": round(t / (k * t1), 3),
            }
        )
    peak = max(peak_before, matmul_flops())
    for r in rows:
        r["fraction_of_matmul_peak"] = round(r["achieved_gflops"] * 1e9 / peak, 3)
    B, T = batch.tokens.shape
    print(
        f"training step, default config, batch {B} x {T} padded tokens ({batch.n_tokens} real); matmul peak {peak / 1e9:.0f} GFLOP/s measured now"
    )
    print(table(rows, list(rows[0])))
    t_plain = best.get(g) or g * t1
    fp = {
        "fp_passes": g,
        "step_s": round(best_fp, 4),
        "warm_s": round(best_warm, 4),
        "warm_share": round(best_warm / best_fp, 3),
        f"cost_vs_{g}_pass_step": round(best_fp / t_plain, 3),
    }
    print(
        f"\nfixed-point step (exact warm states without gradient + {g} passes with it), same batch"
    )
    print(table([fp], list(fp)))
    sample = representative_steps(cfg, model, opt)
    peak = max(peak, matmul_flops())
    useful = sample["useful_flops"] / sample["seconds"] / peak
    srows = []
    for name, key, pad in (
        ("length buckets (the recipe)", "seconds", "padded_tokens"),
        ("one batch per step", "seconds_one_batch", "padded_tokens_one_batch"),
    ):
        srows.append(
            {
                "layout": name,
                "steps": SAMPLE_STEPS,
                "fixed_point": sample["fixed_point_steps"],
                "seconds": round(sample[key], 2),
                "real_tokens_share": round(sample["real_tokens"] / sample[pad], 3),
                "useful_gflops": round(sample["useful_flops"] / sample[key] / 1e9, 1),
                "useful_fraction_of_peak": round(sample["useful_flops"] / sample[key] / peak, 3),
                "speedup": round(sample["seconds_one_batch"] / sample[key], 3),
            }
        )
    srow = srows[0]
    print(
        f"\n{SAMPLE_STEPS} training steps drawn evenly across the default schedule (their own "
        "batches, passes and fixed-point draws), FLOPs on real tokens only"
    )
    print(table(srows, list(srows[0])))
    ceiling = shape_ceiling(cfg, sample, peak)
    del sample["shapes"]
    ceiling["sample_useful_fraction_of_peak"] = srow["useful_fraction_of_peak"]
    print(
        "\nthe same steps' gradient passes, each matmul and attention of their buckets timed "
        "alone: the most of the peak these shapes reach"
    )
    print(table([ceiling], [c for c in ceiling if c != "ops_flops"]))
    warm = warm_up_share(cfg, model)
    ceiling.update(run_bound(cfg, ceiling, warm))
    print(
        f"\nwhole run, estimated: {ceiling['run_estimate_s']} s of steps; with every cost "
        f"but the gradient passes' matmuls and attention removed (the warm states kept): at "
        f"most {ceiling['run_wall_speedup_bound']}x faster"
    )
    print(
        f"\nthe run's fixed-point steps (every {FP_EVERY}th timed, scaled to all), and their "
        "exact warm states: per length bucket (the recipe) and as one recurrence per step"
    )
    print(table([warm], list(warm)))
    dist_rows = [] if args.skip_distributed else distributed_throughput()
    if dist_rows:
        print(
            f"\ndistributed (gloo) against one process: first {DIST_STEPS} steps of the default recipe"
        )
        print(table(dist_rows, list(dist_rows[0])))
    path = write_json(
        "train",
        {
            "machine": machine(),
            "matmul_peak_gflops": peak / 1e9,
            "batch": [B, T],
            "rows": rows,
            "fixed_point_step": fp,
            "distributed": dist_rows,
            "useful_fraction_of_peak": useful,
            "representative_steps": {**sample, **srow},
            "layouts": srows,
            "fixed_point_run": warm,
            "shape_ceiling": ceiling,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

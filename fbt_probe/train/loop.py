"""Multi-pass training: next-token loss on every pass, summed, no truncation (docs/training.md).

``train`` reads top to bottom: check the run, build its state (``TrainState``: the model,
the optimiser, the step and the history, saved and loaded whole), record how it started,
take the steps, finish. What each step trains on is drawn in ``fbt_probe.train.steps``, a pure
function of (recipe, step), so a resumed run reaches exactly the weights of an uninterrupted
one. What only training does to the model, the jitter noise on the fed-back state and the
schedule's share of the smeared keys, is applied here through hooks, never stored on it.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from fbt_probe.checkpoint import save_model, write_text
from fbt_probe.hf import base_folder, read_fusion_config, save_fusion, save_hf
from fbt_probe.loading import install_default
from fbt_probe.runtime.device import resolve_device
from fbt_probe.stack import FBTModel
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.distributed import World, place, rank_device
from fbt_probe.train.objective import quick_eval, smear_hooks, train_step
from fbt_probe.train.recipes import build_recipe
from fbt_probe.train.start import init_folder
from fbt_probe.train.state import (
    Divergence,
    TrainState,
    check_resume,
    check_run,
    diverged,
    git_revision,
    record_start,
    start_state,
)
from fbt_probe.train.steps import (
    StepDraw,
    draw_step,
    lr_at,
)
from fbt_probe.util.files import claim


def autocast(cfg: TrainConfig, dev: torch.device):
    """bf16 autocast on CUDA when the recipe asks for it (``run.bf16``); otherwise nothing."""

    if cfg.run.bf16 and dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def parallel(model, world: World, fsdp: bool):
    """The module the steps run: DistributedDataParallel under torchrun, else the model."""
    if world.size == 1 or fsdp:
        return model

    # find_unused_parameters: a one-pass step never reaches the fusion's parameters, and
    # which steps are one-pass changes along the schedule, so the graph is not static
    # broadcast_buffers off: the only buffers are the rotary tables, fixed by the config,
    # and ranks may run different numbers of forwards in a step (their length buckets)
    return DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)


class Clock:
    """Where a call's wall time goes (metrics.json "seconds"), and the tokens it trained."""

    def __init__(self):
        self.t0 = self.last = time.monotonic()
        self.spent = {"draw": 0.0, "step": 0.0, "eval": 0.0, "checkpoint": 0.0}
        self.tokens = 0

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self.spent[part] += now - self.last
        self.last = now

    def minutes(self) -> float:
        return (time.monotonic() - self.t0) / 60

    def tokens_per_second(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.t0)


class Monitor:
    """The recent losses (to catch a divergence) and running per-pass stats (the bar)."""

    def __init__(self):
        self.recent: list[float] = []
        self.running: dict = {}

    def update(self, lv: float, passes: int, stats: list, warm: int) -> None:
        self.recent = (self.recent + [lv / passes])[-200:]
        # a fixed-point batch's stats go under "fp" (its last pass), not under its pass index
        for k, s in [("fp", stats[-1])] if warm else enumerate(stats, start=1):
            prev = self.running.get(k, s)
            self.running[k] = {m: 0.95 * prev[m] + 0.05 * s[m] for m in s}

    def info(self) -> str:
        """Passes in order, the fixed-point batches last."""
        order = sorted(
            self.running.items(), key=lambda kv: float("inf") if kv[0] == "fp" else kv[0]
        )
        return "  ".join(
            f"{k if k == 'fp' else f'pass{k}'}: loss {v['loss']:.3f} acc {v['answer_acc']:.2f}"
            for k, v in order
        )


def take_step(
    state: TrainState,
    net,
    cfg: TrainConfig,
    draw: StepDraw,
    frozen: dict,
    monitor: Monitor,
    world: World,
    dev,
    out: Path,
):
    """One optimiser step on ``draw`` (a divergence refused before the update): its loss,
    per-pass stats, tokens and gradient norm."""
    model, opt, step = state.model, state.opt, state.step
    for g in opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    opt.zero_grad(set_to_none=True)
    with autocast(cfg, dev):
        lv, stats, n_tokens = train_step(net, model, draw, cfg, world, dev)
    recent = monitor.recent
    if diverged(lv / draw.passes, recent):
        raise Divergence(
            f"training diverged at step {step} (loss per pass {lv / draw.passes:.4g}, recent median "
            f"{np.median(recent) if recent else float('nan'):.4g}); the last good checkpoint is in {out}"
        )
    for prefix_name in draw.plan.frozen:
        for p in frozen[prefix_name]:
            p.grad = None  # AdamW skips it: no update, no weight decay
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    if not math.isfinite(gnorm):
        raise Divergence(
            f"non-finite gradient at step {step}; the last good checkpoint is in {out}"
        )
    opt.step()
    monitor.update(lv, draw.passes, stats, draw.warm)
    return lv, stats, n_tokens, gnorm


def step_record(cfg: TrainConfig, draw: StepDraw, step: int, lv: float, stats, gnorm) -> dict:
    """The history's line for a step; a fixed-point batch's stats go under "fp"."""
    rec = {
        "step": step + 1,
        "passes": draw.passes,
        "loss": lv,
        "lr": lr_at(cfg, step),
        "grad_norm": gnorm,
    }
    if draw.warm:
        rec["fp_warm"] = "recurrence" if cfg.fixed_point.exact else draw.warm
        rec.update({f"fp/{m}": v for m, v in stats[-1].items()})
    else:
        rec.update({f"pass{k + 1}/{m}": v for k, s in enumerate(stats) for m, v in s.items()})
    return rec


def run_steps(
    state: TrainState,
    net,
    cfg: TrainConfig,
    frozen: dict,
    world: World,
    dev,
    out: Path,
    end: int,
    clock: Clock,
    progress=None,
    max_minutes: float = 0.0,
) -> None:
    """Steps ``state.step`` .. ``end`` - 1, a checkpoint every ``run.checkpoint_every`` and
    when ``max_minutes`` have passed (rank 0's clock decides for every rank)."""
    stream, monitor, model = cfg.stream(), Monitor(), state.model
    for step in range(state.step, end):
        clock.lap("step")  # the loop's own bookkeeping counts with the step
        draw = draw_step(cfg, stream, step)
        clock.lap("draw")
        with model.hooks(fwd_hooks=smear_hooks(model, draw.plan.smear)):
            lv, stats, n_tokens, gnorm = take_step(
                state, net, cfg, draw, frozen, monitor, world, dev, out
            )
            # the exact recurrence runs each token through the stack once, Jacobi warm-up ``warm`` times
            clock.tokens += n_tokens * (
                draw.passes + (min(draw.warm, 1) if cfg.fixed_point.exact else draw.warm)
            )
            rec = step_record(cfg, draw, step, lv, stats, gnorm)
            if (world.main or cfg.run.fsdp) and (
                (step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.steps
            ):
                clock.lap("step")  # under FSDP every rank takes part in a forward
                rec["eval"] = quick_eval(model, cfg)
                clock.lap("eval")
        state.history.append(rec)
        state.step = step + 1
        if progress is not None and world.main:
            progress(
                step + 1, cfg.steps, f"{monitor.info()}  {clock.tokens_per_second():,.0f} tok/s"
            )
        if (step + 1) % cfg.run.checkpoint_every == 0:
            clock.lap("step")
            state.save(out / "state.pt", world)
            clock.lap("checkpoint")
        if (
            max_minutes
            and world.all_sum([float(world.main and clock.minutes() > max_minutes)], dev)[0]
        ):
            state.save(out / "state.pt", world)
            break
    clock.lap("step")


def finish(
    state: TrainState,
    cfg: TrainConfig,
    out: Path,
    world: World,
    dev,
    clock: Clock,
    revision: str,
    max_minutes: float,
) -> dict:
    """The last checkpoint, the final evaluation, metrics.json and the model folder."""
    full = state.save(out / "state.pt", world)
    clock.lap("checkpoint")
    model = state.model.eval()
    final_eval = quick_eval(model, cfg) if world.main or cfg.run.fsdp else {}
    clock.lap("eval")
    done = {
        "steps_done": state.step,
        "steps": cfg.steps,
        "finished": state.step >= cfg.steps,
        "final_eval": final_eval,
        "history": state.history,
        "world_size": world.size,
    }
    if not world.main:
        world.barrier()  # rank 0 writes the checkpoint, the metrics and the model
        return done
    if full is not None:  # the gathered weights, in an unsharded model that save_model writes
        model = FBTModel(cfg.model, seed=cfg.run.seed)
        model.load_state_dict(full)
    metrics = {
        "name": cfg.name,
        **{k: done[k] for k in ("steps_done", "steps", "finished")},
        "seed": cfg.run.seed,
        "git_revision": revision,
        "device": str(dev),
        # the bits of the weights depend on these too (and on the CPU's instruction set):
        # the same config, seed, torch version and thread count give the same weights
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_seconds_this_call": clock.minutes() * 60,
        "seconds": {k: round(v, 2) for k, v in clock.spent.items()},
        "max_minutes": max_minutes,
        "world_size": world.size,
        "sharding": "fsdp" if cfg.run.fsdp else "ddp" if world.size > 1 else "none",
        "accum": cfg.optim.accum,
        "per_rank_batch": -(-cfg.data.batch_size // world.size),
        "tokens_per_second": clock.tokens_per_second(),
        "final_eval": final_eval,
        "history": state.history,
    }
    write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    save_run_model(
        model,
        cfg,
        out / "model",
        {"train_config": cfg.to_dict(), "steps_done": state.step, "git_revision": revision},
    )
    world.barrier()
    return metrics


def save_run_model(model, cfg: TrainConfig, folder: Path, meta: dict) -> None:
    """The trained model as a model folder: the built-in format, or a Hugging Face folder
    with the fusion beside it (``fbt_probe.hf``)."""
    if isinstance(model, FBTModel):
        save_model(model, folder, extra_meta=meta)
        return

    if model.encoding is not None:  # the words its labels were trained as
        meta = {**meta, "label_words": {t: list(w) for t, w in model.encoding.label_words.items()}}
    extra = {"fbt_probe_meta.json": json.dumps(meta, indent=2) + "\n"}
    if cfg.optim.learn == "all":
        save_hf(model, folder, extra=extra)
        return
    # the stack is the start's own: the folder holds the fusion and names that base
    start = init_folder(cfg)
    saved = read_fusion_config(start)
    base = base_folder(start, saved["base"]) if saved and "base" in saved else start
    save_fusion(model, folder, base, extra=extra)


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress=None,
    stop_after: int | None = None,
    argv: list[str] | None = None,
    device: str = "cpu",
    max_minutes: float = 0.0,
    world: World | None = None,
) -> dict:
    """Train ``cfg`` into ``out_dir``; returns the final metrics.

    ``device`` ("cpu", "cuda", "cuda:1", ...) is where the model trains; the examples, the
    initial weights and the schedule do not depend on it, the floating-point results do.
    ``progress(step, total, info)`` is called every step. ``stop_after`` ends the run early
    at that step (with a checkpoint), as an interruption would; so does ``max_minutes`` of
    wall time (0 = no limit). On NaN or divergence the run stops with ``Divergence`` and the
    last good checkpoint stays in place. ``world`` (``fbt_probe.train.distributed``): under
    torchrun each rank trains on its rows of every step's batch, and only rank 0 writes.
    """
    out, world = Path(out_dir), world or World()
    dev = rank_device_of(device, world)  # before anything is written
    with claim(out) if world.main else nullcontext():  # rank 0 is the one writer
        return _train(cfg, out, resume, progress, stop_after, argv, dev, max_minutes, world)


def _train(
    cfg: TrainConfig,
    out: Path,
    resume: bool,
    progress,
    stop_after: int | None,
    argv: list[str] | None,
    dev,
    max_minutes: float,
    world: World,
) -> dict:
    check_run(cfg, out, resume, world, dev)
    saved = check_resume(cfg, out, dev) if resume else None
    world.barrier()  # every rank has checked before rank 0 writes anything
    state, frozen = start_state(cfg, out, saved, world, dev)
    if world.main:
        record_start(cfg, out, argv)
    net = parallel(state.model, world, cfg.run.fsdp)
    revision = git_revision()  # at the start: the code that trains, not what changed meanwhile
    clock = Clock()
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    run_steps(state, net, cfg, frozen, world, dev, out, end, clock, progress, max_minutes)
    return finish(state, cfg, out, world, dev, clock, revision, max_minutes)


def rank_device_of(device: str, world: World):
    """``--device`` for this rank of ``world`` (its own GPU on CUDA)."""

    return rank_device(resolve_device(device), world)


def train_recipe(
    *,
    config: str | None = None,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
    init_from: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    max_minutes: float = 0.0,
    device: str = "cpu",
    as_default: bool = False,
    argv: list[str] | None = None,
    bars=None,
) -> tuple[dict, Path, TrainConfig]:
    """``fbt-probe train``: the recipe ``config`` names (with ``--set`` ``overrides``;
    default: 'default', or under ``resume`` the run folder's own) trained into ``out``
    (default runs/<name>), then, with ``as_default``, installed as the built-in model.
    ``bars(label, total)`` makes the progress bar. Returns (metrics, run folder, recipe);
    under torchrun rank 0 reports and installs."""

    if resume and out is None:
        raise ValueError("--resume needs --out, the run folder to continue")
    rank_device_of(device, World())  # a bad --device fails before anything is written
    cfg = build_recipe(
        config=config,
        overrides=overrides,
        init_from=init_from,
        run_dir=Path(out) if resume else None,
    )
    if as_default and stop_after is not None and stop_after < cfg.steps:
        raise ValueError(
            f"--as-default needs the whole run: --stop-after {stop_after} < steps {cfg.steps}"
        )
    out = Path(out) if out is not None else Path("runs") / cfg.name
    _, world = place(device)  # under torchrun: this rank of the world
    with bars(f"train {cfg.name}", cfg.steps) if bars and world.main else nullcontext() as bar:
        metrics = train(
            cfg,
            out,
            resume=resume,
            progress=bar,
            stop_after=stop_after,
            argv=argv,
            device=device,
            max_minutes=max_minutes,
            world=world,
        )
    if as_default and world.main:
        if not metrics["finished"]:
            raise ValueError(
                f"not installed as the default: the run stopped at step {metrics['steps_done']}"
            )
        metrics["installed"] = str(install_default(out))
    return metrics, out, cfg

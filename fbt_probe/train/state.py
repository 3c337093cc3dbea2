"""A run's state and its checks: the run folder (recipe, command, git revision), the state a
checkpoint holds, what --resume checks before anything is written, and divergence."""

from __future__ import annotations

import hashlib
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from fbt_probe.checkpoint import write_text
from fbt_probe.feedback import FeedbackModel
from fbt_probe.stack import FBTModel
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.distributed import World
from fbt_probe.train.start import (
    build_model,
    frozen_parameters,
    learned_state,
    load_learned,
    make_optimizer,
    set_learning,
)
from fbt_probe.util.files import atomic_write, check_output_dir
from tasks.base import MAX_DISTRACTORS
from tasks.generate import MEMORY_SHARE, machine_memory


# ---- the run folder -------------------------------------------------------------------------
def git_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5
        )
        return (
            rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
            if rev.returncode == 0
            else "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Divergence(ValueError):
    """Training stopped on a NaN or a loss far above the recent ones; the message names
    where the last good checkpoint is."""


def diverged(loss_per_pass: float, recent: list[float]) -> bool:
    """NaN/inf, or a per-pass loss 20x the median of the recent ones (and above 5 nats).

    Per pass, because the summed loss of a 12-pass batch is 12 ordinary losses."""
    if not math.isfinite(loss_per_pass):
        return True
    return (
        len(recent) >= 50 and loss_per_pass > 20 * float(np.median(recent)) and loss_per_pass > 5.0
    )


def without_sharding(cfg: TrainConfig) -> TrainConfig:
    """The config with ``run.fsdp`` off: how the states are laid out over the ranks is not
    part of what is trained, so a run may be resumed with or without it."""
    return replace(cfg, run=replace(cfg.run, fsdp=False))


def saved_train_config(out: Path) -> TrainConfig:
    """The recipe a run folder was trained with (its ``train_config.json``)."""
    path = out / "train_config.json"
    try:
        return TrainConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg})") from None


@dataclass
class TrainState:
    """The whole state of a run between two steps: the model, its optimiser, the next step
    and the history of the steps taken. Nothing else is random: every draw of a step is
    keyed by (seed, step), so this is all a resumed run needs to continue bitwise."""

    model: FeedbackModel
    opt: torch.optim.Optimizer
    step: int = 0
    history: list = field(default_factory=list)
    fsdp: bool = False
    identity: str = ""  # run_identity(cfg): which recipe and seed wrote the checkpoint

    def save(self, path: Path, world: World) -> dict | None:
        """Write ``path`` (rank 0); under FSDP every rank gathers the shards first and the
        whole model's state is returned."""
        msd, osd = learned_state(self.model), None
        if self.fsdp:
            from fbt_probe.train.distributed import full_states

            msd, osd = full_states(self.model, self.opt)
        if world.main:
            state = {
                "model": msd,
                "opt": osd if self.fsdp else self.opt.state_dict(),
                "step": self.step,
                "history": self.history,
                "identity": self.identity,
            }
            atomic_write(path, lambda tmp: torch.save(state, tmp))
        return msd if self.fsdp else None

    @staticmethod
    def read(path: Path, dev) -> dict:
        """A checkpoint's contents, or one line saying why it cannot be read."""
        try:
            return torch.load(path, weights_only=False, map_location=dev)
        except (RuntimeError, EOFError, OSError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{path} cannot be read ({first}); it may be truncated") from None

    def load_optimizer(self, saved: dict) -> None:
        if self.fsdp:
            from fbt_probe.train.distributed import load_optimizer

            load_optimizer(self.model, self.opt, saved["opt"])
        else:
            self.opt.load_state_dict(saved["opt"])
        self.step, self.history = saved["step"], saved["history"]


# ---- the loop ---------------------------------------------------------------------------------
def check_run(cfg: TrainConfig, out: Path, resume: bool, world: World, dev) -> None:
    """Everything that can be refused before a file is written."""
    check_output_dir(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(
            f"{out} is not empty; pass --resume to continue it or choose another --out"
        )
    if resume and not (out / "state.pt").is_file():
        raise FileNotFoundError(f"nothing to resume: {out} has no checkpoint (state.pt)")
    parts = world.size * cfg.optim.accum
    sizes = {"data.batch_size": cfg.data.batch_size}
    if cfg.deep_batches.passes:
        sizes["deep_batches.batch_size"] = cfg.deep_batches.batch_size
    if any((ph.fixed_point or 0) > 0 for ph in cfg.schedule):
        sizes["fixed_point.batch_size"] = cfg.fixed_point.batch_size
    for key, n in sizes.items():
        if n < parts:
            raise ValueError(
                f"{key} {n} cannot be split in {world.size} ranks x {cfg.optim.accum} "
                "micro-batches (optim.accum): every part needs an example"
            )
    if cfg.run.bf16 and dev.type != "cuda":
        raise ValueError("run.bf16 (bf16 autocast) needs a CUDA device (--device cuda)")
    if cfg.run.fsdp and cfg.optim.learn != "all":
        raise ValueError(
            f"run.fsdp shards the whole model: with optim.learn = '{cfg.optim.learn}' use DDP"
        )
    if cfg.run.fsdp and world.size < 2:
        raise ValueError("run.fsdp shards over the ranks: start 2 or more with torchrun")


def run_identity(cfg: TrainConfig) -> str:
    """The SHA-256 of the recipe as trained (seed included, sharding not: a run may be
    resumed with or without FSDP); a checkpoint records it, so one that another recipe or
    seed wrote, or a recipe edited since, is refused on resume."""

    text = json.dumps(without_sharding(cfg).to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


CHECKPOINT_KEYS = ("model", "opt", "step", "history")


def check_resume(cfg: TrainConfig, out: Path, dev) -> dict:
    """The checkpoint to resume, after every check a resumed run needs, each refusal one
    line naming the file: nothing in ``out`` changes before they pass."""
    if without_sharding(saved_train_config(out)) != without_sharding(cfg):
        raise ValueError(f"{out} was trained with a different config; resume it with the same one")
    path = out / "state.pt"
    saved = TrainState.read(path, dev)
    if not isinstance(saved, dict) or not all(k in saved for k in CHECKPOINT_KEYS):
        raise ValueError(
            f"{path} is not a training checkpoint of fbt-probe (it needs "
            f"{', '.join(CHECKPOINT_KEYS)})"
        )
    step, history = saved["step"], saved["history"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= cfg.steps:
        raise ValueError(f"{path} is at step {step!r}, outside this run's 0..{cfg.steps}")
    if (
        not isinstance(history, list)
        or len(history) != step
        or not isinstance(saved["model"], dict)
    ):
        raise ValueError(f"{path} is damaged: its history does not hold its {step} steps")
    if saved.get("identity", run_identity(cfg)) != run_identity(cfg):
        raise ValueError(
            f"{path} was written by another recipe or seed than "
            f"{out / 'train_config.json'} (edited since, or copied from another run)"
        )
    check_saved_weights(out / "model")
    return saved


def check_saved_weights(folder: Path) -> None:
    """The weights a run folder's ``model/`` holds can be read (a resumed run replaces them
    only at its end: a damaged file is refused before, not found after)."""

    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        try:
            with safe_open(str(f), framework="pt") as w:
                for k in w.keys():
                    w.get_slice(k)
        except Exception as e:  # safetensors raises its own error types
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{f} cannot be read ({first})") from None


def check_activation_memory(
    cfg: TrainConfig, d_model: int, n_layers: int, world: World, dev
) -> None:
    """Refuse a batch whose training step cannot fit in memory, before the run folder exists.
    The estimate is a floor: the residual stream of every layer and pass of one micro-batch's
    longest examples, kept for the backward pass, and its gradient (the attention, the MLP
    and the optimiser need more), against the same share of the machine's memory that
    ``generate`` and ``eval`` plan with (a GPU's own memory on CUDA)."""

    n_max = max((p.n_max for p in cfg.schedule if p.n_max is not None), default=MAX_DISTRACTORS)
    deepest = max((len(p.passes) for p in cfg.schedule if p.passes is not None), default=1)
    deep = cfg.deep_batches.passes
    # an ordinary batch runs fewer passes than a deep batch's least
    kinds = [("data.batch_size", cfg.data.batch_size, min(deepest, deep - 1) if deep else deepest)]
    if deep:
        kinds.append(("deep_batches.batch_size", cfg.deep_batches.batch_size, deepest))
    if any((p.fixed_point or 0) > 0 for p in cfg.schedule):
        kinds.append(("fixed_point.batch_size", cfg.fixed_point.batch_size, cfg.fixed_point.passes))
    have = (
        torch.cuda.get_device_properties(dev).total_memory
        if dev.type == "cuda"
        else machine_memory()
    )
    if have is None:
        return
    parts = world.size * cfg.optim.accum
    for key, rows, passes in kinds:
        need = math.ceil(rows / parts) * passes * n_layers * n_max * d_model * 4 * 2
        if need > MEMORY_SHARE * have:
            raise ValueError(
                f"{key} {rows} would keep at least {need / 2**30:,.0f} GiB of activations in a "
                f"step ({passes} passes of {n_max} distractors, {n_layers} layers), more than "
                f"this machine's {have / 2**30:,.0f} GiB: lower it, or raise optim.accum"
            )


def start_state(
    cfg: TrainConfig, out: Path, saved: dict | None, world: World, dev
) -> tuple[TrainState, dict]:
    """The run's state (fresh, or from its checkpoint) and the parameters each frozen prefix
    names; the run folder is made here, after every check."""
    model = build_model(cfg)  # initialised on the CPU, then moved
    check_activation_memory(cfg, model.cfg.d_model, model.cfg.n_layers, world, dev)
    if cfg.run.fsdp and not isinstance(model, FBTModel):
        raise ValueError("run.fsdp is not supported for a Hugging Face model yet (use DDP)")
    frozen = frozen_parameters(model, cfg.schedule)  # checked before anything is written
    set_learning(model, cfg.optim.learn)
    model = model.to(dev)
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    model.train()
    if saved is not None:
        load_learned(model, saved["model"], out / "state.pt")  # before any sharding
    if cfg.run.fsdp:
        from fbt_probe.train.distributed import shard_model

        shard_model(model)
        frozen = frozen_parameters(model, cfg.schedule)  # the sharded parameters now
    state = TrainState(
        model, make_optimizer(model, cfg), fsdp=cfg.run.fsdp, identity=run_identity(cfg)
    )
    if saved is not None:
        state.load_optimizer(saved)
    return state, frozen


def record_start(cfg: TrainConfig, out: Path, argv: list[str] | None) -> None:
    """The recipe, and one line per start of this run folder (the file replaced whole)."""
    write_text(out / "train_config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    command = out / "command.txt"
    before = command.read_text() if command.is_file() else ""
    write_text(command, before + shlex.join(argv if argv is not None else sys.argv) + "\n")

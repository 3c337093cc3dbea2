"""Multi-pass training: next-token loss on every pass, summed, no truncation (docs/training.md).

``train`` reads top to bottom: check the run, build its state (``TrainState``: the model,
the optimiser, the step and the history, saved and loaded whole), record how it started,
take the steps, finish. What each step trains on is drawn in ``fbt_probe.steps``, a pure
function of (recipe, step), so a resumed run reaches exactly the weights of an uninterrupted
one. What only training does to the model, the jitter noise on the fed-back state and the
schedule's share of the smeared keys, is applied here through hooks, never stored on it.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fbt_probe.checkpoint import save_model, write_text
from fbt_probe.config import TOP
from fbt_probe.distributed import World
from fbt_probe.model import FBTModel, FeedbackModel
from fbt_probe.recurrence import run_recurrence
from fbt_probe.steps import (
    JitterNoise,
    StepDraw,
    TrainBatch,
    batch_counts,
    draw_step,
    example_lengths,
    lr_at,
    make_batch,
    step_parts,
)
from fbt_probe.train_config import TrainConfig
from tasks.base import MAX_DISTRACTORS
from tasks.files import atomic_write, check_output_dir, claim

STREAM_EVAL = 2  # held-out evaluation during training: neither training nor probe data


# ---- the loss -------------------------------------------------------------------------------
@torch.no_grad()
def warm_states(
    model: FeedbackModel, batch: TrainBatch, passes: int, exact: bool = False
) -> torch.Tensor:
    """Top states after ``passes`` Jacobi passes, or (``exact``) of the exact sequential
    recurrence, as at inference: no gradient, no jitter; padded positions zero."""
    was = model.training
    model.eval()
    try:
        if not exact:
            return model(batch.tokens, passes=passes, lengths=batch.lengths).states
        valid = model.length_mask(batch.tokens.shape[1], batch.lengths, batch.tokens.device)
        return run_recurrence(model, batch.tokens).states * valid[..., None]
    finally:
        model.train(was)


def multipass_loss(
    model: FeedbackModel,
    batch: TrainBatch,
    passes: int,
    cfg: TrainConfig,
    prefix_len=None,
    init_states: torch.Tensor | None = None,
    first_pass: int = 0,
    counts: tuple[int, int, int] | None = None,
):
    """Sum over passes of the (answer-weighted) mean next-token loss; per-pass stats.

    With ``init_states`` the forward continues from those states (a fixed-point batch);
    ``first_pass`` is the index of its first pass, which picks the answer weights.
    ``counts`` (targets, answer targets, examples) of the whole step's batch, when ``batch``
    is a part of it (a rank's shard, a micro-batch): every mean is then taken over the whole
    batch, so the loss and the stats of the parts add up to those of the whole."""
    out = model(
        batch.tokens,
        passes=passes,
        prefix_len=prefix_len,
        lengths=batch.lengths,
        init_states=init_states,
    )
    valid = batch.targets != -100
    total = 0.0
    stats = []
    for k, p in enumerate(out.passes, start=first_pass):
        ce = F.cross_entropy(
            p.logits.flatten(0, 1), batch.targets.flatten().clamp(min=0), reduction="none"
        ).view_as(batch.targets)
        weights = cfg.objective.answer_weight
        aw = weights[min(k, len(weights) - 1)]
        w = valid.float() + batch.answer.float() * (aw - 1.0)
        if counts is None:
            loss = (ce * w).sum() / w.sum()
        else:
            loss = (ce * w).sum() / (counts[0] + counts[1] * (aw - 1.0))
        total = total + loss
        with torch.no_grad():
            pred = p.logits.argmax(-1)
            correct = ((pred == batch.targets) | ~batch.answer).all(dim=1)
            if counts is None:
                stats.append(
                    {
                        "loss": float((ce * valid).sum() / valid.sum()),
                        "answer_acc": float(correct.float().mean()),
                    }
                )
            else:
                stats.append(
                    {
                        "loss": float((ce * valid).sum()) / counts[0],
                        "answer_acc": float(correct.sum()) / counts[2],
                    }
                )
    return total, stats


@torch.no_grad()
def quick_eval(model: FeedbackModel, cfg: TrainConfig, passes: int = 2) -> dict:
    """Teacher-forced answer accuracy on held-out examples (n in 1..256), per task and pass."""
    was = model.training
    model.eval()
    rng = np.random.default_rng(np.random.SeedSequence([cfg.run.seed, STREAM_EVAL]))
    from tasks import get_task

    res = {}
    for task in cfg.tasks:
        mod = get_task(task)
        params = mod.Params(**cfg.data.task_params.get(task, {}))
        exs = [
            mod.sample(rng, int(rng.integers(1, MAX_DISTRACTORS + 1)), params)
            for _ in range(cfg.run.eval_examples)
        ]
        b = make_batch(exs, encoding=getattr(model, "encoding", None))
        b = b.to(next(model.parameters()).device)
        out = model(b.tokens, passes=passes, lengths=b.lengths)
        for k, p in enumerate(out.passes):
            ok = ((p.logits.argmax(-1) == b.targets) | ~b.answer).all(dim=1)
            res[f"{task}/pass{k + 1}"] = float(ok.float().mean())
    model.train(was)
    return res


# ---- what only training does to the model ----------------------------------------------------
def jitter_hook(model: FeedbackModel, noise: JitterNoise, rows: torch.Tensor):
    """The paper's jitter: uniform noise of scale ``model.cfg.jitter`` on the fed-back state
    before it is fused, in training mode only, each row of the step's batch its own noise
    (``JitterNoise``) whatever part of the batch this forward holds."""
    scale = model.cfg.jitter

    def add(state: torch.Tensor, hook):
        if not model.training:
            return None  # warm states and evaluation see the clean state
        n = noise.take(hook.ctx.get("pass") or 0, rows, state.shape[1]).to(state.dtype)
        return state + (n * 2 - 1) * scale

    return ("fusion.hook_state", add)


def smear_hooks(model: FeedbackModel, share: float) -> list:
    """The schedule's ``smear`` below 1: each smeared head's weight on the previous key
    scaled by ``share`` (0: plain keys); a saved model always runs at 1."""
    if share == 1.0:
        return []
    names = [n for n in model.hook_dict if n.endswith("attn.hook_smear")]
    return [(n, lambda a, hook: 1.0 - share * (1.0 - a)) for n in names]


def train_step(net, model: FeedbackModel, draw: StepDraw, cfg: TrainConfig, world: World, dev):
    """Forward and backward of one step: this rank's rows of the step's batch (all of them
    in one process), one forward per part (``step_parts``). Every mean is over the whole
    batch, so the gradients (averaged by DDP over the ranks) are those of the whole batch
    whatever the split. Returns the whole batch's loss, per-pass stats and token count."""
    full = draw.examples
    enc = getattr(model, "encoding", None)
    n_valid, n_answer, n, T = batch_counts(full, enc)
    parts = step_parts(n, example_lengths(full, enc), cfg, world)
    noise = JitterNoise(draw.jitter_seed, T, model.cfg.d_model, dev)
    torch.manual_seed(draw.jitter_seed)  # any other randomness of the model (dropout)
    loss_sum, stats_sum, tokens = 0.0, None, 0
    for j, idx in enumerate(parts):
        mb = make_batch([full[i] for i in idx], T if cfg.run.fsdp else None, enc).to(dev)
        prefix = None if draw.prefix is None else torch.tensor(draw.prefix[idx], device=dev)
        jitter = (
            [jitter_hook(model, noise, torch.tensor(idx, device=dev))]
            if model.cfg.jitter > 0
            else []
        )
        with model.hooks(fwd_hooks=jitter):
            init = warm_states(model, mb, draw.warm, cfg.fixed_point.exact) if draw.warm else None
            last = j == len(parts) - 1
            # FSDP reduces every part's gradients (no no_sync); DDP only the last's
            sync = nullcontext() if last or world.size == 1 or cfg.run.fsdp else net.no_sync()
            with sync:
                loss, stats = multipass_loss(net, mb, draw.passes, cfg, prefix, init,
                                             first_pass=draw.warm, counts=(n_valid, n_answer, n))  # fmt: skip
                (loss * world.size).backward()  # DDP averages over ranks: undo it
        loss_sum += loss.item()
        tokens += mb.n_tokens
        flat = [v for st in stats for v in st.values()]
        stats_sum = (
            flat if stats_sum is None else [x + y for x, y in zip(stats_sum, flat, strict=True)]
        )
    total = [loss_sum, float(tokens), *stats_sum]
    total = world.all_sum(total, dev) if world.size > 1 else total
    keys = list(stats[0])
    merged = [dict(zip(keys, total[2 + i * len(keys) : 2 + (i + 1) * len(keys)], strict=True))
              for i in range(len(stats))]  # fmt: skip
    return total[0], merged, int(total[1])


# ---- the run folder -------------------------------------------------------------------------
def git_revision() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
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


def autocast(cfg: TrainConfig, dev: torch.device):
    """bf16 autocast on CUDA when the recipe asks for it (``run.bf16``); otherwise nothing."""
    from contextlib import nullcontext

    if cfg.run.bf16 and dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---- building a run ---
def build_model(cfg: TrainConfig):
    """The model a run starts from: the built-in one drawn from ``cfg.model`` and the seed,
    or the model ``cfg.init_from`` names. A Hugging Face folder is trained with its own
    architecture; ``model.fusion`` and ``model.jitter`` of the recipe apply to its fusion
    (the saved one, or a fresh one for an upcycling start), the rest of ``model.*`` does not."""
    if cfg.init_from:
        from fbt_probe.hf import is_hf_folder, load_hf

        path = init_folder(cfg)
        if is_hf_folder(path):
            if cfg.model.feedback_source != TOP or cfg.model.feedback_target != 0:
                raise ValueError("model.feedback_source and model.feedback_target: a Hugging Face "
                                 "model feeds its top state into its embeddings only")  # fmt: skip
            m = load_hf(path, fusion=cfg.model.fusion, seed=cfg.run.seed)
            if m.cfg.fusion != cfg.model.fusion:
                raise ValueError(
                    f"init_from {cfg.init_from!r} has a {m.cfg.fusion} fusion, the recipe sets "
                    f"model.fusion={cfg.model.fusion}"
                )
            if m.encoding is None:
                raise ValueError(f"init_from {cfg.init_from!r} has no tokenizer beside the model")
            m.cfg = replace(m.cfg, jitter=cfg.model.jitter)
            return m
    model = FBTModel(cfg.model, seed=cfg.run.seed)
    if cfg.init_from:
        model.load_state_dict(initial_weights(cfg).state_dict())
    return model


def init_folder(cfg: TrainConfig) -> Path:
    """The model folder ``cfg.init_from`` names (a run folder stands for its ``model/``)."""
    from fbt_probe.registry import model_folder

    return model_folder(cfg.init_from)


def initial_weights(cfg: TrainConfig) -> FBTModel:
    """The model ``cfg.init_from`` names, checked against ``cfg.model``."""
    from fbt_probe.registry import resolve_model

    src, _ = resolve_model(cfg.init_from)
    mine = cfg.model.to_dict()
    diff = sorted(k for k, v in src.cfg.to_dict().items() if k != "jitter" and mine.get(k) != v)
    if diff:  # jitter only acts in training: it may differ
        raise ValueError(
            f"init_from {cfg.init_from!r} has a different model config ({', '.join(diff)}); "
            "set the same model.* fields"
        )
    return src


def frozen_parameters(model: FeedbackModel, schedule) -> dict[str, list]:
    """Each prefix any phase freezes -> the parameters whose names start with it; a prefix
    that matches no parameter is an error."""
    named = list(model.named_parameters())
    out = {}
    for f in dict.fromkeys(f for p in schedule for f in p.frozen or ()):
        params = [p for n, p in named if n.startswith(f)]
        if not params:
            raise ValueError(
                f"frozen prefix {f!r} matches no parameter; names look like "
                f"{', '.join(n for n, _ in named[:4])}, ..."
            )
        out[f] = params
    return out


def set_learning(model: FeedbackModel, learn: str) -> None:
    """``optim.learn``: "all" parameters learn, or the "fusion" only (the rest get no
    gradient, so neither their gradients nor AdamW's state for them take memory)."""
    for n, p in model.named_parameters():
        p.requires_grad_(learn == "all" or n.startswith("fusion."))


def learned_state(model: FeedbackModel) -> dict:
    """The entries of the model's state that training changes: all of it, or under
    ``optim.learn = "fusion"`` the fusion's (a checkpoint then holds no copy of the stack)."""
    sd = model.state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return sd
    learned = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in learned}


def load_learned(model: FeedbackModel, saved: dict, where: Path) -> None:
    """A checkpoint's ``learned_state`` back into ``model``."""
    want = learned_state(model).keys()
    if set(saved) != set(want):
        raise ValueError(f"{where} holds other parameters than this run trains "
                         f"({len(saved)} saved, {len(want)} trained); resume it with its own recipe")  # fmt: skip
    model.load_state_dict(saved, strict=False)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that learn, with weight decay on the matrices only (betas
    0.9 / 0.95)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(0.9, 0.95))


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
            from fbt_probe.distributed import full_states

            msd, osd = full_states(self.model, self.opt)
        if world.main:
            state = {"model": msd, "opt": osd if self.fsdp else self.opt.state_dict(),
                     "step": self.step, "history": self.history, "identity": self.identity}  # fmt: skip
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
            from fbt_probe.distributed import load_optimizer

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
            raise ValueError(f"{key} {n} cannot be split in {world.size} ranks x {cfg.optim.accum} "
                             "micro-batches (optim.accum): every part needs an example")  # fmt: skip
    if cfg.run.bf16 and dev.type != "cuda":
        raise ValueError("run.bf16 (bf16 autocast) needs a CUDA device (--device cuda)")
    if cfg.run.fsdp and cfg.optim.learn != "all":
        raise ValueError("run.fsdp shards the whole model: with optim.learn = 'fusion' use DDP")
    if cfg.run.fsdp and world.size < 2:
        raise ValueError("run.fsdp shards over the ranks: start 2 or more with torchrun")


def run_identity(cfg: TrainConfig) -> str:
    """The SHA-256 of the recipe as trained (seed included, sharding not: a run may be
    resumed with or without FSDP); a checkpoint records it, so one that another recipe or
    seed wrote, or a recipe edited since, is refused on resume."""
    import hashlib

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
        raise ValueError(f"{path} is not a training checkpoint of fbt-probe (it needs "
                         f"{', '.join(CHECKPOINT_KEYS)})")  # fmt: skip
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
        raise ValueError(f"{path} was written by another recipe or seed than "
                         f"{out / 'train_config.json'} (edited since, or copied from another run)")  # fmt: skip
    check_saved_weights(out / "model")
    return saved


def check_saved_weights(folder: Path) -> None:
    """The weights a run folder's ``model/`` holds can be read (a resumed run replaces them
    only at its end: a damaged file is refused before, not found after)."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        try:
            with safe_open(str(f), framework="pt") as w:
                for k in w.keys():
                    w.get_slice(k)
        except Exception as e:  # safetensors raises its own error types
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{f} cannot be read ({first})") from None


def check_activation_memory(cfg: TrainConfig, d_model: int, n_layers: int, world: World,
                            dev) -> None:  # fmt: skip
    """Refuse a batch whose training step cannot fit in memory, before the run folder exists.
    The estimate is a floor: the residual stream of every layer and pass of one micro-batch's
    longest examples, kept for the backward pass, and its gradient (the attention, the MLP
    and the optimiser need more), against the same share of the machine's memory that
    ``generate`` and ``eval`` plan with (a GPU's own memory on CUDA)."""
    from tasks.generate import MEMORY_SHARE, machine_memory

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
        from fbt_probe.distributed import shard_model

        shard_model(model)
        frozen = frozen_parameters(model, cfg.schedule)  # the sharded parameters now
    state = TrainState(model, make_optimizer(model, cfg), fsdp=cfg.run.fsdp,
                       identity=run_identity(cfg))  # fmt: skip
    if saved is not None:
        state.load_optimizer(saved)
    return state, frozen


def record_start(cfg: TrainConfig, out: Path, argv: list[str] | None) -> None:
    """The recipe, and one line per start of this run folder (the file replaced whole)."""
    write_text(out / "train_config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    command = out / "command.txt"
    before = command.read_text() if command.is_file() else ""
    write_text(command, before + shlex.join(argv if argv is not None else sys.argv) + "\n")


def parallel(model, world: World, fsdp: bool):
    """The module the steps run: DistributedDataParallel under torchrun, else the model."""
    if world.size == 1 or fsdp:
        return model
    from torch.nn.parallel import DistributedDataParallel

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
        return "  ".join(f"{k if k == 'fp' else f'pass{k}'}: loss {v['loss']:.3f} acc {v['answer_acc']:.2f}"
                         for k, v in order)  # fmt: skip


def take_step(state: TrainState, net, cfg: TrainConfig, draw: StepDraw, frozen: dict,
              monitor: Monitor, world: World, dev, out: Path):  # fmt: skip
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
    rec = {"step": step + 1, "passes": draw.passes, "loss": lv, "lr": lr_at(cfg, step),
           "grad_norm": gnorm}  # fmt: skip
    if draw.warm:
        rec["fp_warm"] = "recurrence" if cfg.fixed_point.exact else draw.warm
        rec.update({f"fp/{m}": v for m, v in stats[-1].items()})
    else:
        rec.update({f"pass{k + 1}/{m}": v for k, s in enumerate(stats) for m, v in s.items()})
    return rec


def run_steps(state: TrainState, net, cfg: TrainConfig, frozen: dict, world: World, dev,
              out: Path, end: int, clock: Clock, progress=None, max_minutes: float = 0.0) -> None:  # fmt: skip
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


def finish(state: TrainState, cfg: TrainConfig, out: Path, world: World, dev, clock: Clock,
           revision: str, max_minutes: float) -> dict:  # fmt: skip
    """The last checkpoint, the final evaluation, metrics.json and the model folder."""
    full = state.save(out / "state.pt", world)
    clock.lap("checkpoint")
    model = state.model.eval()
    final_eval = quick_eval(model, cfg) if world.main or cfg.run.fsdp else {}
    clock.lap("eval")
    done = {"steps_done": state.step, "steps": cfg.steps, "finished": state.step >= cfg.steps,
            "final_eval": final_eval, "history": state.history, "world_size": world.size}  # fmt: skip
    if not world.main:
        world.barrier()  # rank 0 writes the checkpoint, the metrics and the model
        return done
    if full is not None:  # the gathered weights, in an unsharded model that save_model writes
        model = FBTModel(cfg.model, seed=cfg.run.seed)
        model.load_state_dict(full)
    metrics = {
        "name": cfg.name, **{k: done[k] for k in ("steps_done", "steps", "finished")},
        "seed": cfg.run.seed, "git_revision": revision, "device": str(dev),
        # the bits of the weights depend on these too (and on the CPU's instruction set):
        # the same config, seed, torch version and thread count give the same weights
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "wall_seconds_this_call": clock.minutes() * 60,
        "seconds": {k: round(v, 2) for k, v in clock.spent.items()}, "max_minutes": max_minutes,
        "world_size": world.size,
        "sharding": "fsdp" if cfg.run.fsdp else "ddp" if world.size > 1 else "none",
        "accum": cfg.optim.accum, "per_rank_batch": -(-cfg.data.batch_size // world.size),
        "tokens_per_second": clock.tokens_per_second(), "final_eval": final_eval,
        "history": state.history,
    }  # fmt: skip
    write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    save_run_model(model, cfg, out / "model", {"train_config": cfg.to_dict(),
                                               "steps_done": state.step, "git_revision": revision})  # fmt: skip
    world.barrier()
    return metrics


def save_run_model(model, cfg: TrainConfig, folder: Path, meta: dict) -> None:
    """The trained model as a model folder: the built-in format, or a Hugging Face folder
    with the fusion beside it (``fbt_probe.hf``)."""
    if isinstance(model, FBTModel):
        save_model(model, folder, extra_meta=meta)
        return
    from fbt_probe.hf import base_folder, read_fusion_config, save_fusion, save_hf

    extra = {"fbt_probe_meta.json": json.dumps(meta, indent=2) + "\n"}
    if cfg.optim.learn == "all":
        save_hf(model, folder, extra=extra)
        return
    # the stack is the start's own: the folder holds the fusion and names that base
    start = init_folder(cfg)
    saved = read_fusion_config(start)
    base = base_folder(start, saved["base"]) if saved and "base" in saved else start
    save_fusion(model, folder, base, extra=extra)


def train(cfg: TrainConfig, out_dir: str | Path, resume: bool = False, progress=None,
          stop_after: int | None = None, argv: list[str] | None = None, device: str = "cpu",
          max_minutes: float = 0.0, world: World | None = None) -> dict:  # fmt: skip
    """Train ``cfg`` into ``out_dir``; returns the final metrics.

    ``device`` ("cpu", "cuda", "cuda:1", ...) is where the model trains; the examples, the
    initial weights and the schedule do not depend on it, the floating-point results do.
    ``progress(step, total, info)`` is called every step. ``stop_after`` ends the run early
    at that step (with a checkpoint), as an interruption would; so does ``max_minutes`` of
    wall time (0 = no limit). On NaN or divergence the run stops with ``Divergence`` and the
    last good checkpoint stays in place. ``world`` (``fbt_probe.distributed``): under
    torchrun each rank trains on its rows of every step's batch, and only rank 0 writes.
    """
    out, world = Path(out_dir), world or World()
    dev = rank_device_of(device, world)  # before anything is written
    with claim(out) if world.main else nullcontext():  # rank 0 is the one writer
        return _train(cfg, out, resume, progress, stop_after, argv, dev, max_minutes, world)


def _train(cfg: TrainConfig, out: Path, resume: bool, progress, stop_after: int | None,
           argv: list[str] | None, dev, max_minutes: float, world: World) -> dict:  # fmt: skip
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
    from fbt_probe.device import resolve_device
    from fbt_probe.distributed import rank_device

    return rank_device(resolve_device(device), world)


def train_recipe(*, config: str | None = None, overrides: list[str] | None = None,
                 out: str | Path | None = None, init_from: str | Path | None = None,
                 resume: bool = False, stop_after: int | None = None, max_minutes: float = 0.0,
                 device: str = "cpu", as_default: bool = False, argv: list[str] | None = None,
                 bars=None) -> tuple[dict, Path, TrainConfig]:  # fmt: skip
    """``fbt-probe train``: the recipe ``config`` names (with ``--set`` ``overrides``;
    default: 'default', or under ``resume`` the run folder's own) trained into ``out``
    (default runs/<name>), then, with ``as_default``, installed as the built-in model.
    ``bars(label, total)`` makes the progress bar. Returns (metrics, run folder, recipe);
    under torchrun rank 0 reports and installs."""
    from fbt_probe.distributed import place
    from fbt_probe.recipes import build_recipe
    from fbt_probe.registry import install_default

    if resume and out is None:
        raise ValueError("--resume needs --out, the run folder to continue")
    rank_device_of(device, World())  # a bad --device fails before anything is written
    cfg = build_recipe(config=config, overrides=overrides, init_from=init_from,
                       run_dir=Path(out) if resume else None)  # fmt: skip
    if as_default and stop_after is not None and stop_after < cfg.steps:
        raise ValueError(
            f"--as-default needs the whole run: --stop-after {stop_after} < steps {cfg.steps}"
        )
    out = Path(out) if out is not None else Path("runs") / cfg.name
    _, world = place(device)  # under torchrun: this rank of the world
    with bars(f"train {cfg.name}", cfg.steps) if bars and world.main else nullcontext() as bar:
        metrics = train(cfg, out, resume=resume, progress=bar, stop_after=stop_after, argv=argv,
                        device=device, max_minutes=max_minutes, world=world)  # fmt: skip
    if as_default and world.main:
        if not metrics["finished"]:
            raise ValueError(
                f"not installed as the default: the run stopped at step {metrics['steps_done']}"
            )
        metrics["installed"] = str(install_default(out))
    return metrics, out, cfg

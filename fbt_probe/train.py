"""Multi-pass training: next-token loss on every pass, summed, no truncation (docs/training.md).

Every step is a pure function of (recipe, step): the plan of its phase, the batch, the pass
count, the prefix lengths and the jitter noise are all drawn from generators keyed by the
step (``draw_step``), so a run resumed from a checkpoint reaches exactly the weights of an
uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fbt_probe.checkpoint import save_model, write_text
from fbt_probe.distributed import World, rank_device, rows
from fbt_probe.model import FBTModel, JitterNoise
from fbt_probe.recipes import named_config  # noqa: F401  (re-exported: the recipes by name)
from fbt_probe.recurrence import run_recurrence
from fbt_probe.schedule import Plan, plan_at
from fbt_probe.train_config import TrainConfig
from tasks import vocab
from tasks.base import Example
from tasks.dataset import atomic_write
from tasks.sampler import TrainingStream

STREAM_EVAL = 2  # held-out evaluation during training: neither training nor probe data


# ---- schedules ---------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    t = (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps)
    return o.lr * (
        o.min_lr_frac + (1 - o.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    )


def plan_of(cfg: TrainConfig, step: int) -> Plan:
    """The schedule's plan for ``step`` (task shares, pass mix, counts, frozen, ...)."""
    return plan_at(cfg.schedule, step / cfg.steps)


# ---- batches -----------------------------------------------------------------------------
@dataclass
class Batch:
    tokens: torch.Tensor  # (batch, pos), right-padded
    targets: torch.Tensor  # (batch, pos) next token, -100 where none
    answer: torch.Tensor  # (batch, pos) bool: the target is an answer token
    lengths: torch.Tensor  # (batch,)
    prompt_len: torch.Tensor  # (batch,) tokens up to and including the colon
    tasks: list[str]

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> Batch:
        return replace(
            self,
            **{
                f: getattr(self, f).to(device)
                for f in ("tokens", "targets", "answer", "lengths", "prompt_len")
            },
        )


def make_batch(examples: list[Example], pad_to: int | None = None, encoding=None) -> Batch:
    """``pad_to``: the padded length (default: the longest example's). ``encoding``: a
    model's tokenizer (``tasks.encoding.TokenizerEncoding``) instead of the word vocabulary."""
    if encoding is None:
        ids = [vocab.encode(ex.tokens) for ex in examples]
        colons = [ex.colon_index for ex in examples]
    else:
        enc = [encoding.encode(ex) for ex in examples]
        ids, colons = [e.ids for e in enc], [e.colon_index for e in enc]
    T = max(max(len(x) for x in ids), pad_to or 0)
    tokens = torch.full((len(ids), T), vocab.PAD_ID, dtype=torch.long)
    targets = torch.full((len(ids), T), -100, dtype=torch.long)
    answer = torch.zeros((len(ids), T), dtype=torch.bool)
    for i, (x, c) in enumerate(zip(ids, colons, strict=True)):
        tokens[i, : len(x)] = torch.tensor(x)
        targets[i, : len(x) - 1] = torch.tensor(x[1:])
        answer[i, c : len(x) - 1] = True
    lengths = torch.tensor([len(x) for x in ids])
    prompt_len = torch.tensor([c + 1 for c in colons])
    return Batch(tokens, targets, answer, lengths, prompt_len, [ex.task for ex in examples])


def step_rng(cfg: TrainConfig, step: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.run.seed, 777, step]))


def step_examples(
    cfg: TrainConfig, stream: TrainingStream, step: int, plan: Plan, passes: int, warm: int
) -> list[Example]:
    """Step ``step``'s examples: a fixed-point batch (``warm`` > 0) or a deep-pass batch
    (``deep_batches``) draws long counts, an ordinary one the data's count distribution."""
    args = (plan.tasks, plan.n_max, plan.overwrites)
    if warm:
        fp = cfg.fixed_point
        return stream.batch(step, fp.batch_size, *args, n_min=fp.n_min)
    deep = cfg.deep_batches
    if deep.passes and passes >= deep.passes:
        return stream.batch(step, deep.batch_size, *args, n_min=deep.n_min)
    return stream.batch(step, cfg.data.batch_size, *args)


def fixed_point_draw(cfg: TrainConfig, step: int, share: float) -> int:
    """0 if step ``step`` is an ordinary batch, else its number of warm (no-gradient) passes.

    Drawn from a generator of its own, so the other draws of a step never depend on it."""
    if share <= 0:
        return 0
    rng = np.random.default_rng(np.random.SeedSequence([cfg.run.seed, 778, step]))
    if rng.random() >= share:
        return 0
    return int(rng.integers(cfg.fixed_point.warm[0], cfg.fixed_point.warm[1] + 1))


@dataclass(frozen=True)
class StepDraw:
    """Everything random about one training step, drawn before any arithmetic."""

    plan: Plan
    passes: int
    warm: int  # 0, or the fixed-point batch's warm passes
    examples: list[Example]
    prefix: np.ndarray | None  # (batch,) plain-prefix lengths under prefix mixin
    jitter_seed: int


def draw_step(cfg: TrainConfig, stream: TrainingStream, step: int) -> StepDraw:
    """Step ``step``'s draws: a pure function of (config, step)."""
    plan = plan_of(cfg, step)
    rng = step_rng(cfg, step)
    passes = int(rng.choice(len(plan.passes), p=plan.passes)) + 1
    warm = fixed_point_draw(cfg, step, plan.fixed_point)
    if warm:
        passes = cfg.fixed_point.passes
    examples = step_examples(cfg, stream, step, plan, passes, warm)
    prefix = None
    if cfg.objective.prefix_mixin and passes > 1 and not warm:
        n = len(examples)
        prompt_len = np.array([ex.colon_index + 1 for ex in examples])
        use = rng.random(n) < cfg.objective.prefix_prob
        draw = np.floor(rng.random(n) * prompt_len)
        prefix = np.where(use, draw.astype(int), 0)
    if plan.soft > 0 and passes > 1 and not warm:  # drawn only where a phase asks for it
        n = len(examples)
        soft = rng.random(n) < plan.soft
        whole = np.array([ex.colon_index + 1 for ex in examples])  # the colon plain too
        prefix = np.where(soft, whole, 0 if prefix is None else prefix)
    return StepDraw(plan, passes, warm, examples, prefix, cfg.run.seed * 1_000_003 + step)


def stream_digest(cfg: TrainConfig, every: int = 100) -> dict:
    """A digest of the whole training stream: per step the pass count, the fixed-point draw,
    the batch's tokens, the prefix lengths, the frozen prefixes, the jitter seed and the
    learning rate. Equal digests mean the same training run, step by step. Also returns one
    short digest for each ``every`` steps, to find where two streams part."""
    import hashlib

    stream = cfg.stream()
    total, chunk, chunks = hashlib.sha256(), hashlib.sha256(), []
    for step in range(cfg.steps):
        s = draw_step(cfg, stream, step)
        batch = make_batch(s.examples)
        h = hashlib.sha256(batch.tokens.numpy().tobytes())
        h.update(",".join(batch.tasks).encode())
        rec = {
            "step": step,
            "passes": s.passes,
            "warm": s.warm,
            "batch": h.hexdigest()[:16],
            "shape": list(batch.tokens.shape),
            "prefix": None if s.prefix is None else s.prefix.tolist(),
            "frozen": sorted(s.plan.frozen),
            "jitter_seed": s.jitter_seed,
            "lr": repr(lr_at(cfg, step)),
        }
        if s.plan.smear != 1.0:  # only where a phase sets it: the recipes' digests stand
            rec["smear"] = repr(s.plan.smear)
        b = json.dumps(rec, sort_keys=True).encode()
        total.update(b)
        chunk.update(b)
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            chunks.append(chunk.hexdigest()[:12])
            chunk = hashlib.sha256()
    return {"steps": cfg.steps, "digest": total.hexdigest(), f"per_{every}_steps": chunks}


@torch.no_grad()
def warm_states(model: FBTModel, batch: Batch, passes: int, exact: bool = False) -> torch.Tensor:
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
    model: FBTModel,
    batch: Batch,
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


def example_lengths(examples: list[Example], encoding=None) -> list[int]:
    """Each example's length in tokens (words, or ``encoding``'s tokens)."""
    if encoding is None:
        return [len(ex.tokens) for ex in examples]
    return [len(encoding.encode(ex).ids) for ex in examples]


def batch_counts(examples: list[Example], encoding=None) -> tuple[int, int, int, int]:
    """(targets, answer targets, examples, padded length) of the batch ``make_batch`` makes."""
    lens = example_lengths(examples, encoding)
    if encoding is None:
        colons = [ex.colon_index for ex in examples]
    else:
        colons = [encoding.encode(ex).colon_index for ex in examples]
    answers = sum(n - 1 - c for n, c in zip(lens, colons, strict=True))
    return sum(n - 1 for n in lens), answers, len(examples), max(lens)


# ---- evaluation during training (teacher-forced answers, every pass) ---------------------
@torch.no_grad()
def quick_eval(model: FBTModel, cfg: TrainConfig, passes: int = 2) -> dict:
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
            mod.sample(rng, int(rng.integers(1, 257)), params) for _ in range(cfg.run.eval_examples)
        ]
        b = make_batch(exs, encoding=getattr(model, "encoding", None))
        b = b.to(next(model.parameters()).device)
        out = model(b.tokens, passes=passes, lengths=b.lengths)
        for k, p in enumerate(out.passes):
            ok = ((p.logits.argmax(-1) == b.targets) | ~b.answer).all(dim=1)
            res[f"{task}/pass{k + 1}"] = float(ok.float().mean())
    model.train(was)
    return res


# ---- the run -------------------------------------------------------------------------------
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


class Divergence(RuntimeError):
    pass


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


def _save_state(path: Path, model, opt, step: int, history: list) -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


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
    wall time (0 = no limit), a property of the run, not of the recipe. On NaN or divergence the
    run stops with ``Divergence`` and the last good checkpoint stays in place.

    ``world`` (``fbt_probe.distributed``): under torchrun each rank trains on its rows of
    every step's batch inside DistributedDataParallel, and only rank 0 writes.
    """
    out = Path(out_dir)
    state_path = out / "state.pt"
    world = world or World()
    dev = rank_device(resolve_device(device), world)  # before anything is written
    from tasks.dataset import check_output_dir

    check_output_dir(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(
            f"{out} is not empty; pass --resume to continue it or choose another --out"
        )
    if resume and not state_path.is_file():
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
    fsdp = cfg.run.fsdp
    if fsdp and world.size < 2:
        raise ValueError("run.fsdp shards over the ranks: start 2 or more with torchrun")
    world.barrier()  # every rank has checked before rank 0 writes anything
    model = build_model(cfg)  # initialised on the CPU, then moved
    if fsdp and not isinstance(model, FBTModel):
        raise ValueError("run.fsdp is not supported for a Hugging Face model yet (use DDP)")
    frozen = frozen_parameters(model, cfg.schedule)  # checked before anything is written
    model = model.to(dev)
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    model.train()
    st = None
    if resume:
        if without_sharding(saved_train_config(out)) != without_sharding(cfg):
            raise ValueError(
                f"{out} was trained with a different config; resume it with the same one"
            )
        try:
            st = torch.load(state_path, weights_only=False, map_location=dev)
        except (RuntimeError, EOFError, OSError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"{state_path} cannot be read ({first}); it may be truncated"
            ) from None
        model.load_state_dict(st["model"])  # the whole model, before any sharding
    if fsdp:
        from fbt_probe.distributed import shard_model

        shard_model(model)
        frozen = frozen_parameters(model, cfg.schedule)  # the sharded parameters now
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=(0.9, 0.95),
    )
    start, history = 0, []
    if st is not None:
        if fsdp:
            from fbt_probe.distributed import load_optimizer

            load_optimizer(model, opt, st["opt"])
        else:
            opt.load_state_dict(st["opt"])
        start, history = st["step"], st["history"]

    def checkpoint(step: int) -> dict | None:
        """Write state.pt (rank 0); under FSDP every rank gathers the shards first. Returns
        the whole model's state under FSDP."""
        if not fsdp:
            if world.main:
                _save_state(state_path, model, opt, step, history)
            return None
        from fbt_probe.distributed import full_states

        msd, osd = full_states(model, opt)
        if world.main:
            state = {"model": msd, "opt": osd, "step": step, "history": history}
            atomic_write(state_path, lambda tmp: torch.save(state, tmp))
        return msd

    if world.main:
        write_text(out / "train_config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        # one line per start of this run folder, the file replaced whole (never half a line)
        command = out / "command.txt"
        before = command.read_text() if command.is_file() else ""
        write_text(command, before + shlex.join(argv if argv is not None else sys.argv) + "\n")
    net = model
    if world.size > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters: a one-pass step never reaches the fusion's parameters, and
        # which steps are one-pass changes along the schedule, so the graph is not static
        # (static_graph would assume every step uses the same parameters)
        # broadcast_buffers off: the only buffers are the rotary tables, fixed by the config,
        # and ranks may run different numbers of forwards in a step (their length buckets)
        net = DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)
    stream = cfg.stream()
    revision = git_revision()  # at the start: the code that trains, not what changed meanwhile
    t0 = time.monotonic()
    tokens_seen, tok_t0 = 0, time.monotonic()
    recent: list[float] = []
    running = {}
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    step = start
    # where this call's wall time goes (metrics.json "seconds"): drawing the batches, the
    # training steps (forward, backward, AdamW), the quick evals and the checkpoints
    spent = {"draw": 0.0, "step": 0.0, "eval": 0.0, "checkpoint": 0.0}
    clock = time.monotonic()

    def lap(part: str) -> None:
        nonlocal clock
        now = time.monotonic()
        spent[part] += now - clock
        clock = now

    for step in range(start, end):
        lap("step")  # the loop's own bookkeeping counts with the step
        draw = draw_step(cfg, stream, step)
        lap("draw")
        passes, warm = draw.passes, draw.warm
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        if cfg.model.smear_keys:
            model.smear_scale(draw.plan.smear)
        with autocast(cfg, dev):
            lv, stats, n_tokens = train_step(net, model, draw, cfg, world, dev)
        if diverged(lv / passes, recent):
            raise Divergence(
                f"training diverged at step {step} (loss per pass {lv / passes:.4g}, recent median "
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
        recent = (recent + [lv / passes])[-200:]
        # the exact recurrence runs each token through the stack once, Jacobi warm-up ``warm`` times
        tokens_seen += n_tokens * (passes + (min(warm, 1) if cfg.fixed_point.exact else warm))
        # a fixed-point batch's stats go under "fp" (its last pass), not under its pass index
        for k, s in [("fp", stats[-1])] if warm else enumerate(stats, start=1):
            prev = running.get(k, s)
            running[k] = {m: 0.95 * prev[m] + 0.05 * s[m] for m in s}
        rec = {
            "step": step + 1,
            "passes": passes,
            "loss": lv,
            "lr": lr_at(cfg, step),
            "grad_norm": gnorm,
        }
        if warm:
            rec["fp_warm"] = "recurrence" if cfg.fixed_point.exact else warm
            rec.update({f"fp/{m}": v for m, v in stats[-1].items()})
        else:
            rec.update({f"pass{k + 1}/{m}": v for k, s in enumerate(stats) for m, v in s.items()})
        # under FSDP every rank takes part in a forward
        if (world.main or fsdp) and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.steps):
            lap("step")
            rec["eval"] = quick_eval(model, cfg)
            lap("eval")
        history.append(rec)
        if progress is not None and world.main:
            tps = tokens_seen / max(1e-9, time.monotonic() - tok_t0)
            info = "  ".join(
                f"{k if k == 'fp' else f'pass{k}'}: loss {v['loss']:.3f} acc {v['answer_acc']:.2f}"
                for k, v in sorted(  # passes in order, the fixed-point batches last
                    running.items(), key=lambda kv: float("inf") if kv[0] == "fp" else kv[0]
                )
            )
            progress(step + 1, cfg.steps, f"{info}  {tps:,.0f} tok/s")
        if (step + 1) % cfg.run.checkpoint_every == 0:
            lap("step")
            checkpoint(step + 1)
            lap("checkpoint")
        # every rank stops at the same step: rank 0's clock decides
        if (
            max_minutes
            and world.all_sum(
                [float(world.main and (time.monotonic() - t0) / 60 > max_minutes)], dev
            )[0]
        ):
            checkpoint(step + 1)
            break
    lap("step")
    final_step = history[-1]["step"] if history else start
    full = checkpoint(final_step)
    lap("checkpoint")
    if cfg.model.smear_keys:  # as the saved model runs, wherever the schedule's ramp stood
        model.smear_scale(1.0)
    model.eval()
    final_eval = quick_eval(model, cfg) if world.main or fsdp else {}
    lap("eval")
    if not world.main:
        world.barrier()  # rank 0 writes the checkpoint, the metrics and the model
        return {"steps_done": final_step, "steps": cfg.steps, "finished": final_step >= cfg.steps,
                "final_eval": final_eval, "history": history, "world_size": world.size}  # fmt: skip
    if full is not None:  # the gathered weights, in an unsharded model that save_model writes
        model = FBTModel(cfg.model, seed=cfg.run.seed)
        model.load_state_dict(full)
    metrics = {
        "name": cfg.name,
        "steps_done": final_step,
        "steps": cfg.steps,
        "finished": final_step >= cfg.steps,
        "seed": cfg.run.seed,
        "git_revision": revision,
        "device": str(dev),
        # the bits of the weights depend on these too (and on the CPU's instruction set):
        # the same config, seed, torch version and thread count give the same weights
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_seconds_this_call": time.monotonic() - t0,
        "seconds": {k: round(v, 2) for k, v in spent.items()},
        "max_minutes": max_minutes,
        "world_size": world.size,
        "sharding": "fsdp" if fsdp else "ddp" if world.size > 1 else "none",
        "accum": cfg.optim.accum,
        "per_rank_batch": -(-cfg.data.batch_size // world.size),
        "tokens_per_second": tokens_seen / max(1e-9, time.monotonic() - tok_t0),
        "final_eval": final_eval,
        "history": history,
    }
    write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    meta = {"train_config": cfg.to_dict(), "steps_done": final_step, "git_revision": revision}
    if isinstance(model, FBTModel):
        save_model(model, out / "model", extra_meta=meta)
    else:  # a Hugging Face model folder, the fusion beside it (fbt_probe.hf)
        from fbt_probe.hf import save_hf

        save_hf(
            model, out / "model", extra={"fbt_probe_meta.json": json.dumps(meta, indent=2) + "\n"}
        )
    world.barrier()
    return metrics


def autocast(cfg: TrainConfig, dev: torch.device):
    """bf16 autocast on CUDA when the recipe asks for it (``run.bf16``); otherwise nothing."""
    from contextlib import nullcontext

    if cfg.run.bf16 and dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# Cost of a sub-batch in padded-token units: every padded position costs 1, attention adds
# length / ATTN_TOKENS per position, and each sub-batch a fixed BUCKET_OVERHEAD (the calls of a
# pass that do not grow with the batch). Measured on a 2-core Xeon with the default model;
# bench/train.py reports what bucketing gains.
BUCKET_OVERHEAD = 200.0
ATTN_TOKENS = 460.0


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Split rows with these lengths into sub-batches (lists of row indices, each sorted by
    length) that minimise the modelled cost: rows x (longest + longest^2 / ATTN_TOKENS) +
    BUCKET_OVERHEAD per sub-batch, by dynamic programming over the rows sorted by length."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_len = [lengths[i] for i in order]
    n = len(order)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        t = sorted_len[j - 1]
        per_row = t + t * t / ATTN_TOKENS
        for i in range(j):
            c = best[i] + BUCKET_OVERHEAD + (j - i) * per_row
            if c < best[j]:
                best[j], cut[j] = c, i
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j] : j])
        j = cut[j]
    return parts[::-1]


def step_parts(n: int, lengths: list[int], cfg: TrainConfig, world: World) -> list[list[int]]:
    """The rows of a step's batch that this rank runs, as the forwards it runs them in: its
    contiguous rows, as ``optim.accum`` micro-batches, each split into length buckets
    (``run.length_buckets``; not under FSDP, where every rank must make the same calls)."""
    lo, hi = rows(n, world.rank, world.size)
    parts = []
    for m in range(cfg.optim.accum):
        a, b = rows(hi - lo, m, cfg.optim.accum)
        idx = list(range(lo + a, lo + b))
        if cfg.run.length_buckets and not cfg.run.fsdp:
            parts += [[idx[i] for i in p] for p in length_buckets([lengths[i] for i in idx])]
        else:
            parts.append(idx)
    return parts


def train_step(net, model: FBTModel, draw: StepDraw, cfg: TrainConfig, world: World, dev):
    """Forward and backward of one step: this rank's rows of the step's batch (all of them
    in one process), one forward per part (``step_parts``). Every mean is over the whole
    batch, so the gradients (averaged by DDP over the ranks) are those of the whole batch
    whatever the split. Returns the whole batch's loss, per-pass stats and token count."""
    from contextlib import nullcontext

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
        model.jitter_rows = (noise, torch.tensor(idx, device=dev))
        try:
            init = warm_states(model, mb, draw.warm, cfg.fixed_point.exact) if draw.warm else None
            last = j == len(parts) - 1
            # FSDP reduces every part's gradients (no no_sync); DDP only the last's
            sync = nullcontext() if last or world.size == 1 or cfg.run.fsdp else net.no_sync()
            with sync:
                loss, stats = multipass_loss(net, mb, draw.passes, cfg, prefix, init,
                                             first_pass=draw.warm, counts=(n_valid, n_answer, n))  # fmt: skip
                (loss * world.size).backward()  # DDP averages over ranks: undo it
        finally:
            model.jitter_rows = None
        loss_sum += loss.item()
        tokens += mb.n_tokens
        flat = [v for st in stats for v in st.values()]
        stats_sum = (
            flat if stats_sum is None else [x + y for x, y in zip(stats_sum, flat, strict=True)]
        )
    if world.size > 1:
        total = world.all_sum([loss_sum, float(tokens), *stats_sum], dev)
    else:
        total = [loss_sum, float(tokens), *stats_sum]
    keys = list(stats[0])
    merged = [dict(zip(keys, total[2 + i * len(keys) : 2 + (i + 1) * len(keys)], strict=True))
              for i in range(len(stats))]  # fmt: skip
    return total[0], merged, int(total[1])


def build_model(cfg: TrainConfig):
    """The model a run starts from: the built-in one drawn from ``cfg.model`` and the seed,
    or the model ``cfg.init_from`` names. A Hugging Face folder is trained with its own
    architecture; ``model.fusion`` and ``model.jitter`` of the recipe apply to its fusion
    (the saved one, or a fresh one for an upcycling start), the rest of ``model.*`` does not."""
    if cfg.init_from:
        from fbt_probe.hf import is_hf_folder, load_hf

        path = Path(cfg.init_from)
        if (path / "model" / "config.json").is_file() and not (path / "config.json").is_file():
            path = path / "model"
        if is_hf_folder(path):
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


def frozen_parameters(model: FBTModel, schedule) -> dict[str, list]:
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


def resolve_device(device: str) -> torch.device:
    """A torch device from "cpu", "cuda", "cuda:N" or "auto" (cuda when available), checked."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) exist"
            )
    return dev

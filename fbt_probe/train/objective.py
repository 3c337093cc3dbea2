"""The multi-pass objective: the loss summed over passes, what only training does to the model
(jitter on the fed-back state, the smear share) as hooks, and one training step."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from fbt_probe.batch import TrainBatch, make_batch
from fbt_probe.feedback import FeedbackModel
from fbt_probe.recurrence import run_recurrence
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.distributed import World
from fbt_probe.train.steps import (
    JitterNoise,
    StepDraw,
    batch_counts,
    example_lengths,
    step_parts,
)
from tasks import get_task
from tasks.base import MAX_DISTRACTORS

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
        n = noise.take((hook.ctx.get("pass_number") or 1) - 1, rows, state.shape[1]).to(state.dtype)
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
                loss, stats = multipass_loss(
                    net,
                    mb,
                    draw.passes,
                    cfg,
                    prefix,
                    init,
                    first_pass=draw.warm,
                    counts=(n_valid, n_answer, n),
                )
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
    merged = [
        dict(zip(keys, total[2 + i * len(keys) : 2 + (i + 1) * len(keys)], strict=True))
        for i in range(len(stats))
    ]
    return total[0], merged, int(total[1])

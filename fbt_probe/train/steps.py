"""What one training step is: a pure function of (recipe, step).

The plan of its phase, the batch, the pass count, the prefix lengths, the fixed-point draw
and the jitter noise are all drawn from generators keyed by the step (``draw_step``), so a
run resumed from a checkpoint reaches exactly the weights of an uninterrupted run, and a
step's rows can be split over ranks, micro-batches and length buckets (``step_parts``)
without changing what any row sees. ``stream_digest`` fingerprints a recipe's whole stream.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from fbt_probe.batch import make_batch
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.distributed import World, rows
from fbt_probe.train.schedule import Plan, plan_at
from tasks.base import Example
from tasks.sampler import TrainingStream


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
        # a step's record names the smear share only where a phase moves it off its neutral
        # 1 (the stream of every recipe without a smear ramp is the one it always was)
        if s.plan.smear != 1.0:
            rec["smear"] = repr(s.plan.smear)
        b = json.dumps(rec, sort_keys=True).encode()
        total.update(b)
        chunk.update(b)
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            chunks.append(chunk.hexdigest()[:12])
            chunk = hashlib.sha256()
    return {"steps": cfg.steps, "digest": total.hexdigest(), f"per_{every}_steps": chunks}


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


class JitterNoise:
    """The jitter noise of one training step: for pass k and row r of the step's batch, a
    uniform (length, d_model) tensor from a generator of its own, seeded by (seed, k, r).
    The noise an example gets depends only on the step, the pass, its row and the position,
    never on how the batch is split (length buckets, ranks, micro-batches); a rank draws
    only its own rows."""

    def __init__(self, seed: int, length: int, d_model: int, device=None):
        self.seed, self.shape, self.device = seed, (length, d_model), device
        # pass k -> (rows drawn so far, a buffer of the batch's rows); drawn straight into
        # the buffer and read with one gather (stacking per-row tensors was the slow part)
        self._passes: dict[int, tuple[set[int], torch.Tensor]] = {}

    def take(self, k: int, rows: torch.Tensor, length: int) -> torch.Tensor:
        """(len(rows), length, d_model): pass k's noise at batch rows ``rows``."""
        idx = rows.tolist()
        need = max(idx) + 1
        drawn, buf = self._passes.get(k, (set(), None))
        if buf is None or buf.shape[0] < need:  # rows are never beyond the step's batch
            grown = torch.empty((need, *self.shape), device=self.device)
            if buf is not None:
                grown[: buf.shape[0]] = buf
            buf = grown
        for r in idx:
            if r not in drawn:
                lo, hi = np.random.SeedSequence([self.seed, k, r]).generate_state(2)
                g = torch.Generator(device=self.device)
                g.manual_seed(int(hi) << 31 | int(lo) >> 1)
                torch.rand(self.shape, generator=g, device=self.device, out=buf[r])
                drawn.add(r)
        self._passes[k] = (drawn, buf)
        return buf[rows.to(buf.device), :length]


# Cost of a sub-batch in padded-token units: every padded position costs 1, attention adds
# length / ATTN_TOKENS per position, and each sub-batch a fixed BUCKET_OVERHEAD (the calls of a
# pass that do not grow with the batch). The two constants are fitted to step times of the
# default model (bench/train.py reports them and what bucketing gains).
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

"""Multi-pass training: next-token loss on every pass, summed, no truncation (GUIDE §1).

Every step is a pure function of (seed, step): the batch, the pass count, the prefix
lengths and the jitter noise are all drawn from generators keyed by the step, so a run
resumed from a checkpoint reaches exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fbt_probe.checkpoint import save_model
from fbt_probe.config import FBTConfig, reject_unknown_keys
from fbt_probe.model import FBTModel
from fbt_probe.recurrence import run_recurrence
from tasks import TASK_NAMES, vocab
from tasks.base import Example
from tasks.sampler import Curriculum, TrainingStream, _check_span, ramp

STREAM_EVAL = 2  # held-out evaluation during training: neither training nor probe data


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on. ``pass_mix`` is the final share of 1/2/3-pass
    batches; before ``single_pass_frac`` every batch has one pass, then the mix ramps
    linearly to ``pass_mix`` over ``mix_ramp_frac`` of training."""

    name: str = "default"
    # 16 heads of 8: pass 1's block 0 counts STEP events for done_tracking and binds
    # registers for multi_register; with 8 heads pass 1 never learned the binding
    # (docs/training.md, K2 and K3)
    # jitter 0.5 on the fed-back state in training (0.2 until P2): the layer-0 probe went from
    # 0.988 to 0.996 with it (P2 -> P3, docs/training.md)
    model: FBTConfig = field(default_factory=lambda: FBTConfig(n_heads=16, jitter=0.5))
    steps: int = 2300
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # shares of 1, 2, 3, ... passes; 10 % of batches run 4, 6 or 12 passes so that the
    # feedback is trained beyond one step of depth (docs/training.md)
    pass_mix: tuple[float, ...] = (0.15, 0.50, 0.25, 0.05, 0.0, 0.03) + (0.0,) * 5 + (0.02,)
    single_pass_frac: float = 0.04
    mix_ramp_frac: float = 0.40
    # the pass mix late in training: from ``pass_mix`` at the first fraction of training to
    # ``pass_mix_late`` at the second; () = ``pass_mix`` to the end (docs/training.md)
    pass_mix_late: tuple[float, ...] = ()
    pass_mix_late_ramp: tuple[float, float] = (1.0, 1.0)
    # deep-pass batches: a batch of at least ``deep_batch_passes`` passes (0 = off) has
    # ``deep_batch_size`` examples whose count is drawn from [deep_batch_n_min, n_max], not
    # from the curriculum's mostly short counts. Under full recurrence the default's count
    # drifted from Jacobi pass 6 on, at long counts (docs/training.md, tenth session).
    deep_batch_passes: int = 4
    deep_batch_size: int = 16
    deep_batch_n_min: int = 64
    prefix_mixin: bool = False
    prefix_prob: float = 0.5  # share of examples whose extra passes keep a plain prefix
    # fixed-point batches (fp_prob 0 = off): from ``fp_start`` of training on, this share of
    # steps runs a batch of ``fp_batch_size`` examples (counts uniform in [fp_n_min, n_max])
    # through ``fp_warm`` (a range, drawn per step) feedback passes without gradient and
    # without jitter, as at inference, then ``fp_passes`` passes with gradient that continue
    # that Jacobi iteration, with their next-token loss. The deep passes are then trained on
    # the states that full recurrence reaches, not only on those of the first few passes.
    # Not the paper's objective: the gradient stops at the warm passes (docs/training.md).
    # the default: 30 % of the steps from 55 % of training on, warm states from the exact
    # recurrence; with it full-recurrence done_tracking went from 0.979 (N1) to 1.000 (P4),
    # where a fifth of the steps (P3) reached 0.986 (docs/training.md)
    fp_prob: float = 0.3
    fp_start: float = 0.55
    fp_warm: tuple[int, int] = (8, 24)
    fp_passes: int = 2
    fp_batch_size: int = 16
    fp_n_min: int = 0
    # warm states from the exact sequential recurrence (what full-recurrence decoding
    # reads) instead of ``fp_warm`` Jacobi passes; on long prompts it is both exact and
    # cheaper than two dozen Jacobi passes (docs/training.md)
    fp_exact: bool = True
    # answer-token loss weight by pass: pass 1, pass 2, ...; the last one holds for every
    # deeper pass, so (10, 20) is 10 for pass 1 and 20 for passes >= 2
    answer_weight: tuple[float, ...] = (10.0, 20.0)
    # The default's task schedule (docs/training.md): done_tracking first, then
    # multi_register-heavy while the counts are short, then the mixture, then less
    # multi_register once the counts are long.
    mixture: dict = field(
        default_factory=lambda: {
            "delayed_memory": 0.5,
            "done_tracking": 3.0,
            "multi_register": 1.0,
        }
    )
    # task weights at step 0 (or where the first phase ends), moving linearly to ``mixture``
    # over the next ``mixture_ramp_frac`` of training; {} = ``mixture`` throughout
    mixture_start: dict = field(
        default_factory=lambda: {
            "multi_register": 1.0,
            "delayed_memory": 0.4,
            "done_tracking": 0.1,
        }
    )
    mixture_ramp_frac: float = 0.14
    mixture_hold_frac: float = 0.42  # mixture_start holds this long before its ramp begins
    # a first phase: the first ``mixture_first_frac`` of training draws from
    # ``mixture_first`` alone; the start ramp then begins where it ends ({} = no first phase)
    mixture_first: dict = field(
        default_factory=lambda: {"done_tracking": 3.0, "delayed_memory": 0.5}
    )
    mixture_first_frac: float = 0.11
    # task weights late in training: from ``mixture`` at the first fraction of training to
    # ``mixture_late`` at the second; {} = ``mixture`` to the end (docs/training.md)
    mixture_late: dict = field(
        default_factory=lambda: {
            "delayed_memory": 0.5,
            "done_tracking": 3.0,
            "multi_register": 0.35,
        }
    )
    mixture_late_ramp: tuple[float, float] = (0.72, 0.85)
    # per task, e.g. {"multi_register": {"max_overwrites": 2}}; the default draws
    # done_tracking's hard boundaries (k = 3, 4 steps) more often: its count drifted there
    # under full recurrence (docs/training.md, L2)
    task_params: dict = field(
        default_factory=lambda: {"done_tracking": {"need_weights": [1, 1, 2, 3]}}
    )
    curriculum_start: int = 8
    curriculum_end: int = 256
    curriculum_ramp_frac: float = 0.2
    curriculum_hold_frac: float = 0.5  # n_max stays at curriculum_start this long, then ramps
    curriculum_dist: str = "mixed"
    curriculum_log_share: float = 0.75  # under "mixed": the share of log-uniform batches
    # multi_register overwrites: none before the first fraction of training, the task's full
    # max_overwrites from the second on; (0, 0) = off (docs/training.md)
    overwrite_ramp: tuple[float, float] = (0.2, 0.4)
    seed: int = 0
    eval_every: int = 250
    eval_examples: int = 96
    checkpoint_every: int = 250
    # stop early (keeping a checkpoint) after this much wall time; 0 = off. The default's
    # 2300 steps took 18.6 min on 2 cores here (P4, 1117 s); the cap keeps a slower machine
    # within 20 minutes.
    max_minutes: float = 19.5
    # start from this model folder's weights instead of a fresh initialisation ("" = fresh);
    # its model config must equal ``model``. "default" is the built-in default model.
    init_from: str = ""
    # parameter-name prefix -> [start, end]: parameters whose names start with the prefix
    # (e.g. "blocks.0.", "W_E") get no update while the fraction of training done is in
    # [start, end); {} = none
    freeze: dict = field(
        default_factory=lambda: {
            p: [0.0, 0.11] for p in ("blocks.1.", "blocks.2.", "blocks.3.", "W_E")
        }
    )  # the default: block 0 alone learns the done_tracking bit in the first phase

    def __post_init__(self):
        def need(c, msg):
            if not c:
                raise ValueError(f"invalid TrainConfig: {msg}")

        need(self.steps >= 1 and self.batch_size >= 1, "steps and batch_size must be >= 1")
        need(self.lr > 0 and 0 < self.min_lr_frac <= 1, "lr > 0 and 0 < min_lr_frac <= 1")
        need(
            len(self.pass_mix) >= 1
            and all(p >= 0 for p in self.pass_mix)
            and sum(self.pass_mix) > 0,
            "pass_mix needs non-negative weights",
        )
        need(
            not self.pass_mix_late
            or (all(p >= 0 for p in self.pass_mix_late) and sum(self.pass_mix_late) > 0),
            "pass_mix_late needs non-negative weights (or [] for none)",
        )
        _check_span("pass_mix_late_ramp", self.pass_mix_late_ramp)
        need(
            len(self.answer_weight) >= 1 and all(a >= 0 for a in self.answer_weight),
            "answer_weight needs one or more non-negative weights (pass 1, pass 2, ...)",
        )
        need(
            self.deep_batch_passes >= 0
            and self.deep_batch_size >= 1
            and self.deep_batch_n_min >= 0,
            "deep_batch_passes and deep_batch_n_min must be >= 0, deep_batch_size >= 1",
        )
        need(
            0 <= self.single_pass_frac <= 1 and 0 <= self.mix_ramp_frac <= 1,
            "schedule fractions in [0, 1]",
        )
        need(0 <= self.prefix_prob <= 1, "prefix_prob in [0, 1]")
        need(
            0 <= self.fp_prob <= 1 and 0 <= self.fp_start <= 1,
            "fp_prob and fp_start in [0, 1]",
        )
        need(
            len(self.fp_warm) == 2 and 1 <= self.fp_warm[0] <= self.fp_warm[1],
            f"fp_warm is a range [lo, hi] with 1 <= lo <= hi, got {list(self.fp_warm)}",
        )
        need(
            self.fp_passes >= 1 and self.fp_batch_size >= 1 and self.fp_n_min >= 0,
            "fp_passes and fp_batch_size must be >= 1, fp_n_min >= 0",
        )
        need(
            isinstance(self.freeze, dict),
            f'freeze maps prefixes to windows, e.g. {{"blocks.0.": [0, 0.5]}}, got {self.freeze!r}',
        )
        for prefix, window in self.freeze.items():
            need(
                isinstance(prefix, str)
                and prefix
                and isinstance(window, (list, tuple))
                and len(window) == 2
                and 0 <= window[0] <= window[1] <= 1,
                f"freeze maps a parameter-name prefix to [start, end] with 0 <= start <= end "
                f"<= 1, got {prefix!r}: {window!r}",
            )
        need(
            all(t in TASK_NAMES for t in self.mixture), f"mixture tasks must be among {TASK_NAMES}"
        )
        self.stream()  # validates the curricula and the mixtures

    def stream(self) -> TrainingStream:
        """The training examples this config draws (seeded, a pure function of the step)."""
        return TrainingStream(
            self.mixture,
            seed=self.seed,
            params=self.task_params,
            curriculum=Curriculum(
                start=self.curriculum_start,
                end=self.curriculum_end,
                ramp_frac=self.curriculum_ramp_frac,
                dist=self.curriculum_dist,
                log_share=self.curriculum_log_share,
                overwrite_ramp=self.overwrite_ramp,
                hold_frac=self.curriculum_hold_frac,
            ),
            mixture_start=self.mixture_start or None,
            mixture_ramp_frac=self.mixture_ramp_frac,
            mixture_hold_frac=self.mixture_hold_frac,
            mixture_late=self.mixture_late or None,
            mixture_late_ramp=self.mixture_late_ramp,
            mixture_first=self.mixture_first or None,
            mixture_first_frac=self.mixture_first_frac,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d["pass_mix"] = list(self.pass_mix)
        d["answer_weight"] = list(self.answer_weight)
        d["overwrite_ramp"] = list(self.overwrite_ramp)
        d["mixture_late_ramp"] = list(self.mixture_late_ramp)
        d["pass_mix_late"] = list(self.pass_mix_late)
        d["pass_mix_late_ramp"] = list(self.pass_mix_late_ramp)
        d["fp_warm"] = list(self.fp_warm)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        reject_unknown_keys(cls, d)
        d = dict(d)
        if "model" in d:
            d["model"] = (
                d["model"] if isinstance(d["model"], FBTConfig) else FBTConfig.from_dict(d["model"])
            )
        # configs written before pass_mix_late existed had no late pass mix
        d.setdefault("pass_mix_late", ())
        # ... and before deep_batch_passes existed, no deep-pass batches of their own
        d.setdefault("deep_batch_passes", 0)
        # ... and before fixed-point batches, none
        d.setdefault("fp_prob", 0.0)
        for k in (
            "pass_mix",
            "answer_weight",
            "overwrite_ramp",
            "mixture_late_ramp",
            "pass_mix_late",
            "pass_mix_late_ramp",
            "fp_warm",
        ):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def with_overrides(self, overrides: dict) -> TrainConfig:
        """Apply ``key=value`` overrides; ``model.<field>`` reaches into the model config."""
        top, mdl = {}, {}
        for k, v in overrides.items():
            if k.startswith("model."):
                mdl[k[6:]] = v
            else:
                top[k] = v
        d = self.to_dict()
        d.update(top)
        d["model"] = {**d["model"], **mdl}
        return TrainConfig.from_dict(d)


# ---- schedules ---------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (
        cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    )


def pass_probs(cfg: TrainConfig, step: int) -> np.ndarray:
    """Probabilities of 1, 2, ... passes at ``step``: single-pass first, a ramp to
    ``pass_mix``, and (if set) a late ramp from it to ``pass_mix_late``."""
    n = max(len(cfg.pass_mix), len(cfg.pass_mix_late))

    def norm(mix):
        v = np.zeros(n)
        v[: len(mix)] = mix
        return v / v.sum()

    final = norm(cfg.pass_mix)
    one = np.zeros(n)
    one[0] = 1.0
    f = step / cfg.steps
    if f < cfg.single_pass_frac:
        return one
    r = ramp(f - cfg.single_pass_frac, cfg.mix_ramp_frac)
    probs = (1 - r) * one + r * final
    if cfg.pass_mix_late:
        a, b = cfg.pass_mix_late_ramp
        if f >= a:
            s = ramp(f - a, b - a)
            probs = (1 - s) * probs + s * norm(cfg.pass_mix_late)
    return probs


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


def make_batch(examples: list[Example]) -> Batch:
    ids = [vocab.encode(ex.tokens) for ex in examples]
    T = max(len(x) for x in ids)
    tokens = torch.full((len(ids), T), vocab.PAD_ID, dtype=torch.long)
    targets = torch.full((len(ids), T), -100, dtype=torch.long)
    answer = torch.zeros((len(ids), T), dtype=torch.bool)
    for i, (x, ex) in enumerate(zip(ids, examples, strict=True)):
        tokens[i, : len(x)] = torch.tensor(x)
        targets[i, : len(x) - 1] = torch.tensor(x[1:])
        answer[i, ex.colon_index : len(x) - 1] = True
    lengths = torch.tensor([len(x) for x in ids])
    prompt_len = torch.tensor([ex.colon_index + 1 for ex in examples])
    return Batch(tokens, targets, answer, lengths, prompt_len, [ex.task for ex in examples])


def step_rng(cfg: TrainConfig, step: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([cfg.seed, 777, step]))


def draw_batch(cfg: TrainConfig, stream: TrainingStream, step: int, passes: int) -> list[Example]:
    """Step ``step``'s examples; a deep-pass batch (``deep_batch_*``) draws long counts."""
    if cfg.deep_batch_passes and passes >= cfg.deep_batch_passes:
        return stream.batch(step, cfg.deep_batch_size, step / cfg.steps, cfg.deep_batch_n_min)
    return stream.batch(step, cfg.batch_size, step / cfg.steps)


def fixed_point_draw(cfg: TrainConfig, step: int) -> int:
    """0 if step ``step`` is an ordinary batch, else its number of warm (no-gradient) passes.

    Drawn from its own generator, so configs without fixed-point batches draw exactly
    what they drew before the option existed."""
    if cfg.fp_prob <= 0 or step / cfg.steps < cfg.fp_start:
        return 0
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 778, step]))
    if rng.random() >= cfg.fp_prob:
        return 0
    return int(rng.integers(cfg.fp_warm[0], cfg.fp_warm[1] + 1))


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
):
    """Sum over passes of the (answer-weighted) mean next-token loss; per-pass stats.

    With ``init_states`` the forward continues from those states (a fixed-point batch);
    ``first_pass`` is the index of its first pass, which picks the answer weights."""
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
        aw = cfg.answer_weight[min(k, len(cfg.answer_weight) - 1)]
        w = valid.float() + batch.answer.float() * (aw - 1.0)
        loss = (ce * w).sum() / w.sum()
        total = total + loss
        with torch.no_grad():
            pred = p.logits.argmax(-1)
            correct = ((pred == batch.targets) | ~batch.answer).all(dim=1)
            stats.append(
                {
                    "loss": float((ce * valid).sum() / valid.sum()),
                    "answer_acc": float(correct.float().mean()),
                }
            )
    return total, stats


# ---- evaluation during training (teacher-forced answers, every pass) ---------------------
@torch.no_grad()
def quick_eval(model: FBTModel, cfg: TrainConfig, passes: int = 2) -> dict:
    """Teacher-forced answer accuracy on held-out examples (n in 1..256), per task and pass."""
    was = model.training
    model.eval()
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, STREAM_EVAL]))
    from tasks import get_task

    res = {}
    for task in cfg.mixture:
        mod = get_task(task)
        exs = [
            mod.sample(rng, int(rng.integers(1, 257)), mod.Params(**cfg.task_params.get(task, {})))
            for _ in range(cfg.eval_examples)
        ]
        b = make_batch(exs).to(next(model.parameters()).device)
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


def _save_state(path: Path, model, opt, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history},
        tmp,
    )
    os.replace(tmp, path)


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress=None,
    stop_after: int | None = None,
    argv: list[str] | None = None,
    device: str = "cpu",
) -> dict:
    """Train ``cfg`` into ``out_dir``; returns the final metrics.

    ``device`` ("cpu", "cuda", "cuda:1", ...) is where the model trains; the examples, the
    initial weights and the schedule do not depend on it, the floating-point results do.

    ``progress(step, total, info)`` is called every step. ``stop_after`` ends the run early
    at that step (with a checkpoint), as an interruption would. On NaN or divergence the
    run stops with ``Divergence`` and the last good checkpoint stays in place.
    """
    out = Path(out_dir)
    state_path = out / "state.pt"
    dev = resolve_device(device)  # before anything is written
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(
            f"{out} is not empty; pass --resume to continue it or choose another --out"
        )
    model = FBTModel(cfg.model, seed=cfg.seed)  # initialised on the CPU, then moved
    if cfg.init_from:
        model.load_state_dict(initial_weights(cfg).state_dict())
    frozen = frozen_parameters(model, cfg.freeze)  # checked before anything is written
    model = model.to(dev)
    out.mkdir(parents=True, exist_ok=True)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    start, history = 0, []
    if resume and state_path.exists():
        saved_cfg = TrainConfig.from_dict(json.loads((out / "train_config.json").read_text()))
        if saved_cfg != cfg:
            raise ValueError(
                f"{out} was trained with a different config; resume it with the same one"
            )
        st = torch.load(state_path, weights_only=False, map_location=dev)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, history = st["step"], st["history"]
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    with open(out / "command.txt", "a") as f:
        f.write(shlex.join(argv if argv is not None else sys.argv) + "\n")
    stream = cfg.stream()
    revision = git_revision()  # at the start: the code that trains, not what changed meanwhile
    t0 = time.monotonic()
    tokens_seen, tok_t0 = 0, time.monotonic()
    recent: list[float] = []
    running = {}
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    step = start
    for step in range(start, end):
        rng = step_rng(cfg, step)
        probs = pass_probs(cfg, step)
        passes = int(rng.choice(len(probs), p=probs)) + 1
        warm = fixed_point_draw(cfg, step)
        if warm:
            passes = cfg.fp_passes
            examples = stream.batch(step, cfg.fp_batch_size, step / cfg.steps, cfg.fp_n_min)
        else:
            examples = draw_batch(cfg, stream, step, passes)
        batch = make_batch(examples).to(dev)
        prefix = None
        if cfg.prefix_mixin and passes > 1 and not warm:
            use = rng.random(len(batch.lengths)) < cfg.prefix_prob
            draw = np.floor(rng.random(len(batch.lengths)) * batch.prompt_len.cpu().numpy())
            prefix = torch.tensor(np.where(use, draw.astype(int), 0), device=dev)
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # jitter noise, reproducible per step
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        init = warm_states(model, batch, warm, cfg.fp_exact) if warm else None
        loss, stats = multipass_loss(model, batch, passes, cfg, prefix, init, first_pass=warm)
        lv = loss.item()
        if diverged(lv / passes, recent):
            raise Divergence(
                f"training diverged at step {step} (loss per pass {lv / passes:.4g}, recent median "
                f"{np.median(recent) if recent else float('nan'):.4g}); the last good checkpoint is in {out}"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for (a, b), params in frozen:
            if a <= step / cfg.steps < b:
                for p in params:
                    p.grad = None  # AdamW skips it: no update, no weight decay
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if not math.isfinite(gnorm):
            raise Divergence(
                f"non-finite gradient at step {step}; the last good checkpoint is in {out}"
            )
        opt.step()
        recent = (recent + [lv / passes])[-200:]
        # the exact recurrence runs each token through the stack once, Jacobi warm-up ``warm`` times
        tokens_seen += batch.n_tokens * (passes + (min(warm, 1) if cfg.fp_exact else warm))
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
            rec["fp_warm"] = "recurrence" if cfg.fp_exact else warm
            rec.update({f"fp/{m}": v for m, v in stats[-1].items()})
        else:
            rec.update({f"pass{k + 1}/{m}": v for k, s in enumerate(stats) for m, v in s.items()})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            rec["eval"] = quick_eval(model, cfg)
        history.append(rec)
        if progress is not None:
            tps = tokens_seen / max(1e-9, time.monotonic() - tok_t0)
            info = "  ".join(
                f"{k if k == 'fp' else f'pass{k}'}: loss {v['loss']:.3f} acc {v['answer_acc']:.2f}"
                for k, v in sorted(  # passes in order, the fixed-point batches last
                    running.items(), key=lambda kv: float("inf") if kv[0] == "fp" else kv[0]
                )
            )
            progress(step + 1, cfg.steps, f"{info}  {tps:,.0f} tok/s")
        if (step + 1) % cfg.checkpoint_every == 0:
            _save_state(state_path, model, opt, step + 1, history)
        if cfg.max_minutes and (time.monotonic() - t0) / 60 > cfg.max_minutes:
            _save_state(state_path, model, opt, step + 1, history)
            break
    final_step = history[-1]["step"] if history else start
    _save_state(state_path, model, opt, final_step, history)
    model.eval()
    metrics = {
        "name": cfg.name,
        "steps_done": final_step,
        "steps": cfg.steps,
        "finished": final_step >= cfg.steps,
        "seed": cfg.seed,
        "git_revision": revision,
        "device": str(dev),
        # the bits of the weights depend on these too (and on the CPU's instruction set):
        # the same config, seed, torch version and thread count give the same weights
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_seconds_this_session": time.monotonic() - t0,
        "tokens_per_second": tokens_seen / max(1e-9, time.monotonic() - tok_t0),
        "final_eval": quick_eval(model, cfg),
        "history": history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    save_model(
        model,
        out / "model",
        extra_meta={
            "train_config": cfg.to_dict(),
            "steps_done": final_step,
            "git_revision": metrics["git_revision"],
        },
    )
    return metrics


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


def frozen_parameters(model: FBTModel, freeze: dict) -> list[tuple[tuple[float, float], list]]:
    """For each prefix of ``freeze``: (its window, the parameters whose names start with it);
    a prefix that matches no parameter is an error."""
    named = list(model.named_parameters())
    out = []
    for f, window in freeze.items():
        params = [p for n, p in named if n.startswith(f)]
        if not params:
            raise ValueError(
                f"freeze prefix {f!r} matches no parameter; names look like "
                f"{', '.join(n for n, _ in named[:4])}, ..."
            )
        out.append(((float(window[0]), float(window[1])), params))
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


# The default's recipe until the eighth session (docs/training.md, run D): it learns
# delayed_memory and done_tracking, not multi_register; 4 heads. ``paper``,
# ``no-three-pass`` and ``additive`` are this recipe with one change each, ``three-tasks``
# with its task schedule; their documented results were measured that way.
D_RECIPE = replace(
    TrainConfig(),
    name="D",
    model=FBTConfig(),
    deep_batch_passes=0,
    fp_prob=0.0,
    steps=2000,
    mix_ramp_frac=0.10,
    pass_mix=(0.25, 0.55, 0.10, 0.05, 0.0, 0.03) + (0.0,) * 5 + (0.02,),
    single_pass_frac=0.05,
    mixture={"delayed_memory": 0.5, "done_tracking": 3.0, "multi_register": 0.25},
    mixture_start={},
    mixture_ramp_frac=0.0,
    mixture_hold_frac=0.0,
    mixture_first={},
    mixture_first_frac=0.0,
    mixture_late={},
    mixture_late_ramp=(1.0, 1.0),
    task_params={},
    curriculum_ramp_frac=0.3,
    curriculum_hold_frac=0.0,
    curriculum_log_share=0.5,
    overwrite_ramp=(0.0, 0.0),
    freeze={},
)


def named_config(name: str) -> TrainConfig:
    """Built-in recipes: ``default``, ``D``, ``paper``, ``no-three-pass``, ``additive``,
    ``three-tasks``, ``tiny``."""
    base = D_RECIPE
    table = {
        "default": TrainConfig(),
        # learns all three tasks, multi_register too, within the default's budget; its
        # done_tracking layer-0 probe is 0.95, not D's 1.00 (docs/training.md, run Q)
        "three-tasks": replace(
            base,
            name="three-tasks",
            steps=2600,
            pass_mix=(0.15, 0.50, 0.25, 0.05, 0.0, 0.03) + (0.0,) * 5 + (0.02,),
            answer_weight=(5.0, 20.0),
            mixture={"delayed_memory": 0.5, "done_tracking": 3.0, "multi_register": 1.5},
            mixture_start={"multi_register": 1.0, "delayed_memory": 0.5},
            mixture_ramp_frac=0.25,
            mixture_late={"delayed_memory": 0.5, "done_tracking": 3.0, "multi_register": 0.35},
            mixture_late_ramp=(0.45, 0.55),
            overwrite_ramp=(0.15, 0.45),
            curriculum_log_share=0.75,
        ),
        "D": base,  # the default before K4: docs/training.md commands without --config
        "paper": replace(base, name="paper", pass_mix=(0.75, 0.22, 0.03), prefix_mixin=True),
        "no-three-pass": replace(
            base, name="no-three-pass", pass_mix=(0.75, 0.25), prefix_mixin=True
        ),
        "additive": replace(base, name="additive", model=replace(base.model, fusion="additive")),
        "tiny": replace(
            base,
            name="tiny",
            model=FBTConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, n_ctx=320),
            pass_mix=(0.25, 0.65, 0.10),
            max_minutes=0.0,
            steps=40,
            batch_size=8,
            eval_every=20,
            checkpoint_every=20,
            eval_examples=16,
            warmup_steps=5,
        ),
    }
    if name not in table:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(table)} or a JSON file")
    return table[name]

"""TrainConfig: everything a training run depends on, in groups, with the schedule as phases.

The code defaults are neutral, not a tuned run: the paper's objective (75/22/3 % one-, two-
and three-pass batches, prefix mixin, jitter 0.02) over one phase with the three tasks
weighted equally and counts up to 256. The named recipes (``fbt_probe/train/recipes/*.toml``)
say how and why they depart from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from fbt_probe.config import FBTConfig, typed_fields
from fbt_probe.train.schedule import QUANTITIES, RAMPABLE, Phase, plan_at, task_names, validate
from tasks import get_task
from tasks.sampler import COUNT_DISTS, TrainingStream

LEARN = ("all", "fusion", "lora")
# the linear layers of a Llama-family block (SmolLM2's): every projection of attention and MLP
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"invalid TrainConfig: {msg}")


def refuse_non_finite(d, where: str = "") -> None:
    """A NaN or infinite number anywhere in a config dict is refused by its dotted key
    (``optim.lr``, ``schedule.1.passes.0``): no range check can catch NaN, which compares
    false with everything, and an infinite weight overflows only steps later."""
    items = (
        d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list | tuple) else ()
    )
    for k, v in items:
        key = f"{where}.{k}" if where else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"invalid TrainConfig: {key} is {v}; it must be a finite number")
        refuse_non_finite(v, key)


def check_name(name) -> None:
    """A run's name is one path component: the run folder is runs/<name>."""
    _need(
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0"),
        f"name must be one folder name (no '/', not '..'), got {name!r}",
    )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (betas 0.9/0.95) with linear warm-up and cosine decay to ``min_lr_frac`` x lr."""

    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # gradient accumulation: each rank's share of a step's batch runs as this many
    # micro-batches, so a global batch larger than memory allows stays the recipe's
    accum: int = 1
    # which parameters learn: "all", or "fusion" (the fused-input map only; the stack keeps
    # its weights, which get no gradient and no optimiser state), or "lora" (the fusion and
    # low-rank adapters on the stack's linear layers, ``lora_targets``, a Hugging Face start)
    learn: str = "all"
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the adapter's update is lora_alpha / lora_rank * B A
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        _need(self.learn in LEARN, f"optim.learn must be one of {LEARN}, got {self.learn!r}")
        _need(0 < self.lr <= 1, f"optim.lr must be in (0, 1], got {self.lr}")
        _need(
            0 < self.min_lr_frac <= 1,
            f"optim.min_lr_frac must be in (0, 1], got {self.min_lr_frac}",
        )
        _need(self.accum >= 1, "optim.accum must be >= 1")
        _need(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        _need(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _need(self.grad_clip > 0, f"optim.grad_clip must be > 0, got {self.grad_clip}")
        _need(self.lora_rank >= 1, f"optim.lora_rank must be >= 1, got {self.lora_rank}")
        _need(self.lora_alpha > 0, f"optim.lora_alpha must be > 0, got {self.lora_alpha}")
        t = self.lora_targets
        ok = len(t) > 0 and len(set(t)) == len(t) and all(isinstance(n, str) and n for n in t)
        _need(ok, "optim.lora_targets must be distinct module names, at least one")


@dataclass(frozen=True)
class ObjectiveConfig:
    """What a step's loss is: next-token loss on every pass, summed (the paper), with the
    answer tokens weighted by pass (pass 1, pass 2, ...; the last weight holds for deeper
    passes) and, with ``prefix_mixin``, a share of examples whose extra passes keep a plain
    prefix of random length."""

    answer_weight: tuple[float, ...] = (1.0,)
    prefix_mixin: bool = True
    prefix_prob: float = 0.5

    def __post_init__(self):
        _need(
            len(self.answer_weight) >= 1 and all(a >= 0 for a in self.answer_weight),
            "objective.answer_weight needs one or more non-negative weights (pass 1, pass 2, ...)",
        )
        _need(0 <= self.prefix_prob <= 1, "objective.prefix_prob must be in [0, 1]")


@dataclass(frozen=True)
class DataConfig:
    """The examples of an ordinary batch: its size, how its distractor count is drawn below
    the schedule's ``n_max`` (``uniform``, or ``mixed``: a ``log_share`` of batches
    log-uniform) and each task's generator parameters."""

    batch_size: int = 32
    count_dist: str = "uniform"
    log_share: float = 0.5
    task_params: dict = field(default_factory=dict)

    def __post_init__(self):
        _need(self.batch_size >= 1, "data.batch_size must be >= 1")
        _need(self.count_dist in COUNT_DISTS, f"data.count_dist must be one of {COUNT_DISTS}")
        _need(0 <= self.log_share <= 1, "data.log_share must be in [0, 1]")


@dataclass(frozen=True)
class DeepBatchConfig:
    """Batches of at least ``passes`` passes (0 = off) hold ``batch_size`` examples with
    counts uniform in [n_min, n_max] instead of the curriculum's mostly short ones."""

    passes: int = 0
    batch_size: int = 16
    n_min: int = 64

    def __post_init__(self):
        _need(
            self.passes >= 0 and self.batch_size >= 1 and self.n_min >= 0,
            "deep_batches: passes and n_min must be >= 0, batch_size >= 1",
        )


@dataclass(frozen=True)
class FixedPointConfig:
    """A fixed-point batch (their share of the steps is the schedule's ``fixed_point``) runs
    ``batch_size`` examples (counts uniform in [n_min, n_max]) to warm states without gradient
    or jitter, the exact sequential recurrence's (``exact``) or ``warm`` = [lo, hi] Jacobi
    passes drawn per step, then ``passes`` passes with gradient from there."""

    warm: tuple[int, int] = (8, 24)
    passes: int = 2
    batch_size: int = 16
    n_min: int = 0
    exact: bool = True

    def __post_init__(self):
        _need(
            1 <= self.warm[0] <= self.warm[1],
            f"fixed_point.warm is a range [lo, hi] with 1 <= lo <= hi, got {list(self.warm)}",
        )
        _need(
            self.passes >= 1 and self.batch_size >= 1 and self.n_min >= 0,
            "fixed_point: passes and batch_size must be >= 1, n_min >= 0",
        )


@dataclass(frozen=True)
class RunConfig:
    """The seed (initial weights and every draw) and the run's cadence."""

    seed: int = 0
    eval_every: int = 250
    eval_examples: int = 96
    checkpoint_every: int = 250
    # CUDA only: run forward and backward under bf16 autocast (the weights and AdamW stay fp32)
    bf16: bool = False
    # split each step's batch into sub-batches of similar length (``train.length_buckets``),
    # so that padding is not computed; the examples, passes and losses are the same
    length_buckets: bool = True
    # under torchrun: shard parameters, gradients and AdamW state over the ranks (FSDP's
    # fully_shard) instead of replicating them (DDP), for a model that does not fit one device
    fsdp: bool = False

    def __post_init__(self):
        _need(self.seed >= 0, f"run.seed must be >= 0, got {self.seed}")
        _need(
            self.eval_every >= 1 and self.eval_examples >= 1 and self.checkpoint_every >= 1,
            "run: eval_every, eval_examples and checkpoint_every must be >= 1",
        )


NEUTRAL_SCHEDULE = (
    Phase(
        until=1.0,
        tasks={"delayed_memory": 1.0, "done_tracking": 1.0, "multi_register": 1.0},
        passes=(0.75, 0.22, 0.03),
        n_max=256,
    ),
)
GROUPS = {
    "model": FBTConfig,
    "optim": OptimConfig,
    "objective": ObjectiveConfig,
    "data": DataConfig,
    "deep_batches": DeepBatchConfig,
    "fixed_point": FixedPointConfig,
    "run": RunConfig,
}


# keys that only the flat format of fbt-probe 0.1 had (the grouped format nests its settings)
FLAT_KEYS = frozenset(
    {
        "pass_mix",
        "pass_mix_late",
        "single_pass_frac",
        "mix_ramp_frac",
        "mixture",
        "mixture_start",
        "mixture_first",
        "curriculum_start",
        "curriculum_end",
        "curriculum_dist",
        "fp_prob",
        "fp_warm",
        "fp_start",
        "deep_batch_passes",
        "overwrite_ramp",
        "freeze",
    }
)


def refuse_flat(d: dict, what: str = "this config") -> None:
    """One line for a config in the flat format of fbt-probe 0.1, which 0.2 no longer reads."""
    flat = sorted(FLAT_KEYS & set(d)) if "schedule" not in d else []
    if flat:
        raise ValueError(
            f"{what} is in the flat format of fbt-probe 0.1 ({flat[0]}, ...), which fbt-probe "
            "0.2 no longer reads: write it as a recipe of groups and phases (docs/training.md)"
        )


@dataclass(frozen=True)
class TrainConfig:
    """A training recipe: the model, how long, the loss, the data, the schedule of phases,
    the two special kinds of batch, and the run's seed and cadence."""

    name: str = "neutral"
    model: FBTConfig = field(default_factory=FBTConfig)
    steps: int = 2000
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: tuple[Phase, ...] = NEUTRAL_SCHEDULE
    deep_batches: DeepBatchConfig = field(default_factory=DeepBatchConfig)
    fixed_point: FixedPointConfig = field(default_factory=FixedPointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # start from this model folder's weights ("" = fresh; "default" = the built-in model);
    # its architecture must equal ``model``
    init_from: str = ""

    def __post_init__(self):
        check_name(self.name)
        refuse_non_finite(self.to_dict())
        _need(self.steps >= 1, "steps must be >= 1")
        _need(
            self.model.init_std <= 1, f"model.init_std must be in (0, 1], got {self.model.init_std}"
        )
        validate(self.schedule)
        _need(
            self.model.smear_keys or all(p.smear is None for p in self.schedule),
            "the schedule sets smear, which needs model.smear_keys = true",
        )
        for i, p in enumerate(self.schedule):
            for t in p.tasks or ():
                try:
                    get_task(t)
                except ValueError as e:
                    raise ValueError(f"invalid TrainConfig: schedule[{i}].tasks: {e}") from None
        self.stream()  # validates the task parameters
        if self.optim.learn == "fusion":
            _refuse_single_pass(self)

    @property
    def tasks(self) -> list[str]:
        """The tasks this recipe trains on (every task a phase names), in drawing order."""
        return task_names(self.schedule)

    def stream(self) -> TrainingStream:
        """The training examples this config draws (seeded, a pure function of the step)."""
        return TrainingStream(
            self.tasks,
            seed=self.run.seed,
            params=self.data.task_params,
            dist=self.data.count_dist,
            log_share=self.data.log_share,
        )

    def to_dict(self) -> dict:
        d = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "schedule":
                d[f.name] = [p.to_dict() for p in v]
            elif dataclasses.is_dataclass(v):
                d[f.name] = {
                    k: list(x) if isinstance(x, tuple) else x
                    for k, x in dataclasses.asdict(v).items()
                }
            else:
                d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """Read a config dict in the grouped format. Missing fields take the code defaults;
        an unknown key or a wrongly typed value is a one-line ValueError that names it, and a
        config in the flat format of fbt-probe 0.1 one that says what to do."""
        refuse_flat(d)
        refuse_non_finite(d)
        kw = typed_fields(cls, {k: v for k, v in d.items() if k not in GROUPS and k != "schedule"})
        for g, gcls in GROUPS.items():
            if g in d:
                v = d[g]
                kw[g] = v if isinstance(v, gcls) else gcls(**typed_fields(gcls, v, g))
        if "schedule" in d:
            kw["schedule"] = parse_schedule(d["schedule"])
        return cls(**kw)

    def with_overrides(self, overrides: dict) -> TrainConfig:
        """Apply ``key=value`` overrides; dotted keys reach into the groups and the schedule
        (``optim.lr``, ``model.d_model``, ``schedule.2.n_max``)."""
        d = self.to_dict()
        for key, value in overrides.items():
            set_path(d, key, value)
        return TrainConfig.from_dict(d)


def _refuse_single_pass(cfg: TrainConfig) -> None:
    """Under ``optim.learn = "fusion"`` a step of one-pass batches only trains nothing (a
    first pass never reads the fusion): a schedule with such steps is refused."""
    for step in range(cfg.steps):
        plan = plan_at(cfg.schedule, step / cfg.steps)
        if plan.passes[0] >= 1.0:
            raise ValueError(
                f"invalid TrainConfig: optim.learn = 'fusion' but schedule[{plan.phase}] draws "
                f"one-pass batches only (from step {step}), where the fusion gets no gradient; "
                "give that phase a share of 2 or more passes"
            )


def parse_schedule(items) -> tuple[Phase, ...]:
    """Phases from a list of dicts (``ramp = true`` ramps everything the phase sets)."""
    if isinstance(items, tuple) and all(isinstance(p, Phase) for p in items):
        return items
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"invalid TrainConfig: schedule must be a list of phases, got {items!r}")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, Phase):
            out.append(p)
            continue
        where = f"schedule[{i}]"
        if not isinstance(p, dict) or "until" not in p:
            raise ValueError(f"invalid TrainConfig: {where} must be an object with 'until'")
        p = dict(p)
        ramp = p.get("ramp", ())
        if ramp is True:
            p["ramp"] = [q for q in RAMPABLE if p.get(q) is not None]
        elif ramp is False:
            p["ramp"] = []
        kw = typed_fields(Phase, p, where)
        for k, v in (kw.get("tasks") or {}).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(
                    f"invalid TrainConfig: {where}.tasks.{k} must be a number, got {v!r}"
                )
        try:
            out.append(Phase(**kw))
        except TypeError as e:
            raise ValueError(f"invalid TrainConfig: {where}: {e}") from None
    return tuple(out)


def set_path(d: dict, key: str, value) -> None:
    """``d[a][b][c] = value`` for ``key`` "a.b.c"; list items by index (``schedule.2.n_max``)."""
    parts = key.split(".")
    node = d
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"--set {key}: {here} has no item {part} (0..{len(node) - 1})")
            node = node[int(part)]
        elif isinstance(node, dict) and isinstance(node.get(part), (dict, list)):
            node = node[part]
        elif isinstance(node, dict) and part in ("tasks", "task_params") and part not in node:
            node = node.setdefault(part, {})
        else:
            raise ValueError(f"--set {key}: unknown key {here!r}")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"--set {key}: no item {last} (0..{len(node) - 1})")
        node[int(last)] = value
    elif isinstance(node, dict):
        if node is d and last not in {f.name for f in fields(TrainConfig)}:
            raise ValueError(f"--set {key}: unknown key {key!r}")
        node[last] = value


__all__ = ["TrainConfig", "Phase", "QUANTITIES", *(c.__name__ for c in GROUPS.values())]

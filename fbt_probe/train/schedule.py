"""The training schedule as an ordered list of phases, and the plan of any step.

A phase covers training progress ``[previous until, until)`` (fractions of training; the first
phase starts at 0, the last ends at 1). It sets some of these quantities:

- ``tasks``: task weights (normalised to shares), e.g. ``{"delayed_memory": 1, "done_tracking": 3}``;
- ``passes``: weights of batches with 1, 2, 3, ... passes;
- ``n_max``: the largest distractor count drawn;
- ``frozen``: parameter-name prefixes that get no update (never ramps);
- ``overwrites``: the cap on multi_register's overwrites per register;
- ``fixed_point``: the share of steps that are fixed-point batches;
- ``soft``: the share of a multi-pass batch's examples trained as soft decoding sees them:
  the whole prompt plain in every pass, only the answer fused;
- ``smear``: how much of the smeared keys' previous-key share is applied (0 = plain keys,
  1 = the learned share; needs ``model.smear_keys``, and must end at 1).

A quantity the phase does not set keeps its value. A quantity it sets starts sharply at the
phase's start, unless the phase names it in ``ramp`` (``ramp = true``: everything it sets): then
it moves linearly from where the last phase that set it ended, reaching the new value at this
phase's end. So a ramp may span several phases, and a phase that repeats a value marks where
the next ramp begins. A phase whose ``until`` equals the previous one has no steps: it only sets
the values a ramp starts from. Integers ramp in integers: ``n_max`` rounds, ``overwrites`` rises
one by one in equal parts of the ramp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.base import MAX_DISTRACTORS

QUANTITIES = ("tasks", "passes", "n_max", "frozen", "overwrites", "fixed_point", "soft", "smear")
RAMPABLE = ("tasks", "passes", "n_max", "overwrites", "fixed_point", "soft", "smear")
# what a quantity is before any phase sets it (tasks, passes and n_max must be set)
UNSET = {"frozen": (), "overwrites": None, "fixed_point": 0.0, "soft": 0.0, "smear": 1.0}


@dataclass(frozen=True)
class Phase:
    """One phase of the schedule; ``None`` = not set here (the value carries on)."""

    until: float
    tasks: dict | None = None
    passes: tuple[float, ...] | None = None
    n_max: int | None = None
    frozen: tuple[str, ...] | None = None
    overwrites: int | None = None
    fixed_point: float | None = None
    soft: float | None = None
    smear: float | None = None
    ramp: tuple[str, ...] = ()
    why: str = field(default="", compare=False)  # a note for readers; it changes nothing

    def sets(self, q: str) -> bool:
        return getattr(self, q) is not None

    def to_dict(self) -> dict:
        d = {"until": self.until}
        for q in QUANTITIES:
            v = getattr(self, q)
            if v is not None:
                d[q] = dict(v) if q == "tasks" else list(v) if isinstance(v, tuple) else v
        if self.ramp:
            d["ramp"] = list(self.ramp)
        if self.why:
            d["why"] = self.why
        return d


@dataclass(frozen=True)
class Plan:
    """What one step of training draws from: a pure function of the schedule and progress."""

    phase: int  # index of the active phase
    tasks: np.ndarray  # (n_tasks,) shares over ``task_names(schedule)``
    passes: np.ndarray  # (max passes,) probability of 1, 2, ... passes
    n_max: int
    frozen: tuple[str, ...]
    overwrites: int | None  # None = no cap beyond the task's own
    fixed_point: float
    soft: float = 0.0  # share of a multi-pass batch's examples with the whole prompt plain
    smear: float = 1.0  # the applied share of the smeared keys' previous key


def task_names(phases) -> list[str]:
    """Every task any phase names, in sorted order: the order tasks are drawn in."""
    return sorted({t for p in phases if p.tasks for t in p.tasks})


def _shares(weights: dict, names: list[str]) -> np.ndarray:
    total = sum(weights.values())  # summed in the phase's own order, as written
    return np.array([weights.get(n, 0.0) / total for n in names])


def _padded(mix, n: int) -> np.ndarray:
    v = np.zeros(n)
    v[: len(mix)] = mix
    return v / v.sum()


def validate(phases, where: str = "schedule") -> None:
    """A one-line ValueError for the first thing wrong with ``phases``."""
    if not phases:
        raise ValueError(f"{where} needs at least one phase")
    prev = 0.0
    seen: set[str] = set()
    for i, p in enumerate(phases):
        at = f"{where}[{i}]"
        if not 0.0 <= p.until <= 1.0 or p.until < prev:
            raise ValueError(
                f"{at}.until must be in [{prev:g}, 1] (phases in order), got {p.until!r}"
            )
        _check_values(p, at)
        _check_ramps(p, at, seen)
        seen.update(q for q in QUANTITIES if p.sets(q))
        if p.until > prev or i == len(phases) - 1:  # a phase with steps needs a value of each
            for q in ("tasks", "passes", "n_max"):
                if q not in seen:
                    raise ValueError(f"{at}: no phase up to here sets {q!r}")
        prev = p.until
    if phases[-1].until != 1.0:
        raise ValueError(f"{where}: the last phase must end at 1 (until = 1.0)")
    last = [p.smear for p in phases if p.smear is not None]
    if last and last[-1] != 1.0:  # the saved model applies the learned share in full
        raise ValueError(
            f"{where}: smear must end at 1 (the last phase setting it has {last[-1]:g})"
        )


def _check_values(p, at: str) -> None:
    """Each value phase ``p`` sets, within its range (``at``: where it is, for the message)."""
    if p.tasks is not None:
        if not p.tasks or any(w < 0 for w in p.tasks.values()) or sum(p.tasks.values()) <= 0:
            raise ValueError(f"{at}.tasks needs non-negative weights that sum above zero")
    if p.passes is not None and (
        not p.passes or any(w < 0 for w in p.passes) or sum(p.passes) <= 0
    ):
        raise ValueError(f"{at}.passes needs non-negative weights of 1, 2, ... passes")
    if p.n_max is not None and not 0 <= p.n_max <= MAX_DISTRACTORS:
        raise ValueError(f"{at}.n_max must be in 0..{MAX_DISTRACTORS}, got {p.n_max}")
    if p.frozen is not None and not all(isinstance(f, str) and f for f in p.frozen):
        raise ValueError(f"{at}.frozen is a list of parameter-name prefixes")
    if p.overwrites is not None and not 0 <= p.overwrites <= 8:
        raise ValueError(f"{at}.overwrites must be in 0..8, got {p.overwrites}")
    for q in ("fixed_point", "soft", "smear"):
        v = getattr(p, q)
        if v is not None and not 0.0 <= v <= 1.0:
            raise ValueError(f"{at}.{q} is a share in [0, 1], got {v}")


def _check_ramps(p, at: str, seen: set[str]) -> None:
    """What phase ``p`` ramps: a rampable quantity it sets, set by an earlier phase
    (``seen``) to ramp from."""
    for q in p.ramp:
        if q not in RAMPABLE:
            raise ValueError(f"{at}.ramp names {q!r}; only {', '.join(RAMPABLE)} ramp")
        if not p.sets(q):
            raise ValueError(f"{at}.ramp names {q!r}, which the phase does not set")
        if q not in seen:
            raise ValueError(f"{at} ramps {q!r}, but no earlier phase sets it")


def _value(phases, i: int, q: str, progress: float, names: list[str], n_passes: int):
    """Quantity ``q`` at ``progress`` inside phase ``i``."""

    def norm(v):
        if q == "tasks":
            return _shares(v, names)
        if q == "passes":
            return _padded(v, n_passes)
        return v

    nxt = next((k for k in range(i, len(phases)) if phases[k].sets(q)), None)
    if nxt == i and q not in phases[i].ramp:
        return norm(getattr(phases[i], q))  # set sharply by this phase
    last = next((k for k in range(i - 1, -1, -1) if phases[k].sets(q)), None)
    held = norm(getattr(phases[last], q)) if last is not None else UNSET[q]
    if nxt is None or q not in phases[nxt].ramp:
        return held
    # ramping: from the end of the last phase that set q to the end of phase ``nxt``
    a, b = phases[last].until, phases[nxt].until
    v0, v1 = held, norm(getattr(phases[nxt], q))
    if q == "n_max":
        return int(round(v0 + (progress - a) / (b - a) * (v1 - v0)))
    if q == "overwrites":
        d = abs(v1 - v0)
        if d == 0:
            return v0
        step = min(d, int(d * (progress - a) / (b - a)) + 1)
        return v0 + step if v1 > v0 else v0 - step
    t = (progress - a) / (b - a)
    if isinstance(v0, np.ndarray) and np.array_equal(v0, v1):
        return v0
    return (1 - t) * v0 + t * v1


def plan_at(phases, progress: float) -> Plan:
    """The plan at ``progress`` in [0, 1): the active phase and every quantity's value."""
    i = next(k for k, p in enumerate(phases) if progress < p.until or k == len(phases) - 1)
    names = task_names(phases)
    n_passes = max(len(p.passes) for p in phases if p.passes is not None)
    vals = {q: _value(phases, i, q, progress, names, n_passes) for q in QUANTITIES}
    return Plan(phase=i, frozen=tuple(vals.pop("frozen")), **vals)


def table(phases) -> str:
    """The schedule as a markdown table: one row a phase, ``→`` where a value ramps in; a
    quantity no phase sets has no column (tasks, passes and n_max always have one)."""

    def fmt(p: Phase, q: str) -> str:
        v = getattr(p, q)
        if v is None:
            return ""
        if q == "tasks":
            s = ", ".join(f"{k} {w:g}" for k, w in v.items())
        elif q == "passes":  # "k: weight" for each pass count that occurs
            s = (
                ", ".join(f"{k}: {w:g}" for k, w in enumerate(v, start=1) if w)
                if len(v) > 1
                else "1"
            )
        elif q == "frozen":
            s = ", ".join(f"`{f}`" for f in v) or "none"
        else:
            s = f"{v:g}"
        return f"→ {s}" if q in p.ramp else s

    shown = [
        q for q in QUANTITIES if q in ("tasks", "passes", "n_max") or any(p.sets(q) for p in phases)
    ]
    head = ["phase", "until", *shown, "why"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    prev = 0.0
    for i, p in enumerate(phases):
        span = f"{prev:g}–{p.until:g}" if p.until > prev else f"at {p.until:g}"
        cells = [str(i), span, *(fmt(p, q) for q in shown), p.why]
        rows.append("| " + " | ".join(cells) + " |")
        prev = p.until
    return "\n".join(rows)

"""What every task generator shares: the example record, seeding and interleaving.

A generator is a pure function of (parameters, seed). Each *base instance* (a group)
fixes the label information; it is then rendered once per requested distractor count
with fresh distractors, so every rendering of a group carries the same label.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from tasks import vocab

MAX_DISTRACTORS = 256  # the distractor cap: no task renders more
# results are pooled over every count but 0, where the answer is the token before the colon
POOLED = f"1-{MAX_DISTRACTORS}"
DEFAULT_DISTRACTORS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)

# Separate seed streams: probe datasets and the training stream can never share draws.
STREAM_PROBE = 0
STREAM_TRAIN = 1
TASK_CODES = {"mixture": 10, "delayed_memory": 11, "done_tracking": 12, "multi_register": 13}


@dataclass(frozen=True)
class Example:
    """One rendered sequence: prompt up to and including the colon, then the answer."""

    task: str
    group: int
    n_distractors: int
    prompt: tuple[str, ...]  # ends with the colon
    answer: tuple[str, ...]  # the label words, in order
    overwrites: tuple[int, ...] = field(default=())  # multi_register: per register
    answer_tokens: tuple[str, ...] = field(
        default=()
    )  # rendered answer when it differs from the labels

    @property
    def rendered_answer(self) -> tuple[str, ...]:
        """The words after the colon (multi_register names each register before its value)."""
        return self.answer_tokens or self.answer

    @property
    def label_offsets(self) -> tuple[int, ...]:
        """Where each label word sits within ``rendered_answer``."""
        if not self.answer_tokens:
            return tuple(range(len(self.answer)))
        return tuple(range(1, len(self.answer_tokens), 2))

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.prompt + self.rendered_answer

    @property
    def colon_index(self) -> int:
        return len(self.prompt) - 1

    @property
    def text(self) -> str:
        return " ".join(self.tokens)

    @property
    def label(self) -> str:
        return " ".join(self.answer)


def task_code(task: str) -> int:
    """The seed-sequence code of a task: fixed for the built-in ones, from the name's hash
    for tasks registered later (so a new task never shifts another task's draws)."""
    if task in TASK_CODES:
        return TASK_CODES[task]

    return 1000 + int(hashlib.sha256(task.encode()).hexdigest()[:8], 16)


def rng_for(seed: int, task: str, stream: int, *path: int) -> np.random.Generator:
    """A generator keyed by (seed, task, stream, *path): independent of call order."""
    return np.random.default_rng(np.random.SeedSequence([seed, task_code(task), stream, *path]))


def distractor_words(rng: np.random.Generator, n: int) -> list[str]:
    return [vocab.DISTRACTORS[i] for i in rng.integers(0, len(vocab.DISTRACTORS), size=n).tolist()]


def interleave(rng: np.random.Generator, events: list[tuple[str, ...]], n: int) -> list[str]:
    """Place ``events`` (kept in order, each kept contiguous) among ``n`` fresh distractors."""
    fill = distractor_words(rng, n)
    slots = np.sort(rng.choice(n + len(events), size=len(events), replace=False))
    out: list[str] = []
    start = 0  # event j sits at slot s: s - j distractors come before it
    for j, (s, event) in enumerate(zip(slots.tolist(), events, strict=True)):
        out.extend(fill[start : s - j])
        out.extend(event)
        start = s - j
    out.extend(fill[start:])
    return out


def check_counts(distractors: list[int] | tuple[int, ...], max_distractors: int = MAX_DISTRACTORS):
    if len(distractors) == 0:
        raise ValueError("no distractor counts given")
    for n in distractors:
        if not 0 <= int(n) <= max_distractors:
            raise ValueError(f"distractor count {n} outside [0, {max_distractors}]")


def balanced_bits(rng: np.random.Generator, n_groups: int) -> np.ndarray:
    """Exactly balanced 0/1 labels (one extra 0 when odd), in random order."""
    return rng.permutation(np.arange(n_groups) % 2)


def generate_groups(
    mod, n_groups, distractors, seed, params, stream, progress=None
) -> list[Example]:
    """Draw ``n_groups`` bases of task module ``mod`` and render each at every count.

    Each rendering uses its own generator keyed by (seed, stream, group, count), so a
    group's renderings do not depend on which other groups or counts were asked for.
    """
    check_counts(distractors)
    bases = mod.draw_bases(n_groups, seed, params, stream)
    out = []
    for g, base in enumerate(bases):
        for n in distractors:
            out.append(
                mod.render(base, int(n), rng_for(seed, mod.NAME, stream, g, int(n)), params, g)
            )
        if progress is not None:
            progress(g + 1, n_groups)
    return out


@dataclass(frozen=True)
class Twin:
    """The counterfactual of one rendering: the same words except the label-bearing one.

    ``example`` is the twin's rendering, ``target`` the index of the label that changes,
    ``position`` the one prompt position where the two differ (the label-bearing token)."""

    example: Example
    target: int
    position: int


def twin_of(clean: Example, twin: Example, target: int) -> Twin:
    """Check the twin contract (same length, one prompt word changed, that target's label
    changed and no other) and say where the two differ."""
    if len(clean.tokens) != len(twin.tokens) or clean.colon_index != twin.colon_index:
        raise ValueError(f"task {clean.task}: a twin must have the same length as its example")
    diff = [i for i, (a, b) in enumerate(zip(clean.prompt, twin.prompt, strict=True)) if a != b]
    if len(diff) != 1:
        raise ValueError(
            f"task {clean.task}: a twin must differ from its example in one prompt word, "
            f"not {len(diff)}"
        )
    changed = [i for i, (a, b) in enumerate(zip(clean.answer, twin.answer, strict=True)) if a != b]
    if changed != [target]:
        raise ValueError(f"task {clean.task}: a twin must change label {target} and no other")
    return Twin(twin, target, diff[0])


def generate_twins(mod, n_groups, distractors, seed, params, stream) -> list[Twin | None]:
    """The twin of every rendering ``generate_groups`` makes, in the same order (None where
    the task has none). A twin's base comes from the task's ``twin(base, params, group)``
    and is rendered with the same generator as its example, so the distractor stream is
    the same word for word."""
    twin = getattr(mod, "twin", None)
    if twin is None:
        raise ValueError(f"task {mod.NAME} defines no twin(base, params, group)")
    bases = mod.draw_bases(n_groups, seed, params, stream)
    out: list[Twin | None] = []
    for g, base in enumerate(bases):
        flipped = twin(base, params, g)
        for n in distractors:
            if flipped is None:
                out.append(None)
                continue
            key = (seed, mod.NAME, stream, g, int(n))
            clean = mod.render(base, int(n), rng_for(*key), params, g)
            other = mod.render(flipped[0], int(n), rng_for(*key), params, g)
            out.append(twin_of(clean, other, flipped[1]))
    return out

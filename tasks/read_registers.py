"""read_registers: ``<bos> <writes among distractors> : v_A v_B ..``; each generated word
retrieves a different stored item, in order.

Each of R registers is written once, a pair ``R<x> V<v>`` at a random place among the
distractors (the registers in random order); the answer is every register's value in register
order, with no register names. Register r holds one of its own two values, V<2r> or V<2r+1>:
a read is then a look-up by content, which a small model learns in minutes, where binding
arbitrary values to their register's name (multi_register) took the default model 16 heads
and a curriculum of its own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import STREAM_PROBE, Example, generate_groups, interleave, rng_for

NAME = "read_registers"
GENERATED = True  # the answer is generated over many tokens
LABELS = vocab.VALUES


MAX_REGISTERS = len(vocab.VALUES) // 2  # two values of its own per register


@dataclass(frozen=True)
class Params:
    n_registers: int = 4

    def __post_init__(self):
        if not 2 <= self.n_registers <= MAX_REGISTERS:
            raise ValueError(f"n_registers must be in 2..{MAX_REGISTERS}")

    def to_dict(self) -> dict:
        return {"n_registers": self.n_registers}


Base = tuple[tuple[int, ...], tuple[int, ...]]  # (register order of the writes, bit per register)


def value(register: int, bit: int) -> str:
    """Register ``register``'s value word for ``bit``: V<2r> or V<2r+1>."""
    return vocab.VALUES[2 * register + bit]


def targets(params: dict) -> tuple[str, ...]:
    """One target per register, in answer order: RA, RB, ..."""
    return vocab.REGISTERS[: Params(**params).n_registers]


def answer(base: Base) -> tuple[str, ...]:
    """The oracle: each register's value, in register order."""
    return tuple(value(r, b) for r, b in enumerate(base[1]))


def solve(prompt: tuple[str, ...], params: Params) -> tuple[str, ...]:
    """The answer read from the prompt alone (what checks a generated answer): the value
    written after each register's name."""
    value = {prompt[i]: prompt[i + 1] for i in range(len(prompt) - 1) if prompt[i] in vocab.REGISTERS}
    return tuple(value[r] for r in vocab.REGISTERS[: params.n_registers])


def step_states(answer: tuple[str, ...]) -> tuple[str, ...]:
    """The task state each generated step must carry: the value it is to emit."""
    return answer


def answer_length(answer: tuple[str, ...]) -> int:
    """What an answer's length means here: the number of registers read out."""
    return len(answer)


def draw_base(rng: np.random.Generator, params: Params) -> Base:
    order = rng.permutation(params.n_registers)
    bits = rng.integers(0, 2, size=params.n_registers)
    return tuple(int(r) for r in order), tuple(int(b) for b in bits)


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[Base]:
    rng = rng_for(seed, NAME, stream)
    return [draw_base(rng, params) for _ in range(n_groups)]


def render(base: Base, n: int, rng: np.random.Generator, params: Params, group: int = 0) -> Example:
    order, bits = base
    events = [(vocab.REGISTERS[r], value(r, bits[r])) for r in order]
    prompt = (vocab.BOS, *interleave(rng, events, n), vocab.COLON)
    return Example(NAME, group, n, prompt, answer(base))


def twin(base: Base, params: Params, group: int = 0) -> tuple[Base, int]:
    """The counterfactual base: register ``group % n_registers`` holds its other value; the
    answers differ in that register's word only."""
    order, bits = base
    r = group % params.n_registers
    new = list(bits)
    new[r] = 1 - bits[r]
    return (order, tuple(new)), r


def generate(
    n_groups: int,
    distractors: tuple[int, ...],
    seed: int,
    params: Params = Params(),
    stream: int = STREAM_PROBE,
) -> list[Example]:
    """``n_groups`` base instances, each rendered at every count in ``distractors``."""
    return generate_groups(sys.modules[__name__], n_groups, distractors, seed, params, stream)


def sample(rng: np.random.Generator, n: int, params: Params = Params()) -> Example:
    return render(draw_base(rng, params), n, rng, params, group=-1)

"""multi_register: ``<bos> <writes among distractors> : RA v_A RB v_B ..``.

Each of R registers is written 1 + o times (o uniform in 0..max_overwrites), each write a
pair ``R<x> V<v>`` with v uniform, the writes of all registers randomly interleaved
(each register's own order kept). The answer lists every register's final value, in
register order, each after its register's name; the labels are the values; the number of
overwrites per register is recorded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import STREAM_PROBE, Example, generate_groups, interleave, rng_for

NAME = "multi_register"
LABELS = vocab.VALUES  # the values are the labels
# the label words a real tokenizer may render the values as (``tasks.encoding``)
LABEL_WORDS = (
    LABELS,
    tuple("ABCDEFGHIJ"),
    ("apple", "pear", "plum", "lemon", "grape", "peach", "mango", "lime", "fig", "kiwi"),
)


@dataclass(frozen=True)
class Params:
    n_registers: int = 4
    n_values: int = 4
    max_overwrites: int = 3

    def __post_init__(self):
        if not 1 <= self.n_registers <= len(vocab.REGISTERS):
            raise ValueError(f"n_registers must be in 1..{len(vocab.REGISTERS)}")
        if not 2 <= self.n_values <= len(vocab.VALUES):
            raise ValueError(f"n_values must be in 2..{len(vocab.VALUES)}")
        if not 0 <= self.max_overwrites <= 8:
            raise ValueError("max_overwrites must be in 0..8")

    def to_dict(self) -> dict:
        return {
            "n_registers": self.n_registers,
            "n_values": self.n_values,
            "max_overwrites": self.max_overwrites,
        }


Base = tuple[tuple[tuple[int, int], ...], tuple[int, ...]]  # (writes (reg, val), overwrites)


STRATUM = "overwrites"  # results are also split by how often a register was overwritten


def targets(params: dict) -> tuple[str, ...]:
    """One probe target per register: RA, RB, ..."""
    return vocab.REGISTERS[: Params(**params).n_registers]


def draw_base(rng: np.random.Generator, params: Params) -> Base:
    overwrites = rng.integers(0, params.max_overwrites + 1, size=params.n_registers)
    owner = np.repeat(np.arange(params.n_registers), overwrites + 1)
    owner = rng.permutation(owner)  # interleave registers, each one's order is implicit
    values = rng.integers(0, params.n_values, size=len(owner))
    writes = tuple((int(r), int(v)) for r, v in zip(owner, values, strict=True))
    return writes, tuple(int(o) for o in overwrites)


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[Base]:
    rng = rng_for(seed, NAME, stream)
    return [draw_base(rng, params) for _ in range(n_groups)]


def render(base: Base, n: int, rng: np.random.Generator, params: Params, group: int = 0) -> Example:
    writes, overwrites = base
    final = {}
    for r, v in writes:
        final[r] = v
    events = [(vocab.REGISTERS[r], vocab.VALUES[v]) for r, v in writes]
    prompt = (vocab.BOS, *interleave(rng, events, n), vocab.COLON)
    answer = tuple(vocab.VALUES[final[r]] for r in range(params.n_registers))
    # The answer names each register before its value ("RA V1 RB V2 ..."): reading a
    # register is then a lookup, and every value is scored at a known position.
    rendered = tuple(w for r in range(params.n_registers) for w in (vocab.REGISTERS[r], answer[r]))
    return Example(NAME, group, n, prompt, answer, overwrites, rendered)


def twin(base: Base, params: Params, group: int = 0) -> tuple[Base, int]:
    """The counterfactual base: register ``group % n_registers`` gets another final value
    (its last write's value + 1, modulo n_values); every other write is kept. Returns the
    base and the index of the register (the target) whose label changes."""
    writes, overwrites = base
    r = group % params.n_registers
    j = max(i for i, (reg, _) in enumerate(writes) if reg == r)
    new = list(writes)
    new[j] = (r, (writes[j][1] + 1) % params.n_values)
    return (tuple(new), overwrites), r


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

"""recall_bits: ``<bos> SET w_1 .. w_R d_1 .. d_n : w_1 .. w_R``; each generated word retrieves a
different stored item, in order.

R bits are stored right after ``SET``, bit i written as one of slot i's own two words
(``V<2i>`` for 0, ``V<2i+1>`` for 1), and read back in order after the colon, hundreds of
distractors later. The word a step must emit is found in the prompt after the word the step
before emitted (an induction read), or by the slot its position names. Slots have words of
their own because arbitrary values bound to arbitrary slots (multi_register) took the default
model 16 heads and a curriculum of its own, and a small model trained in minutes learned only
the first reads of a variant with shared words. A small model learns the slots one after
another (``docs/generation.md``), hence three by default.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import STREAM_PROBE, Example, distractor_words, generate_groups, rng_for

NAME = "recall_bits"
GENERATED = True  # the answer is generated over many tokens
LABELS = vocab.VALUES
MAX_BITS = len(vocab.VALUES) // 2  # two words of its own per slot


@dataclass(frozen=True)
class Params:
    n_bits: int = 3

    def __post_init__(self):
        if not 2 <= self.n_bits <= MAX_BITS:
            raise ValueError(f"n_bits must be in 2..{MAX_BITS}")

    def to_dict(self) -> dict:
        return {"n_bits": self.n_bits}


def word(slot: int, bit: int) -> str:
    """Slot ``slot``'s word for ``bit``: V<2i> or V<2i+1>."""
    return vocab.VALUES[2 * slot + bit]


def targets(params: dict) -> tuple[str, ...]:
    """One target per stored bit, in answer order: bit1, bit2, ..."""
    return tuple(f"bit{i + 1}" for i in range(Params(**params).n_bits))


def answer(bits: tuple[int, ...]) -> tuple[str, ...]:
    """The oracle: each slot's word, in order."""
    return tuple(word(i, b) for i, b in enumerate(bits))


def solve(prompt: tuple[str, ...], params: Params) -> tuple[str, ...]:
    """The answer read from the prompt alone (what checks a generated answer): the words
    stored after SET."""
    at = prompt.index(vocab.SET) + 1
    return tuple(prompt[at : at + params.n_bits])


def step_states(answer: tuple[str, ...]) -> tuple[str, ...]:
    """The task state each generated step must carry: the word it is to emit."""
    return answer


def answer_length(answer: tuple[str, ...]) -> int:
    """What an answer's length means here: the number of stored bits."""
    return len(answer)


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[tuple[int, ...]]:
    rng = rng_for(seed, NAME, stream)
    return [tuple(int(b) for b in rng.integers(0, 2, size=params.n_bits)) for _ in range(n_groups)]


def render(
    bits: tuple[int, ...], n: int, rng: np.random.Generator, params: Params, group: int = 0
) -> Example:
    stored = answer(bits)
    prompt = (vocab.BOS, vocab.SET, *stored, *distractor_words(rng, n), vocab.COLON)
    return Example(NAME, group, n, prompt, stored)


def twin(bits: tuple[int, ...], params: Params, group: int = 0) -> tuple[tuple[int, ...], int]:
    """The counterfactual base: bit ``group % n_bits`` flipped; the answers differ there only."""
    i = group % params.n_bits
    new = list(bits)
    new[i] = 1 - bits[i]
    return tuple(new), i


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
    bits = tuple(int(b) for b in rng.integers(0, 2, size=params.n_bits))
    return render(bits, n, rng, params, group=-1)

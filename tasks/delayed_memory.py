"""delayed_memory: ``<bos> SET b d_1 .. d_n : b``; a bit stored first, asked at the colon."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import (
    STREAM_PROBE,
    Example,
    balanced_bits,
    distractor_words,
    generate_groups,
    rng_for,
)

NAME = "delayed_memory"
LABELS = (vocab.ZERO, vocab.ONE)
# the label words a real tokenizer may render the labels as, the built-in words first
# (``tasks.encoding.choose_label_words`` takes the first set of single distinct tokens)
LABEL_WORDS = (LABELS, ("zero", "one"), ("off", "up"), ("no", "yes"))
# positions a probe site may name (``fit --site resid@bit``): words -> index
POSITIONS = {"bit": lambda words: 2}  # <bos> SET b ...


@dataclass(frozen=True)
class Params:
    """delayed_memory has no parameters beyond the distractor counts."""

    def to_dict(self) -> dict:
        return {}


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[int]:
    return [int(b) for b in balanced_bits(rng_for(seed, NAME, stream), n_groups)]


def render(bit: int, n: int, rng: np.random.Generator, params: Params, group: int = 0) -> Example:
    prompt = (vocab.BOS, vocab.SET, LABELS[bit], *distractor_words(rng, n), vocab.COLON)
    return Example(NAME, group, n, prompt, (LABELS[bit],))


def twin(bit: int, params: Params, group: int = 0) -> tuple[int, int]:
    """The counterfactual base: the other bit (target 0, the only one)."""
    return 1 - bit, 0


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
    """One fresh training example (label and distractors from ``rng``)."""
    return render(int(rng.integers(0, 2)), n, rng, params, group=-1)

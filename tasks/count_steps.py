"""count_steps: ``<bos> NEED Nk d_1 .. d_n : STEP .. STEP DONE .. DONE``; an answer generated
over many tokens whose state is not in the last token.

The prompt announces k (1..max_count); the answer is ``STEP`` k times, then ``DONE`` until it
is ``max_count + 1`` words long (a fixed length, so that an example and its twin line up word
for word). While the model emits ``STEP``, every generated token looks the same: how many are
left lives in attention over the outputs or in the fed-back state, not in the visible token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import STREAM_PROBE, Example, distractor_words, generate_groups, rng_for

NAME = "count_steps"
# the answer is generated over many tokens: read while decoding, not at the colon alone
GENERATED = True
LABELS = (vocab.STEP, vocab.DONE)
POSITIONS = {"need": lambda words: 2}  # <bos> NEED Nk ...


@dataclass(frozen=True)
class Params:
    max_count: int = 6  # k is uniform in 1..max_count; the answer is max_count + 1 words

    def __post_init__(self):
        if not 2 <= self.max_count <= len(vocab.COUNTS):
            raise ValueError(f"max_count must be in 2..{len(vocab.COUNTS)}, got {self.max_count}")

    def to_dict(self) -> dict:
        return {"max_count": self.max_count}


def targets(params: dict) -> tuple[str, ...]:
    """One target per answer word: the word of generated step 1, 2, ..."""
    return tuple(f"step{i + 1}" for i in range(Params(**params).max_count + 1))


def answer(k: int, params: Params) -> tuple[str, ...]:
    """The oracle: k STEPs, then DONE up to max_count + 1 words."""
    return (vocab.STEP,) * k + (vocab.DONE,) * (params.max_count + 1 - k)


def solve(prompt: tuple[str, ...], params: Params) -> tuple[str, ...]:
    """The answer read from the prompt alone (what checks a generated answer)."""
    return answer(vocab.COUNTS.index(prompt[prompt.index(vocab.NEED) + 1]) + 1, params)


def step_states(answer: tuple[str, ...]) -> tuple[int, ...]:
    """The task state each generated step must carry, from the answer's words: how many STEPs
    are still to come when the step's word is emitted (k, k - 1, .., 1, then 0)."""
    k = answer.count(vocab.STEP)
    return tuple(max(k - i, 0) for i in range(len(answer)))


def answer_length(answer: tuple[str, ...]) -> int:
    """What an answer's length means here: k, the number of STEPs."""
    return answer.count(vocab.STEP)


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[int]:
    rng = rng_for(seed, NAME, stream)
    return [int(k) for k in rng.integers(1, params.max_count + 1, size=n_groups)]


def render(k: int, n: int, rng: np.random.Generator, params: Params, group: int = 0) -> Example:
    prompt = (vocab.BOS, vocab.NEED, vocab.COUNTS[k - 1], *distractor_words(rng, n), vocab.COLON)
    return Example(NAME, group, n, prompt, answer(k, params))


def twin(k: int, params: Params, group: int = 0) -> tuple[int, int]:
    """The counterfactual base: a count one away (up for even groups where it can, else down);
    the two answers differ in one word, the first that only the larger count makes a STEP."""
    other = k + 1 if (group % 2 == 0 and k < params.max_count) or k == 1 else k - 1
    return other, min(k, other)


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
    """One fresh training example (count and distractors from ``rng``)."""
    return render(int(rng.integers(1, params.max_count + 1)), n, rng, params, group=-1)

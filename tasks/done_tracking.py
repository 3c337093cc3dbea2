"""done_tracking: ``<bos> NEED Nk <stream> : DONE|MORE``.

``k`` steps are required; ``s`` count-free ``STEP`` events sit at random positions among
the distractors; the label is DONE iff ``s >= k``. No running count is ever written, so
next-token prediction cannot learn the count from a visible counter, and ``s`` is drawn
right at the boundary (DONE: s in {k, k+1}; MORE: s in {k-1, k-2} where >= 0), so
neither ``k`` alone nor ``s`` alone predicts the label.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tasks import vocab
from tasks.base import (
    STREAM_PROBE,
    Example,
    balanced_bits,
    generate_groups,
    interleave,
    rng_for,
)

NAME = "done_tracking"
LABELS = (vocab.MORE, vocab.DONE)
# the label words a real tokenizer may render the labels as (``tasks.encoding``)
LABEL_WORDS = (LABELS, ("more", "done"), ("wait", "stop"))
# positions a probe site may name (``fit --site resid@need``): words -> index; last_step is
# the last STEP event (or the count itself when there is none)
POSITIONS = {
    "need": lambda words: 2,  # <bos> NEED Nk ...
    "last_step": lambda words: max([2] + [i for i, w in enumerate(words) if w == vocab.STEP]),
}


@dataclass(frozen=True)
class Params:
    max_need: int = 4  # k is uniform in 1..max_need
    # relative weight of each k in 1..max_need (None = uniform); a training-data option, to
    # show the hard boundaries (large k) more often
    need_weights: tuple[float, ...] | None = None

    def __post_init__(self):
        if not 1 <= self.max_need <= len(vocab.COUNTS):
            raise ValueError(f"max_need must be in 1..{len(vocab.COUNTS)}, got {self.max_need}")
        if self.need_weights is not None:
            w = tuple(float(x) for x in self.need_weights)
            if len(w) != self.max_need or min(w) < 0 or sum(w) <= 0:
                raise ValueError(
                    f"need_weights needs {self.max_need} non-negative weights (one per k), "
                    f"not all zero, got {list(self.need_weights)}"
                )
            object.__setattr__(self, "need_weights", w)

    def to_dict(self) -> dict:
        d: dict = {"max_need": self.max_need}
        if self.need_weights is not None:
            d["need_weights"] = list(self.need_weights)
        return d


def draw_base(rng: np.random.Generator, done: int, params: Params) -> tuple[int, int]:
    """(k, s) with label ``done``: s sits within two of the threshold."""
    if params.need_weights is None:
        k = int(rng.integers(1, params.max_need + 1))
    else:
        w = np.array(params.need_weights)
        k = 1 + int(rng.choice(params.max_need, p=w / w.sum()))
    if done:
        s = k + int(rng.integers(0, 2))
    else:
        s = k - 1 - int(rng.integers(0, min(2, k)))
    return k, s


def draw_bases(n_groups: int, seed: int, params: Params, stream: int) -> list[tuple[int, int]]:
    rng = rng_for(seed, NAME, stream)
    return [draw_base(rng, int(d), params) for d in balanced_bits(rng, n_groups)]


def render(
    base: tuple[int, int], n: int, rng: np.random.Generator, params: Params, group: int = 0
) -> Example:
    k, s = base
    stream = interleave(rng, [(vocab.STEP,)] * s, n)
    prompt = (vocab.BOS, vocab.NEED, vocab.COUNTS[k - 1], *stream, vocab.COLON)
    return Example(NAME, group, n, prompt, (LABELS[int(s >= k)],))


def twin(
    base: tuple[int, int], params: Params, group: int = 0
) -> tuple[tuple[int, int], int] | None:
    """The counterfactual base: the announced count moved across the threshold, the STEP
    events kept (DONE -> k = s + 1, MORE -> k = s: the nearest count with the other label).
    None when that count is outside 1..max_need: a MORE example with no STEP at all, or a
    DONE one with s >= max_need, has no twin the model was trained on."""
    k, s = base
    k2 = s + 1 if s >= k else s
    if not 1 <= k2 <= params.max_need:
        return None
    return (k2, s), 0


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
    base = draw_base(rng, int(rng.integers(0, 2)), params)
    return render(base, n, rng, params, group=-1)

"""The one word-level vocabulary shared by every task (see docs/tasks.md).

Token ids are fixed by position in ``TOKENS``; ``VOCAB_VERSION`` changes whenever that
list changes, and every dataset and checkpoint records it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

VOCAB_VERSION = "1"

PAD, BOS, COLON = "<pad>", "<bos>", ":"
# delayed_memory
SET, ZERO, ONE = "SET", "ZERO", "ONE"
# done_tracking
NEED, STEP, DONE, MORE = "NEED", "STEP", "DONE", "MORE"
# multi_register: register names and values
REGISTERS = tuple(f"R{chr(ord('A') + i)}" for i in range(8))  # RA..RH
VALUES = tuple(f"V{i}" for i in range(10))  # V0..V9
# counts announced by NEED
COUNTS = tuple(f"N{i}" for i in range(1, 10))  # N1..N9
# semantically irrelevant distractor words
DISTRACTORS = (
    "the", "a", "of", "and", "to", "in", "it", "is",
    "was", "for", "on", "as", "with", "by", "at", "from",
    "red", "blue", "green", "tall", "small", "old", "new", "far",
    "cat", "dog", "tree", "rock", "river", "cloud", "road", "bird",
)  # fmt: skip

TOKENS: tuple[str, ...] = (
    (PAD, BOS, COLON, SET, ZERO, ONE, NEED, STEP, DONE, MORE)
    + REGISTERS
    + VALUES
    + COUNTS
    + DISTRACTORS
)
TOKEN_TO_ID: dict[str, int] = {t: i for i, t in enumerate(TOKENS)}
VOCAB_SIZE = len(TOKENS)
PAD_ID, BOS_ID, COLON_ID = TOKEN_TO_ID[PAD], TOKEN_TO_ID[BOS], TOKEN_TO_ID[COLON]
DISTRACTOR_IDS = tuple(TOKEN_TO_ID[w] for w in DISTRACTORS)

assert len(set(TOKENS)) == len(TOKENS), "duplicate token in the vocabulary"


def encode(text: str | Sequence[str]) -> list[int]:
    """Token ids of a space-separated text (or a list of words); unknown words raise."""
    words = text.split() if isinstance(text, str) else list(text)
    try:
        return [TOKEN_TO_ID[w] for w in words]
    except KeyError as e:
        raise ValueError(
            f"unknown token {e.args[0]!r} (not in vocabulary v{VOCAB_VERSION})"
        ) from None


def decode(ids: Iterable[int]) -> str:
    """Space-separated text of token ids; out-of-range ids raise."""
    out = []
    for i in ids:
        i = int(i)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} out of range [0, {VOCAB_SIZE})")
        out.append(TOKENS[i])
    return " ".join(out)

"""The one word-level vocabulary shared by every task (see docs/tasks.md).

Token ids are fixed by position in ``TOKENS``. The first ``BASE_SIZE`` tokens are the
built-in tasks' vocabulary, version ``VOCAB_VERSION``; a task registered later may bring
tokens of its own, which ``extend`` appends, so every existing id stays what it was and no
checkpoint or dataset is invalidated. Datasets and model folders record the token list they
were made with; it must be a prefix of the current one.
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
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "it",
    "is",
    "was",
    "for",
    "on",
    "as",
    "with",
    "by",
    "at",
    "from",
    "red",
    "blue",
    "green",
    "tall",
    "small",
    "old",
    "new",
    "far",
    "cat",
    "dog",
    "tree",
    "rock",
    "river",
    "cloud",
    "road",
    "bird",
)

TOKENS: tuple[str, ...] = (
    (PAD, BOS, COLON, SET, ZERO, ONE, NEED, STEP, DONE, MORE)
    + REGISTERS
    + VALUES
    + COUNTS
    + DISTRACTORS
)
TOKEN_TO_ID: dict[str, int] = {t: i for i, t in enumerate(TOKENS)}
VOCAB_SIZE = len(TOKENS)
BASE_SIZE = VOCAB_SIZE  # the built-in vocabulary (v1); ids below it never change
PAD_ID, BOS_ID, COLON_ID = TOKEN_TO_ID[PAD], TOKEN_TO_ID[BOS], TOKEN_TO_ID[COLON]
DISTRACTOR_IDS = tuple(TOKEN_TO_ID[w] for w in DISTRACTORS)

assert len(set(TOKENS)) == len(TOKENS), "duplicate token in the vocabulary"


def extend(tokens) -> None:
    """Append tokens that are not in the vocabulary yet (a registered task's own words)."""
    global TOKENS, VOCAB_SIZE
    new = [t for t in dict.fromkeys(tokens) if t not in TOKEN_TO_ID]
    for t in new:
        if not isinstance(t, str) or not t or " " in t:
            raise ValueError(f"a token is a non-empty word without spaces, got {t!r}")
    for t in new:
        TOKEN_TO_ID[t] = len(TOKEN_TO_ID)
    TOKENS = TOKENS + tuple(new)
    VOCAB_SIZE = len(TOKENS)


def check_prefix(recorded, what: str) -> None:
    """A recorded token list (a dataset's, a model's) must be a prefix of the vocabulary."""
    rec = list(recorded)
    if rec != list(TOKENS[: len(rec)]):
        extra = [t for t in rec if t not in TOKEN_TO_ID]
        hint = f" (tokens {extra[:3]} unknown: register their task first)" if extra else ""
        raise ValueError(f"{what} was made with another vocabulary{hint}")


def encode(text: str | Sequence[str]) -> list[int]:
    """Token ids of a space-separated text (or a list of words); unknown words raise."""
    words = text.split() if isinstance(text, str) else list(text)
    try:
        return [TOKEN_TO_ID[w] for w in words]
    except KeyError as e:
        raise ValueError(
            f"unknown token {e.args[0]!r} (not in the vocabulary; a task's own tokens join it "
            "when the task is registered)"
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

"""How a prompt is run, one type for every command: probing, decoding, interventions.

A ``Prefill`` is either k Jacobi passes over the whole prompt (``standard`` = 1, the paper's
one-step ``recurrent`` prefill = 2, ``k<N>`` = N) or the exact sequential recurrence
(``full``: every position fused with the previous position's top state of the same
computation). ``parse_prefill`` is the one reader of the command-line words.

A decoding mode (``DecodeMode``) is a prefill plus whether each generated token is fused
with the previous step's top state. The paper's four modes, by name:

==========  =================  ==========================
mode        prefill            generated steps
==========  =================  ==========================
standard    standard           plain embeddings
soft        standard           fused with the last state
fused       recurrent          fused with the last state
full        full               fused with the last state
==========  =================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fbt_probe.feedback import FeedbackModel, PassOutput
from fbt_probe.recurrence import run_recurrence
from fbt_probe.util.lists import comma_items, once

# as stability's --passes: far beyond where the Jacobi map has converged or diverged
MAX_PASSES = 1000
NAMED = {"standard": 1, "recurrent": 2, "full": None}
PREFILLS = tuple(NAMED)  # what "all" means on the command line


@dataclass(frozen=True)
class Prefill:
    """``passes`` Jacobi passes over the prompt, or ``None`` for the exact recurrence."""

    passes: int | None

    def __post_init__(self):
        if self.passes is not None and not 1 <= self.passes <= MAX_PASSES:
            raise ValueError(f"a prefill has 1..{MAX_PASSES} passes, got {self.passes}")

    @property
    def name(self) -> str:
        """The command-line word: standard, recurrent, full or k<N>."""
        for word, passes in NAMED.items():
            if passes == self.passes:
                return word
        return f"k{self.passes}"

    @property
    def feedback(self) -> bool:
        """Whether any position of the prompt is fused with a fed-back state."""
        return self.passes != 1

    def __str__(self) -> str:
        return self.name

    def run(self, model: FeedbackModel, tokens: torch.Tensor, cache=None) -> PrefillRun:
        """Run ``tokens`` (batch, pos) from position 0; ``cache`` (optional) receives the keys
        and values of the last pass (or of the recurrence), what decoding continues from."""
        if self.passes is None:
            return PrefillRun(run_recurrence(model, tokens, cache=cache), None)
        B, T = tokens.shape
        model.set_context(1, None, 0)
        emb = model.embed(tokens)
        plain = model.plain_mask(B, T, None, tokens.device)
        prev = None
        for k in range(self.passes - 1):
            prev = model.feedback_pass(emb, prev, plain=plain, pass_number=k + 1).states
        last = model.feedback_pass(emb, prev, plain=plain, cache=cache, pass_number=self.passes)
        return PrefillRun(last, prev)


@dataclass
class PrefillRun:
    """What a prefill computed: its last pass (logits and top states, batch x pos) and the top
    states of the pass before it (None for one pass and for the recurrence)."""

    out: PassOutput
    prev: torch.Tensor | None


STANDARD, RECURRENT, FULL = Prefill(1), Prefill(2), Prefill(None)


def parse_prefill(word: str | Prefill) -> Prefill:
    """The one reader of a prefill's command-line word: standard, recurrent, full or k<N>."""
    if isinstance(word, Prefill):
        return word
    if word in NAMED:
        return Prefill(NAMED[word])
    if word.startswith("k") and word[1:].isdigit() and 1 <= int(word[1:]) <= MAX_PASSES:
        return Prefill(int(word[1:]))
    raise ValueError(
        f"unknown prefill {word!r}: use standard, recurrent, full or k<N> "
        f"(N passes, 1..{MAX_PASSES})"
    )


def jacobi_passes(
    word: str | Prefill, lo: int = 1, hi: int = MAX_PASSES, option: str = "--prefill"
) -> int:
    """The number of Jacobi passes a prefill word names (standard 1, recurrent 2, k<N> N),
    for a command that reads every pass up to it; ``full`` and counts outside ``lo..hi``
    are refused naming ``option``."""
    try:
        pf = parse_prefill(word)
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None
    if pf.passes is None:
        raise ValueError(
            f"{option} full: this command reads Jacobi passes; use standard, "
            f"recurrent or k<N> (N in {lo}..{hi})"
        )
    if not lo <= pf.passes <= hi:
        lo_word = "recurrent" if lo == 2 else f"k{lo}"
        raise ValueError(
            f"{option} {word}: this command reads {lo_word} to k{hi} ({lo}..{hi} passes)"
        )
    return pf.passes


def parse_prefills(spec: str) -> tuple[Prefill, ...]:
    """``--prefill``'s value: one word, a comma-separated list or ``all`` (standard,
    recurrent, full). Each prefill once, in order."""
    words = PREFILLS if spec == "all" else comma_items(spec, "--prefill")
    return tuple(dict.fromkeys(once((parse_prefill(w) for w in words), "--prefill", spec)))


@dataclass(frozen=True)
class DecodeMode:
    """A decoding mode: the prompt's prefill, and whether generated steps are fused."""

    name: str
    prefill: Prefill
    soft: bool


MODES = {
    "standard": DecodeMode("standard", STANDARD, soft=False),
    "soft": DecodeMode("soft", STANDARD, soft=True),
    "fused": DecodeMode("fused", RECURRENT, soft=True),
    "full": DecodeMode("full", FULL, soft=True),
}


def decode_mode(name: str | DecodeMode) -> DecodeMode:
    """A decoding mode by name (standard, soft, fused, full)."""
    if isinstance(name, DecodeMode):
        return name
    if name not in MODES:
        raise ValueError(f"unknown decoding mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


def parse_modes(spec: str, option: str = "--modes") -> tuple[str, ...]:
    """A comma-separated list of decoding modes (``option``'s value), each once."""
    modes = comma_items(spec, option)
    for m in modes:
        try:
            decode_mode(m)
        except ValueError as e:
            raise ValueError(f"{option} {spec!r}: {e}") from None
    return modes

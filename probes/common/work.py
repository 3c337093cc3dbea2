"""The work an analysis asks of its data, priced before it starts (``fbt_probe.runtime.budget``): the
prompts' tokens times the passes each is run for, times how many runs the analysis makes of
each (its controls, sites, patched runs). Every analysis that runs a model over a dataset
calls ``check_data_work`` once its data are loaded and before its first progress line; past
the budget's limit it is refused in one line naming the options that ask for it."""

from __future__ import annotations

from fbt_probe.runtime.budget import check_work, prefill_passes

__all__ = ["check_data_work", "prefill_passes", "prompt_tokens"]


def prompt_tokens(datasets) -> int:
    """Tokens of every prompt (up to its colon) of ``datasets``."""
    return sum(int((ds.colon_index + 1).sum()) for ds in datasets)


def check_data_work(model, datasets, passes: float, runs: float, options: str) -> float:
    """Refuse ``runs`` runs of ``passes`` passes over every prompt of ``datasets`` where they
    would take more than a day here; ``options`` names what asks for it, as spelled."""
    tokens = prompt_tokens(datasets)
    what = f"{runs:g} runs of {passes:g} passes over {tokens:,} prompt tokens"
    return check_work(model, tokens * passes * runs, options, what)

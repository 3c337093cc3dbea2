"""Comma-separated option values (``--task a,b``, ``--kinds``, ``--seeds 0-4,7``), read one
way by every verb: each item stripped; an empty item, or an item named twice (written twice,
or inside two ranges), is refused in one line that names the option as the user spelled it,
before any work. A list is run once per item, so a repeated item would be run and recorded
twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable


class NamedTwice(ValueError):
    """An item of a list option came twice (its message is the user's one line)."""


def comma_items(spec: str, option: str) -> tuple[str, ...]:
    """The items of ``spec``, in order, each once."""
    words = tuple(w.strip() for w in str(spec).split(","))
    if not any(words):
        raise ValueError(f"{option} {spec!r}: give at least one item")
    if not all(words):
        raise ValueError(f"{option} {spec!r}: an empty item between commas")
    return once(words, option, spec)


def once(items: Iterable, option: str, spec: str) -> tuple:
    """``items`` as a tuple, refused where one of them comes twice."""
    items = tuple(items)
    twice = [x for x, n in Counter(items).items() if n > 1]
    if twice:
        raise NamedTwice(f"{option} {spec!r}: {twice[0]} is named twice")
    return items


def comma_numbers(
    spec: str, option: str, expand: Callable[[str], list[int]], usage: str | None = None
) -> tuple[int, ...]:
    """The numbers of ``spec``, each item expanded by ``expand`` ('4-6' -> 4, 5, 6), in
    order, each once. ``expand`` raises ValueError for an item it cannot read; with
    ``usage``, that error is the one line ``usage`` (an item named twice keeps its own)."""
    items = comma_items(spec, option)
    try:
        numbers = [n for part in items for n in expand(part)]
    except ValueError:
        if usage is None:
            raise
        raise ValueError(usage) from None
    return once(numbers, option, spec)

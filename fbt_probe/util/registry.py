"""One registry type for every extension point: tasks, probe types, interventions and analyses.

Each is a read-only mapping from name to entry. Adding a name that is already there is refused
unless ``replace=True`` is asked for, so that a plugin never silently replaces a built-in
entry; looking up an unknown name fails in one line that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

T = Any  # an entry: a task module, a probe class, an intervention, an analysis


class Registry(Mapping):
    """Entries of one ``kind`` (a word for messages: "task", "probe", ...) by name, in the
    order they were registered."""

    def __init__(
        self, kind: str, identifiers: bool = True, builtins: Callable[[], None] | None = None
    ):
        """``builtins``: registers the built-in entries, called once on first use (before
        anything else is added), so that importing the registry imports none of them."""
        self.kind, self.identifiers = kind, identifiers
        self._items: dict[str, T] = {}
        self._builtins = builtins

    @property
    def loaded(self) -> bool:
        """Whether the built-in entries have been registered (they are on first use)."""
        return self._builtins is None

    def _load(self) -> None:
        if self._builtins is not None:
            load, self._builtins = self._builtins, None
            load()

    def add(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Register ``entry`` under ``name`` (see ``check``)."""
        self.check(name, replace=replace)
        self._items[name] = entry
        return entry

    def check(self, name: str, *, replace: bool = False) -> None:
        """Refuse a name ``add`` would refuse: not one word (an identifier where the registry
        asks for one: a name that becomes a command or a keyword), or already registered
        unless ``replace``."""
        self._load()
        if not isinstance(name, str) or not name or any(c in name for c in ", \t\n"):
            raise ValueError(f"a {self.kind} needs a one-word name, got {name!r}")
        if self.identifiers and not name.isidentifier():
            raise ValueError(f"a {self.kind} needs a name that is an identifier, got {name!r}")
        if name in self._items and not replace:
            raise ValueError(
                f"a {self.kind} named {name!r} is already registered; pass "
                "replace=True to replace it"
            )

    def remove(self, name: str) -> None:
        """Take ``name`` out (an entry registered for a while, as a test's own)."""
        self._load()
        self._items.pop(name, None)

    def lookup(self, name: str) -> T:
        """The entry of ``name``; an unknown name is one line listing the known ones."""
        self._load()
        if name in self._items:
            return self._items[name]
        raise ValueError(f"unknown {self.kind} {name!r}; choose from {', '.join(self._items)}")

    def names(self) -> tuple[str, ...]:
        self._load()
        return tuple(self._items)

    def __getitem__(self, name: str) -> T:
        self._load()
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._items)

    def __len__(self) -> int:
        self._load()
        return len(self._items)

    def __repr__(self) -> str:
        self._load()
        return f"Registry({self.kind!r}: {', '.join(self._items)})"

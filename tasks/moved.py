"""Modules that moved: importing one by its old name fails in one line naming where it went,
rather than with Python's bare "No module named ...". Each package installs its own list."""

from __future__ import annotations

import sys

MOVED: dict[str, str] = {}


class MovedModuleFinder:
    """Refuses the old name of a module that moved, naming its new home (a meta path finder:
    ``find_spec`` is all ``sys.meta_path`` asks of one; importlib.abc costs the CLI's start)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(f"{fullname} moved: import {MOVED[fullname]} instead",
                                      name=fullname)  # fmt: skip
        return None


def install(moves: dict[str, str]) -> None:
    """Add ``moves`` ({old module: where it went}) to the refused names (once per process)."""
    MOVED.update(moves)
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())

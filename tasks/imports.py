"""How the packages import: old module paths refused in one line naming where they went, and
public names imported on first use (``fbt_probe``, ``tasks``, ``probes``), so that importing a
package, as the CLI does to list its verbs, costs nothing until a name is asked for."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

MOVED: dict[str, str] = {}


class MovedModuleFinder:
    """Refuses the old name of a module that moved, naming its new home (a meta path finder:
    ``find_spec`` is all ``sys.meta_path`` asks of one; importlib.abc costs the CLI's start)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved: import {MOVED[fullname]} instead", name=fullname
            )
        return None


def install(moves: dict[str, str]) -> None:
    """Add ``moves`` ({old module: where it went}) to the refused names (once per process)."""
    MOVED.update(moves)
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def resolve(ref: str, name: str = ""):
    """What ``ref`` names: ``"module:attribute"``; ``"module"``, the attribute ``name`` of it;
    ``"module:"``, the module itself."""
    module, colon, attr = ref.partition(":")
    found = importlib.import_module(module)
    if colon and not attr:
        return found
    return getattr(found, attr or name)


def lazy_attributes(package: str, refs: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``refs`` ({name:
    ref, as ``resolve`` reads it}) when it is first asked for."""

    def __getattr__(name: str):
        if name not in refs:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return resolve(refs[name], name)

    return __getattr__

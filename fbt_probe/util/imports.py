"""How the packages import: public names imported on first use (``fbt_probe``, ``tasks``,
``probes``), so that importing a package, as the CLI does to list its verbs, costs nothing
until a name is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable


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

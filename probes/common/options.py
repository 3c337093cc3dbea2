"""The options several analyses share, written once; each analysis's options dataclass
extends ``Common`` and overrides a default (or a docstring) where its own differs."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar


def option(default: Any = MISSING, *flags: str, **click: Any):
    """A dataclass field that is also a CLI option: ``flags`` its spellings (default
    ``--field-name``), ``click`` what typer.Option takes besides (``min``, ``max``,
    ``hidden``, ``metavar``). The help is the field's docstring."""
    meta = {"flags": flags, "click": click}
    if isinstance(default, list | dict | set):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    return field(default=default, metadata=meta)


def option_help(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right below it in the class body."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not hasattr(klass, "__dataclass_fields__"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        names = vars(importlib.import_module(klass.__module__))
        for a, b in zip(body, body[1:], strict=False):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
            ):
                doc = _text(b.value, names)
                if doc is not None:
                    out[a.target.id] = " ".join(doc.split())
    return out


def _text(node: ast.expr, names: dict) -> str | None:
    """A docstring's text: a string literal, or literals and module constants joined by +
    (a wording several options share is written once)."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.Name):
        v = names.get(node.id)
        return v if isinstance(v, str) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left, names), _text(node.right, names)
        return None if a is None or b is None else a + b
    return None


JACOBI_WORDS = "standard (1 pass), recurrent (2 passes) or k<N> (N passes)"
PREFILLS_HELP = (
    "How each prompt is run: standard, recurrent (2 Jacobi passes), full (the exact "
    "recurrence), k<N> (N Jacobi passes); a comma-separated list, or 'all' (the "
    "first three)."
)
PREFILL_WORDS = (
    "standard, recurrent (2 Jacobi passes), full (the exact recurrence), k<N> (N Jacobi passes)"
)


@dataclass(frozen=True)
class Common:
    """Options every analysis of a model takes."""

    model: str = option("default", "--model", "-m")
    """'default', a shipped model's name or a model/run folder (in the library: a loaded model too)."""
    task: str = option("all", "--task", "-t")
    """A task name ({tasks}), a comma-separated list, or 'all'."""
    data: Path | None = option(None, "--data")
    """A dataset file (its task is used); default data/<task>.parquet, generated if absent."""
    out: Path = option(Path("results"), "--out", "-o")
    """Output folder."""
    device: str = option("cpu", "--device")
    """Where to run: cpu, cuda, cuda:N, or auto."""
    force: bool = option(False, "--force")
    """Replace an earlier run's outputs in --out (all of them, stale ones included)."""

    @cached_property
    def tasks_and_data(self) -> tuple[tuple[str, ...], dict | None]:
        """``--task`` and ``--data`` read once: the tasks, and each one's dataset file (None:
        each task's default file)."""
        from probes.common.data import tasks_and_data

        return tasks_and_data(self.task, self.data)


class JacobiPasses:
    """Options whose ``--prefill`` names a number of Jacobi passes (standard, recurrent,
    k<N>), read once as ``passes``, within ``PASSES`` (the analysis's least and most)."""

    PASSES: ClassVar[tuple[int, int]] = (1, 16)

    @cached_property
    def passes(self) -> int:
        from fbt_probe.prefill import jacobi_passes

        return jacobi_passes(self.prefill, *self.PASSES)


class GeneratedTasks:
    """Options of the analyses of generated answers (``steps``, ``loop``): ``--task`` names
    tasks whose answer is generated, ``--modes`` decoding modes; each read once."""

    @cached_property
    def tasks(self) -> tuple[str, ...]:
        from probes.common.decoding import generation_tasks

        return generation_tasks(self.task)

    @cached_property
    def mode_list(self) -> tuple[str, ...]:
        from fbt_probe.prefill import parse_modes

        return tuple(parse_modes(self.modes))


def check_options(options) -> None:
    """The one check of an analysis's options, before any work, on the command line and in
    the library call alike: each number within its bounds (``check_bounds``), then what the
    options dataclass checks itself (its ``validate()``, where it has one: values that must
    parse, options that exclude each other)."""
    check_bounds(options)
    own = getattr(options, "validate", None)
    if callable(own):
        own()


def check_bounds(options) -> None:
    """A number outside its option's bounds (``option(..., min=, max=)``) is refused, naming
    the option; every analysis's run checks its options here, on the command line and in the
    library call alike (the command line's parser leaves bounds to this)."""
    for f in fields(options):
        value, bounds = getattr(options, f.name), f.metadata.get("click", {})
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        flag = next(iter(f.metadata.get("flags", ())), "--" + f.name.replace("_", "-"))
        if "min" in bounds and value < bounds["min"]:
            raise ValueError(f"{flag} must be at least {bounds['min']}, got {value}")
        if "max" in bounds and value > bounds["max"]:
            raise ValueError(f"{flag} must be at most {bounds['max']}, got {value}")

"""Synthetic state-tracking tasks: data only, no model imports.

A task is a module (or any object) with ``NAME``, a ``Params`` dataclass (with ``to_dict``),
``draw_bases``, ``render``, ``generate`` and ``sample`` (see ``tasks/delayed_memory.py``,
the smallest), registered with ``register_task``. It may also declare:

- ``TOKENS``: words it needs beyond the shared vocabulary; they are appended to it, so
  every existing token keeps its id and no checkpoint is invalidated;
- ``targets(params)``: the names of its probe targets, one per answer word (default:
  ``("label",)``); multi_register names one per register;
- ``STRATUM``: the name of a per-target count that results are also split by (stored in
  each example's ``overwrites``; multi_register: ``"overwrites"``), or None;
- ``twin(base, params, group)``: the counterfactual base with one label flipped and
  everything else kept, and the index of that label, or None when the base has none
  (``fbt-probe generate --twins``, ``fbt-probe intervene``).

Everything else (generate, fit, plot, report, the CLI's task lists) reads the registry:
a new task is one module that registers itself.
"""

from __future__ import annotations

from fbt_probe.util import imports
from fbt_probe.util.registry import Registry

TASK_NAMES = ("delayed_memory", "done_tracking", "multi_register")  # the built-in tasks
# built-in tasks whose answer is generated over many tokens (``GENERATED = True``): the
# generation analyses read them; 'all' of the colon analyses leaves them out
GENERATION_TASKS = ("count_steps", "recall_bits")


def _builtins() -> None:
    # imported on the registry's first use: importing tasks (the CLI does, to build its
    # verbs) then costs no numpy
    from tasks import count_steps, delayed_memory, done_tracking, multi_register, recall_bits

    for t in (delayed_memory, done_tracking, multi_register, count_steps, recall_bits):
        register_task(t)


TASKS: Registry = Registry("task", builtins=_builtins)


def register_task(task, *, replace: bool = False):
    """Add a task (module or object) to the registry under ``task.NAME``; its ``TOKENS``
    join the vocabulary. A name already registered is refused unless ``replace``."""
    name = getattr(task, "NAME", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a task needs a NAME that is an identifier, got {name!r}")
    for attr in ("Params", "draw_bases", "render", "generate", "sample"):
        if not hasattr(task, attr):
            raise ValueError(f"task {name!r} lacks {attr}")
    TASKS.check(name, replace=replace)  # before its tokens join the vocabulary
    from tasks import vocab  # here, not above: the CLI imports this package to list its verbs

    vocab.extend(getattr(task, "TOKENS", ()))
    return TASKS.add(name, task, replace=replace)


def get_task(name: str, option: str | None = None):
    """The generator of a registered task; for an unknown name, one line naming the known
    ones (and ``option``, the command-line option that gave it, where one did)."""
    if option is None:
        return TASKS.lookup(name)
    try:
        return TASKS.lookup(name)
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None


def task_names(generated: bool = False) -> tuple[str, ...]:
    """The registered tasks whose answer is read at the colon (what 'all' means to the colon
    analyses), built-in ones first; ``generated``: those whose answer is generated over many
    tokens instead (a task's ``GENERATED``)."""
    return tuple(n for n, t in TASKS.items() if bool(getattr(t, "GENERATED", False)) == generated)


def is_generated(task: str) -> bool:
    """Whether ``task``'s answer is generated over many tokens (``GENERATED``)."""
    return bool(getattr(get_task(task), "GENERATED", False))


def target_names(task: str, params: dict | None = None) -> tuple[str, ...]:
    """The probe targets a task declares, one per answer word (its dataset's params)."""
    mod = get_task(task)
    fn = getattr(mod, "targets", None)
    return tuple(fn(params or {})) if fn is not None else ("label",)


def stratum(task: str) -> str | None:
    """The name of the task's own per-target stratum, or None."""
    return getattr(get_task(task), "STRATUM", None)


# the rest of the surface, imported on first use (the CLI imports this package to list its verbs)
_LAZY = {
    "vocab": "tasks.vocab:",
    "Example": "tasks.base:Example",
    "POOLED": "tasks.base:POOLED",
    "generate_dataset": "tasks.generate:generate_dataset",
    "load_dataset": "tasks.dataset:load",
    "Dataset": "tasks.dataset:Dataset",
    "Registry": "fbt_probe.util.registry:Registry",
}
__all__ = [
    "TASKS",
    "TASK_NAMES",
    "GENERATION_TASKS",
    "is_generated",
    "register_task",
    "get_task",
    "task_names",
    "target_names",
    "stratum",
    *_LAZY,
]


__getattr__ = imports.lazy_attributes("tasks", _LAZY)

"""Synthetic state-tracking tasks: data only, no model imports."""

from __future__ import annotations

from tasks import delayed_memory, done_tracking, multi_register

TASKS = {
    "delayed_memory": delayed_memory,
    "done_tracking": done_tracking,
    "multi_register": multi_register,
}
TASK_NAMES = tuple(TASKS)


def get_task(name: str):
    """The generator module of a task; a clear error for unknown names."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}") from None

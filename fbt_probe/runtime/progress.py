"""A progress bar that appears only when the work takes more than a second."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@contextmanager
def lazy_progress(
    description: str, total: int, delay: float = 1.0, enabled: bool = True
) -> Iterator[Callable[..., None]]:
    """Yield ``update(done, total=None, **fields)``; a rich bar shows after ``delay`` s.

    The bar goes to stderr, so stdout stays clean for ``--json`` output.
    """
    t0 = time.monotonic()
    state: dict = {"progress": None, "task": None, "total": total, "last_line": 0.0}
    interactive = sys.stderr.isatty()

    def update(done: int, total_: int | None = None, info: str = "") -> None:
        if total_ is not None:
            state["total"] = total_
        if not enabled:
            return
        if not interactive:  # logs and pipes: a plain line every 10 s instead of a live bar
            now = time.monotonic()
            if now - t0 >= delay and (now - state["last_line"] >= 10 or done == state["total"]):
                state["last_line"] = now
                sys.stderr.write(
                    f"{description}: {done}/{state['total']} ({now - t0:.0f} s) {info}\n"
                )
                sys.stderr.flush()
            return
        if state["progress"] is None:
            if time.monotonic() - t0 < delay:
                return
            from rich.console import Console

            p = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=sys.stderr),
                transient=False,
            )
            p.start()
            state["progress"] = p
            state["task"] = p.add_task(description, total=state["total"], info="")
        state["progress"].update(state["task"], completed=done, total=state["total"], info=info)

    try:
        yield update
    finally:
        if state["progress"] is not None:
            state["progress"].stop()

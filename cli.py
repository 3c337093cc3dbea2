"""The ``fbt-probe`` command line: one thin typer command per verb.

Each command parses its arguments and calls a library function that works without
typer. Errors a user can cause are reported as one line on stderr with a non-zero exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

try:  # typer >= 0.20 vendors click; older releases use the click package
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

app = typer.Typer(
    name="fbt-probe",
    help="Probe latent feedback in full-bandwidth transformers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Probe latent feedback in full-bandwidth transformers.

    Typical use: fbt-probe reproduce (everything on the built-in default model), or
    fbt-probe generate --task delayed_memory, then fbt-probe fit --prefill recurrent.
    """


USER_ERRORS = (ValueError, OSError, KeyError)


def fail(msg: str, code: int = 1) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def user_errors(fn):
    """Turn expected errors into one line on stderr and exit 1, with no traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            if isinstance(e, OSError) and e.strerror and e.filename:
                msg = f"{e.strerror}: {e.filename}"
            fail(str(msg).splitlines()[0] if str(msg) else type(e).__name__)

    return wrapper


@app.command()
@user_errors
def generate(
    task: str = typer.Option(
        ..., "--task", "-t", help="done_tracking, delayed_memory or multi_register."
    ),
    n_groups: int = typer.Option(
        200, "--n-groups", help="Base instances; each is rendered at every distractor count."
    ),
    distractors: str = typer.Option(
        "default",
        "--distractors",
        help="Distractor counts: a list '0,1,4', a range '0-16', or 'default' (0,1,2,4,...,256).",
    ),
    seed: int = typer.Option(
        1234, "--seed", help="Seed; same arguments and seed give the same bytes."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="Output file (default data/<task>.parquet)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a self-describing dataset (parquet) of one synthetic task."""
    from fbt_probe.progress import lazy_progress
    from tasks import get_task
    from tasks.dataset import parse_distractors
    from tasks.generate import generate_dataset

    get_task(task)
    counts = parse_distractors(distractors)
    with lazy_progress(f"generate {task}", n_groups) as bar:
        path = generate_dataset(task, out, n_groups, counts, seed, force=force, progress=bar)
    typer.echo(f"wrote {path} ({n_groups} groups x {len(counts)} distractor counts)")


def main() -> None:
    """Console entry point: usage errors also become one line."""
    try:
        rv = app(standalone_mode=False)
        if isinstance(rv, int) and rv != 0:
            sys.exit(rv)
    except click_exceptions.NoArgsIsHelpError as e:
        typer.echo(e.format_message())
        sys.exit(0)
    except click_exceptions.UsageError as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()

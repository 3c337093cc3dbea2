"""The command line's machinery: the error boundary every verb shares, progress bars, help that
names what is registered, and a verb for every registered analysis, generated from its options
dataclass (``Verbs``). Only ``cli.py`` imports this module; the analyses themselves never need
typer."""

from __future__ import annotations

import functools
import os
from dataclasses import fields

import typer

try:  # typer >= 0.20 vendors click; older releases use the click package
    from typer._click import exceptions as click_exceptions
    from typer._click.utils import make_default_short_help as short_help
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions
    from click.utils import make_default_short_help as short_help


class Verbs(typer.core.TyperGroup):
    """The verbs: the commands below, and one for every registered analysis (``probes``),
    built when it is called; the list of verbs reads only the registry."""

    def list_commands(self, ctx):
        from probes import ANALYSES

        return [*super().list_commands(ctx), *(n for n in ANALYSES if n not in self.commands)]

    def get_command(self, ctx, name):
        from probes import ANALYSES

        if name not in self.commands and name in ANALYSES:
            self.commands[name] = analysis_command(ANALYSES[name])
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        from probes import ANALYSES

        names = [
            n for n in self.list_commands(ctx) if not getattr(self.commands.get(n), "hidden", False)
        ]
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)

        def short(name):  # an analysis's verb not built yet: its summary from the registry
            cmd = self.commands.get(name)
            return cmd.get_short_help_str(limit) if cmd else short_help(ANALYSES[name].help, limit)

        with formatter.section("Commands"):
            formatter.write_dl([(n, short(n)) for n in names])


USER_ERRORS = (ValueError, OSError, KeyError)


DEBUG_ENV = "FBT_DEBUG"  # set to 1 to see the traceback of an unexpected error

# the signal the console script received (``cli.main`` sets it): an error raised after it is
# its consequence (a library's C code can turn the KeyboardInterrupt into another error), and
# the command ends as aborted, not with that error
SIGNALLED: dict = {}


def fail(msg: str, code: int = 1) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def user_errors(fn):
    """The CLI's one error boundary: expected errors become one line on stderr and exit 1;
    so does anything unexpected (its type named), with the traceback only under FBT_DEBUG=1.
    After a signal, any error is the signal's: the command ends as aborted."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click_exceptions.ClickException):
            raise
        except USER_ERRORS as e:
            if SIGNALLED:
                raise KeyboardInterrupt from None
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            if isinstance(e, OSError) and e.strerror and e.filename:
                msg = f"{e.strerror}: {e.filename}"
            fail(str(msg).splitlines()[0] if str(msg) else type(e).__name__)
        except Exception as e:
            if SIGNALLED:
                raise KeyboardInterrupt from None
            if os.environ.get(DEBUG_ENV) == "1":
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            fail(
                f"unexpected {type(e).__name__}{': ' + first if first else ''} "
                f"(a bug or an unusual input; {DEBUG_ENV}=1 shows the traceback)"
            )

    return wrapper


def bars(label: str, total: int, delay: float = 1.0):
    """A progress bar on stderr once the work takes ``delay`` seconds (the library's ``bars``
    argument); long jobs show theirs at once (``eager``)."""
    from fbt_probe.runtime.progress import lazy_progress

    return lazy_progress(label, total, delay=delay)


def eager(label: str, total: int):
    return bars(label, total, delay=0.0)


class Command(typer.core.TyperCommand):
    """A verb whose options' help may name what is registered (``help_lists``); an
    analysis's verb reads its options' docstrings only when its help is shown."""

    options = None  # an analysis's options dataclass

    def format_help(self, ctx, formatter):
        from probes.analysis import option_helps, with_lists

        helps = option_helps(self.options) if self.options is not None else {}
        for p in self.params:
            p.help = helps.get(p.name, p.help)
            if getattr(p, "help", None):
                p.help = with_lists(p.help)
        return super().format_help(ctx, formatter)


def moved_option(flag: str, replacement: str):
    """A hidden option that fails in one line naming what replaces it."""

    def refuse(value):
        if value is not None:
            fail(f"{flag} is gone: use {replacement.replace('<N>', str(value))}")

    return typer.Option(None, flag, hidden=True, callback=refuse)


# ---- the analyses' verbs, generated from the registry (probes.analysis) ------------------------
def analysis_command(analysis):
    """The click command of ``analysis``'s verb: one option per field of its options
    dataclass (the field's docstring is its help), printing the lines its run reports."""
    import inspect
    import typing
    from dataclasses import MISSING

    options = analysis.options_class
    hints, params = typing.get_type_hints(options), []
    for f in fields(options):
        flags = f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",)
        default = f.default if f.default is not MISSING else f.default_factory()
        # bounds (min, max) are the options dataclass's to check, with the same one line in
        # the library call and on the command line; the help shows them
        click = {k: v for k, v in f.metadata.get("click", {}).items() if k not in ("min", "max")}
        opt = typer.Option(default, *flags, **click)
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=hints[f.name]
            )
        )
    for flag, replacement in analysis.moved.items():
        params.append(
            inspect.Parameter(
                flag.strip("-").replace("-", "_") + "_moved",
                inspect.Parameter.KEYWORD_ONLY,
                default=moved_option(flag, replacement),
                annotation=str,
            )
        )

    def command(**kw):
        chosen = options(**{k: v for k, v in kw.items() if not k.endswith("_moved")})
        with bars(analysis.name, 1) as bar:
            result = analysis(options=chosen, progress=bar)
        if result.lines:
            typer.echo("\n".join(result.lines))

    command.__signature__ = inspect.Signature(params)
    command.__name__, command.__doc__ = analysis.name, analysis.help
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    cls = type(f"{analysis.name}_command", (Command,), {"options": options})
    one.command(analysis.name, cls=cls, epilog=f"\b\nExample: {analysis.example}")(
        user_errors(command)
    )
    return typer.main.get_command(one)

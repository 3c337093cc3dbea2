"""The analysis registry: an analysis is one folder of ``probes/`` that registers itself once.

An ``Analysis`` names everything the rest of the toolkit needs of it:

- ``options``: a frozen dataclass whose fields are its options, its whole interface. A
  field's docstring (the string under it) is its help; ``probes.common.options.option`` adds
  the flag's spelling and bounds; a ``validate()`` method, where it has one, checks what the
  bounds cannot (values that must parse, options that exclude each other). The CLI verb is
  generated from it (``probes.verbs``), and so is the library call ``probes.run_<name>``
  (``library_call``); both check it once, before any work (``check_options``);
- ``run(options, progress)``: does the work on checked options, writes its folder, returns a
  ``Result``;
- ``section(results)``: its part of report.md and report.html, a list of markdown strings and
  ``Figure`` s, read from what ``run`` wrote under a results folder;
- ``reproduce``: the options ``fbt-probe reproduce`` runs it with (None: not a step), or a
  function ``(model, results, progress) -> lines`` where one set of options will not do.

Functions may be given as ``"module:attribute"`` strings, imported on first use: the CLI
imports the registry to build its verbs, and ``fbt-probe --help`` must not wait for torch.
Register your own with ``register_analysis(Analysis(...))``; ``tests/probes/test_analysis.py`` does it
with a toy analysis.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import MISSING, fields, replace
from pathlib import Path

from fbt_probe.util import imports
from fbt_probe.util.registry import Registry
from fbt_probe.util.transaction import transaction
from probes.common.options import check_options


class Figure:
    """A figure of a report section: the PNG (linked from report.md, embedded in report.html)
    and, where the figure is a heatmap, the interactive tables report.html shows instead,
    drawn from the same selection of the same table (``keep_png``: the PNG has other panels
    and is shown too). A plain class, not a dataclass: the CLI imports this module to list
    its verbs, and each dataclass costs its start a fraction of a millisecond."""

    __slots__ = ("path", "html", "keep_png")

    def __init__(self, path: Path, html: tuple[str, ...] = (), keep_png: bool = False):
        self.path, self.html, self.keep_png = Path(path), tuple(html), keep_png

    def __repr__(self) -> str:
        return f"Figure({self.path!r}, {len(self.html)} tables, keep_png={self.keep_png})"


class Result:
    """What an analysis's run returns: its tables by name, and the lines it reports."""

    __slots__ = ("tables", "lines")

    def __init__(self, tables: dict | None = None, lines: list[str] | None = None):
        self.tables, self.lines = dict(tables or {}), list(lines or [])

    def __repr__(self) -> str:
        return f"Result(tables={list(self.tables)}, lines={len(self.lines)})"


def resolve(fn):
    """``fn`` itself, or the attribute a ``"module:attribute"`` string names."""
    return imports.resolve(fn) if isinstance(fn, str) else fn


class Analysis:
    """One analysis (see the module docstring). ``help``: the verb's help, its first line the
    summary; ``example``: a command line that runs it, shown at the end of ``--help``;
    ``folder``: where it writes inside a results folder (reproduce, the report);
    ``figures``: redraws its figures from the tables it saved under a results folder and
    returns how many it drew (``fbt-probe plot``); ``moved``: options that are gone, each
    with what replaces it (``<N>``: the value given), refused in one line; ``outputs``: the
    names it writes in its ``--out`` folder (glob patterns, ``fbt_probe.util.transaction``):
    an earlier run's are replaced only with ``--force``, and all of them at once."""

    __slots__ = (
        "name",
        "options",
        "run",
        "help",
        "example",
        "folder",
        "section",
        "figures",
        "reproduce",
        "moved",
        "outputs",
    )

    def __init__(
        self,
        *,
        name: str,
        options: type | str,
        run: Callable | str,
        help: str,
        example: str,
        folder: str,
        section: Callable | str | None = None,
        figures: Callable | str | None = None,
        reproduce: dict | Callable | str | None = None,
        moved: dict | None = None,
        outputs: tuple[str, ...] = (),
    ):
        # a plain class, not a dataclass: the CLI imports this module to list its verbs
        if not isinstance(options, str) and not hasattr(options, "__dataclass_fields__"):
            raise ValueError(f"analysis {name!r}: options must be a dataclass")
        if not example.startswith(f"fbt-probe {name}"):
            raise ValueError(f"analysis {name!r}: its example must run 'fbt-probe {name}'")
        self.name, self.options, self.run, self.help, self.example = (
            name,
            options,
            run,
            help,
            example,
        )
        self.folder, self.section, self.figures = folder, section, figures
        self.reproduce, self.moved, self.outputs = reproduce, dict(moved or {}), tuple(outputs)

    def __repr__(self) -> str:
        return f"Analysis({self.name!r}, folder={self.folder!r})"

    @classmethod
    def of_folder(cls, package: str, **fields) -> Analysis:
        """An analysis laid out as the built-in ones are: the folder ``package`` (a dotted
        module path) holds ``options.py`` (``<Name>Options``), ``run.py`` (``run``),
        ``report.py`` (``section``) and ``plot.py`` (``figures``); ``fields`` give the rest
        (``help``, ``example``, ``reproduce``, ...) and may replace any of these."""
        name = fields.pop("name", package.rsplit(".", 1)[-1])
        layout = {
            "options": f"{package}.options:{name.title()}Options",
            "run": f"{package}.run:run",
            "section": f"{package}.report:section",
            "figures": f"{package}.plot:figures",
            "folder": name,
        }
        return cls(name=name, **{**layout, **fields})

    def __call__(self, model=None, options=None, *, progress=None, force=None, **changes) -> Result:
        """Run it as the library: ``options`` (default: the dataclass's defaults) with
        ``changes`` applied, on ``model`` when given (a loaded model or a name); ``force``
        (default: the options' own ``force``) replaces an earlier run's outputs."""
        opts = options if options is not None else self.options_class()
        if model is not None:
            changes["model"] = model
        if changes:
            opts = replace(opts, **changes)
        check_options(opts)
        run = resolve(self.run)
        if not hasattr(opts, "out"):
            return run(opts, progress)
        # every output is written into a staging folder and moved into --out at the end
        out = Path(opts.out)
        force = bool(getattr(opts, "force", False) if force is None else force)
        with transaction(out, self.outputs, force=force) as stage:
            result = run(staged(opts, stage), progress)
        result.lines = [line.replace(str(stage), str(out)) for line in result.lines]
        return result

    def redraw(self, results: Path) -> int:
        """Its figures, redrawn from its tables under ``results`` (0 where it has none)."""
        return int(self._read_back(self.figures, results)) if self.figures else 0

    def report(self, results: Path) -> list:
        """Its report section from ``results`` (empty where it has not run there)."""
        return list(self._read_back(self.section, results)) if self.section else []

    def _read_back(self, fn, results: Path):
        """``fn(results)``, where a file it reads back that is damaged or edited is refused in
        one line naming the analysis's folder (or, from the readers, the file)."""
        where = Path(results) / self.folder
        try:
            return resolve(fn)(Path(results))
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, OSError | ValueError) and str(where) in first:
                raise  # it names the file already
            raise ValueError(
                f"{where}: {self.name}'s results cannot be read back ({first}); "
                f"run 'fbt-probe {self.name} --out {where} --force' again"
            ) from None

    @property
    def options_class(self) -> type:
        """The options dataclass (imported where it was given as ``"module:Class"``)."""
        return resolve(self.options)

    def option_fields(self) -> list:
        return list(fields(self.options_class))


def staged(options, stage: Path):
    """``options`` writing into ``stage``, keeping what checking them read and parsed (the
    cached values of its properties: tasks, prefills, saved probes), so that nothing is
    parsed or read from disk twice."""
    names = {f.name for f in fields(options)}
    moved = replace(options, out=stage)
    if hasattr(options, "__dict__") and hasattr(moved, "__dict__"):  # not a slots dataclass
        moved.__dict__.update({k: v for k, v in vars(options).items() if k not in names})
    return moved


ANALYSES: Registry = Registry("analysis")

# the spellings of the number of passes before --prefill took them, on the verbs that had them
PASSES_MOVED = {"--passes": "--prefill k<N>", "-k": "--prefill k<N>"}


def register_analysis(analysis: Analysis, *, replace: bool = False) -> Analysis:
    """Add ``analysis`` under its name; one already registered is refused unless ``replace``.
    It becomes a CLI verb, a section of report.md and report.html, and (with ``reproduce``)
    a step of ``fbt-probe reproduce``."""
    return ANALYSES.add(analysis.name, analysis, replace=replace)


def get_analysis(name: str) -> Analysis:
    return ANALYSES.lookup(name)


def analysis_names() -> tuple[str, ...]:
    return ANALYSES.names()


# ---- the library call: ``run_<name>``, generated from the options ----------------------------
REGISTERED = re.compile(r"\{(tasks|recipes|interventions|analyses)\}")


def help_list(name: str) -> str:
    """What a help text's ``{tasks}``, ``{recipes}``, ``{interventions}`` or ``{analyses}``
    names: what is registered now, read only when that help is shown."""
    from tasks import TASK_NAMES, TASKS, task_names

    if name == "recipes":
        return ", ".join(imports.resolve("fbt_probe.train.recipes:recipe_names")())
    if name == "interventions":  # the registry imports torch: only where a help names it
        return ", ".join(imports.resolve("probes.intervene.registry:REGISTRY"))
    if name == "tasks":  # the built-in tasks' names need not import them (and numpy)
        return ", ".join(task_names() if TASKS.loaded else TASK_NAMES)
    return ", ".join(ANALYSES)


def with_lists(text: str) -> str:
    """``text`` with each ``{tasks}`` (...) replaced by what is registered now."""
    return REGISTERED.sub(lambda m: help_list(m.group(1)), text)


def option_helps(options_class: type) -> dict[str, str]:
    """Each option's help as ``--help`` shows it and ``run_<name>``'s docstring says it: the
    field's docstring, then its bounds."""
    from probes.common.options import option_help

    docs = option_help(options_class)
    for f in fields(options_class):
        bounds = f.metadata.get("click", {})
        said = [
            f"{w} {bounds[k]}" for k, w in (("min", "at least"), ("max", "at most")) if k in bounds
        ]
        if said and docs.get(f.name):
            docs[f.name] += f" [{', '.join(said)}]"
    return docs


def library_call(analysis: Analysis) -> Callable[..., Result]:
    """``run_<name>``: ``analysis`` as a library call whose parameters are its options' fields
    (``model`` first, positional too; the rest by keyword, with the command line's defaults)
    and ``progress`` (a callable ``(done, total, label)``). It checks and runs them as the verb
    does, outputs in one transaction, and returns the ``Result``."""
    import inspect
    import typing

    cls = analysis.options_class
    hints, params = typing.get_type_hints(cls), []
    for f in sorted(fields(cls), key=lambda f: f.name != "model"):
        kind = inspect.Parameter.KEYWORD_ONLY
        if f.name == "model":
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = f.default if f.default is not MISSING else f.default_factory()
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints[f.name]))
    params.append(inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default=None))
    signature = inspect.Signature(params, return_annotation=Result)

    def run_analysis(*args, **kwargs) -> Result:
        chosen = dict(signature.bind(*args, **kwargs).arguments)
        progress = chosen.pop("progress", None)
        return analysis(options=cls(**chosen), progress=progress)

    helps = option_helps(cls)
    lines = [with_lists(analysis.help), "", "Options, as on the command line:"]
    lines += [f"    {p.name}: {with_lists(helps.get(p.name, ''))}" for p in params[:-1]]
    lines += ["    progress: a callable (done, total, label) the work reports to.", ""]
    lines += [f"The command line: {analysis.example}"]
    run_analysis.__signature__ = signature
    run_analysis.__name__ = run_analysis.__qualname__ = f"run_{analysis.name}"
    run_analysis.__doc__, run_analysis.__module__ = "\n".join(lines), "probes"
    return run_analysis

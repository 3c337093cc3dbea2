"""``report.md`` and ``report.html``: one section per registered analysis, in the order the
analyses were registered, each from what that analysis wrote under a results folder."""

from __future__ import annotations

from pathlib import Path

from fbt_probe.util.files import atomic_write, check_output_dir, claim
from fbt_probe.util.transaction import transaction
from probes.analysis import ANALYSES, Figure
from probes.fit.plot import plot_all
from probes.report.page import write_report_html

OUTPUTS = ("report.md", "report.html")

TITLE = "# fbt-probe report: is task state decodable from the latent feedback, and is it used?"


def sections(results: Path) -> list[list]:
    """Each registered analysis's section of ``results``, where it has one."""
    found = [a.report(results) for a in ANALYSES.values()]
    return [s for s in found if s]


def markdown(parts: list, results: Path) -> str:
    """The sections as markdown, figures linked relative to ``results``."""
    rel = lambda p: p.relative_to(results) if p.is_relative_to(results) else p.resolve()  # noqa: E731
    lines = [TITLE, ""]
    for part in parts:
        lines += (
            [f"![{part.path.stem}]({rel(part.path)})", ""] if isinstance(part, Figure) else [part]
        )
    return "\n".join(lines)


def redraw(results: str | Path, fit_out: str | Path | None = None) -> list[str]:
    """Every registered analysis's figures, redrawn from its tables under ``results`` (with
    ``fit_out``: only the fit's, into that folder). Refused where there is nothing to draw."""
    res = Path(results)
    if fit_out is not None:
        check_output_dir(Path(fit_out))
        with claim(Path(fit_out)):  # one writer at a time, as every verb
            drawn = plot_all(res, fit_out)
        return [f"drew {sum(len(v) for v in drawn.values())} panels into {fit_out}"]
    if not res.is_dir():
        raise FileNotFoundError(f"--results {res} is not a folder of results")
    with claim(res):
        return _redraw(res)


def _nothing_there(res: Path) -> str:
    """What to do about a results folder with nothing to read: an analysis's own folder (what
    ``--out results/loop`` wrote) is read from the folder above it."""
    own = next((a for a in ANALYSES.values() if a.folder == res.name), None)
    if own is not None and own.report(res.parent):
        return f"it is {own.name}'s own folder: pass the folder above it, {res.parent}"
    return f"run one there first, e.g. fbt-probe fit --out {res}"


def _redraw(res: Path) -> list[str]:
    for a in ANALYSES.values():  # every table read back first: a damaged one is refused
        a.report(res)  # before any figure is drawn
    counts = {a.name: a.redraw(res) for a in ANALYSES.values()}
    if not any(counts.values()):
        raise FileNotFoundError(
            f"{res} holds the tables of no analysis ({', '.join(ANALYSES)}): {_nothing_there(res)}"
        )
    return [
        f"drew {n} figure panel{'s' * (n != 1)} of {name}" for name, n in counts.items() if n
    ] + [f"into the figure folders under {res}"]


def write_report(results: str | Path, force: bool = False) -> Path:
    """Write ``report.md`` into ``results`` and ``report.html`` beside it (the same report as
    one offline page, its heatmaps interactive), both or neither; an earlier report is
    replaced only with ``force``. Refused where ``results`` holds the output of no
    registered analysis."""
    res = Path(results)
    found = sections(res)
    if not found:
        raise FileNotFoundError(
            f"{res} holds the results of no analysis ({', '.join(ANALYSES)}): {_nothing_there(res)}"
        )
    parts = [p for s in found for p in s]
    text = markdown(parts, res)
    with transaction(res, OUTPUTS, force=force, flag="--results") as stage:
        atomic_write(stage / "report.md", lambda tmp: Path(tmp).write_text(text))
        write_report_html(res, text, [p for p in parts if isinstance(p, Figure)], to=stage)
    return res / "report.md"

"""``report.md`` and ``report.html``: one section per registered analysis, in the order the
analyses were registered, each from what that analysis wrote under a results folder."""

from __future__ import annotations

from pathlib import Path

from probes.analysis import ANALYSES, Figure
from probes.report.page import write_report_html
from tasks.safe_files import atomic_write

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


def write_report(results: str | Path) -> Path:
    """Write ``report.md`` into ``results`` and ``report.html`` beside it (the same report as
    one offline page, its heatmaps interactive). Refused where ``results`` holds the output
    of no registered analysis."""
    res = Path(results)
    found = sections(res)
    if not found:
        raise FileNotFoundError(
            f"{res} holds the results of no analysis ({', '.join(ANALYSES)}): run one of them "
            "with --out there first"
        )
    parts = [p for s in found for p in s]
    text = markdown(parts, res)
    out = res / "report.md"
    atomic_write(out, lambda tmp: Path(tmp).write_text(text))
    write_report_html(res, text, [p for p in parts if isinstance(p, Figure)])
    return out

"""``report.html``: the report as one page that works offline.

The same text and tables as ``report.md`` (tables sort by any column), figures embedded as
data URIs, and each heatmap that its analysis's section gives interactive tables for drawn
as those (hover: the value, its 95 % interval and n), from the same selection of the same
table as its PNG. Curves stay embedded PNGs.
"""

from __future__ import annotations

from pathlib import Path

from probes.analysis import Figure
from probes.common.html import esc, image_uri, markdown_html, page, write_page


def write_report_html(
    res: Path, markdown: str, figures: list[Figure], to: Path | None = None
) -> Path:
    """``report.html`` beside ``report.md`` (in ``to``, default ``res``), from the report's
    markdown and the sections' figures: a figure with interactive tables shows them (and its
    PNG where it has other panels), any other is embedded."""
    by_path = {f.path.resolve(): f for f in figures}

    def image(alt: str, path: str) -> str:
        p = Path(path) if Path(path).is_absolute() else res / path
        fig = by_path.get(p.resolve())
        html = ""
        if fig is not None and fig.html:
            html = f'<figure class="interactive" data-figure="{esc(p.stem)}">{"".join(fig.html)}</figure>'
            if not fig.keep_png:
                return html
        if not p.is_file():
            return html + f"<p>(figure {esc(path)} is missing)</p>"
        return (
            html
            + f'<figure><img alt="{esc(alt)}" src="{image_uri(p)}"><figcaption>{esc(alt)}</figcaption></figure>'
        )

    body = markdown_html(markdown, image)
    note = (
        "<p><em>Hover a heatmap's cell for its value, interval and n; click a table's "
        "header to sort by it.</em></p>"
    )
    body = body.replace("</h1>", "</h1>" + note, 1)
    return write_page(Path(to or res) / "report.html", page("fbt-probe report", body))

"""report.html and a view page opened in a real browser: headless Chromium, driven by
Playwright. Each test keeps a screenshot in its temporary folder and asserts the page
rendered: no console error, the expected elements present, a tooltip on hover, a table that
sorts, and a screenshot that is not blank.

scripts/setup.sh installs Debian's chromium where it is missing; these tests are skipped,
with the reason, only where no Chromium can be found.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

# a root user's Chromium needs --no-sandbox; the rest keep it from reaching for a network
# this machine does not have (Google's update, sync and component services)
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium() -> str | None:
    for name in (os.environ.get("FBT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    exe = chromium()
    if exe is None:
        reason = "no Chromium here (scripts/setup.sh installs Debian's chromium where apt can)"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=ARGS)
        yield b
        b.close()


def open_page(browser, path):
    """The page at ``path`` and the list its console errors and page errors go to."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    return page, errors


def not_blank(png) -> None:
    """A screenshot with text and colour in it: many distinct colours, not one flat fill."""
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    colours = np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert png.stat().st_size > 10_000 and len(colours) > 50 and img.std() > 0.05


def test_report_html_renders_sorts_and_shows_tooltips(browser, results, tmp_path):  # noqa: F811
    from probes.fit.plot import plot_all
    from probes.report.markdown import write_report

    res, df = results
    plot_all(res)
    write_report(res)
    page, errors = open_page(browser, res / "report.html")
    assert page.locator("h1").first.inner_text().startswith("fbt-probe report")
    assert page.locator("figure.interactive").count() == len(
        list((res / "figures").glob("heatmap_*.png"))
    )
    assert page.locator("img").count() == 2
    for i in range(page.locator("img").count()):  # every embedded figure decoded
        assert page.locator("img").nth(i).evaluate("i => i.complete && i.naturalWidth > 100")
    cell = page.locator("figure.interactive td.cell").first
    cell.hover()
    tip = page.locator("#tip")
    assert tip.is_visible() and "accuracy" in tip.inner_text() and "examples in" in tip.inner_text()
    # the paper's table sorts by its accuracy column, both ways
    table = page.locator("table.sortable").first
    col = [t.strip() for t in table.locator("thead th").all_inner_texts()].index(
        "layer 0 (ours) [95 % CI]"
    )
    table.locator("thead th").nth(col).click()

    def column():
        texts = table.locator(f"tbody tr td:nth-child({col + 1})").all_inner_texts()
        return [float(t.split(" %")[0]) for t in texts]

    assert column() == sorted(column()) and len(column()) > 3
    table.locator("thead th").nth(col).click()
    assert column() == sorted(column(), reverse=True)
    shot = tmp_path / "report.png"
    page.screenshot(path=shot, full_page=True)
    not_blank(shot)
    assert errors == []


def test_a_view_page_renders_and_answers_clicks(browser, fitted, tmp_path):  # noqa: F811
    from probes.report.view import view

    model, tmp, data = fitted
    out, _ = view(
        data=data, probes=tmp / "fit", examples="2,5", prefill="k3", out=tmp_path / "view.html"
    )
    page, errors = open_page(browser, out)
    n = page.locator("#tokens span").count()
    assert n > 3
    assert page.locator("#probe td.cell").count() == n * (model.cfg.n_layers + 1)
    assert page.locator("#lens tbody tr").count() == 2 + model.cfg.n_layers + 1  # pass 2 is shown
    assert page.locator("canvas#attn").count() == 1
    # a lens cell's tooltip; a token click moves the query; another example and pass redraw
    page.locator("#lens td.cell").nth(3).hover()
    assert (
        "depth" in page.locator("#tip").inner_text() or "fed_" in page.locator("#tip").inner_text()
    )
    page.locator("#tokens span").nth(2).click()
    assert page.locator("#tokens span.sel").get_attribute("data-pos") == "2"
    page.select_option("#c-pass", "0")
    assert (
        page.locator("#lens tbody tr").count() == model.cfg.n_layers + 1
    )  # no fed-back state in pass 1
    page.select_option("#c-ex", "1")
    assert "row 5" in page.locator("#c-ex").inner_text()
    painted = page.locator("canvas#attn").evaluate(
        "c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let k = 0; for (let i = 3; i < d.length; i += 4) k += d[i] > 0; return k; }"
    )
    assert painted > 0
    shot = tmp_path / "view.png"
    page.screenshot(path=shot, full_page=True)
    not_blank(shot)
    assert errors == []

"""The docs that teach: the tutorials run as notebooks, and the site builds with --strict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("[0-9]*.py"))
jupytext = pytest.importorskip("jupytext")


def test_three_tutorials_each_paired_with_its_notebook():
    assert [p.stem for p in TUTORIALS] == [
        "01_probe_in_five_minutes",
        "02_is_it_used",
        "03_your_own_model",
    ]
    for script in TUTORIALS:
        nb = script.with_suffix(".ipynb")
        assert nb.is_file(), f"{nb.name} is missing: jupytext --to ipynb {script.relative_to(ROOT)}"
        want = [(c.cell_type, c.source) for c in jupytext.read(script).cells]
        got = [(c.cell_type, c.source) for c in jupytext.read(nb).cells]
        assert got == want, (
            f"{nb.name} differs from {script.name}: jupytext --sync {script.relative_to(ROOT)}"
        )
        assert all(not c.get("outputs") for c in jupytext.read(nb).cells), (
            f"{nb.name} is kept without outputs"
        )


# what each tutorial leaves in its folder, the proof that it got to its end
WRITES = {
    "01_probe_in_five_minutes": [
        "results/report.html",
        "results/probe_results.csv",
        "results/figures/heatmap_delayed_memory_prefill_by_depth.png",
    ],
    "02_is_it_used": ["interventions/interventions.csv", "fit/probe_results.csv"],
    "03_your_own_model": ["view.html", "fit/probes/probes.json"],
}


@pytest.mark.parametrize("script", TUTORIALS, ids=lambda p: p.stem)
def test_the_tutorial_runs_as_a_notebook(script, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("FBT_TUTORIAL_OUT", str(tmp_path))
    monkeypatch.setenv("FBT_TUTORIAL_GROUPS", "40")
    monkeypatch.setenv(
        "FBT_TUTORIAL_MODEL", "tiny"
    )  # the tiny model, even where SmolLM2 is converted
    nb = jupytext.read(script)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    out = tmp_path / script.stem[:2]
    for rel in WRITES[script.stem]:
        assert (out / rel).stat().st_size > 100, rel
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "layer-0 accuracy" in printed or "flips" in printed


def test_the_docs_site_builds_strict_with_the_api_reference_and_tutorials(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    got = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    api = (site / "api" / "model.html").read_text()
    assert "run_with_pass_caches" in api and "feedback_pass" in api  # from the docstrings
    for script in TUTORIALS:
        page = (site / "tutorials" / f"{script.stem}.html").read_text()
        assert "language-python" in page or "highlight" in page
        assert (site / "tutorials" / f"{script.stem}.ipynb").is_file()
    # every figure a page shows is in the site
    results = (site / "results.html").read_text()
    assert 'src="figures/heatmap_done_tracking_prefill_by_depth.png"' in results
    assert (site / "figures" / "heatmap_done_tracking_prefill_by_depth.png").is_file()
    assert not (ROOT / "site").exists() or (ROOT / ".gitignore").read_text().count("site/")

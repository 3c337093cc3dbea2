"""Seed studies trust no folder they did not check."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from cli import app
from tests.refusals import one_line_error, snapshot


@pytest.fixture(scope="module")
def finished_seeds(tmp_path_factory):
    """Finished tiny runs of seeds 0 and 1 (2 steps), as a study names them."""
    root = tmp_path_factory.mktemp("seeds")
    for s in (0, 1):
        args = [
            "train",
            "-c",
            "tiny",
            "--set",
            "steps=2",
            "--set",
            f"run.seed={s}",
            "--set",
            f"name=tiny-seed{s}",
            "--out",
            str(root / f"seed-{s}"),
        ]
        assert CliRunner().invoke(app, args).exit_code == 0
    return root


SEED_CASES = {
    "seed 1's run in seed 0's folder": (
        lambda d: shutil.copytree(d / "from" / "seed-1", d / "study" / "seed-0"),
        "seed-0 was trained with seed 1, not seed 0",
    ),
    "metrics.json not JSON": (
        lambda d: (d / "study" / "seed-0" / "metrics.json").write_text("{oops"),
        "seed-0/metrics.json cannot be read as JSON",
    ),
    "metrics.json a list": (
        lambda d: (d / "study" / "seed-0" / "metrics.json").write_text("[1]"),
        "seed-0/metrics.json is not a JSON object",
    ),
    "seed_row.json not JSON": (
        lambda d: (d / "study" / "seed-0" / "seed_row.json").write_bytes(b"\xff\xfe"),
        "seed-0/seed_row.json cannot be read as JSON",
    ),
    "seed_row.json with a text": (
        lambda d: (d / "study" / "seed-0" / "seed_row.json").write_text('{"probe/x": "high"}'),
        "seed-0/seed_row.json is damaged: 'probe/x' is not a number",
    ),
}


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_a_seed_study_refuses_a_folder_it_cannot_trust(finished_seeds, tmp_path, case):
    shutil.copytree(finished_seeds, tmp_path / "from")
    study = tmp_path / "study"
    study.mkdir()
    spoil, needle = SEED_CASES[case]
    if case != "seed 1's run in seed 0's folder":
        shutil.copytree(tmp_path / "from" / "seed-0", study / "seed-0")
    spoil(tmp_path)
    before = snapshot(tmp_path)
    args = ["seeds", "run", "--seeds", "0", "-c", "tiny", "--set", "steps=2", "--out", str(study)]
    r = CliRunner().invoke(app, args)
    one_line_error(r, needle)
    assert snapshot(tmp_path) == before

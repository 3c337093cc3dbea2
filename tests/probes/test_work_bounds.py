"""Work priced before it starts: a run past the machine's budget is refused in one line naming
the options that size it (``fbt_probe.runtime.budget``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from tasks.generate import generate_dataset
from tests.refusals import EVAL, files_under, one_line_error, snapshot


def test_seeds_and_a_huge_dataset_are_refused_before_the_work(tmp_path, model_dir):
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--seed", "-1", "--out", str(out)]
    )
    one_line_error(r, "--seed must be >= 0")
    r = CliRunner().invoke(
        app, ["generate", "--task", "multi_register", "--n-groups", "100000000", "--out", str(out)]
    )
    one_line_error(r, "--n-groups 100000000 would need about", "GiB")
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--seed", "-2", "--out", str(tmp_path / "r")]
    )
    one_line_error(r, "--seed must be at least 0, got -2")
    assert files_under(tmp_path) == [
        Path("m"),
        *sorted(Path("m") / p.name for p in model_dir.iterdir()),
    ]


def test_a_patch_sweep_past_the_budget_is_refused_in_one_line_before_it_runs(tmp_path, monkeypatch):
    import fbt_probe.runtime.budget as budget

    # an hour's budget on any machine: the default sweep (about two minutes of 2 cores) runs,
    # a thousand passes re-run for every patch (a day or more) is refused by name
    monkeypatch.setattr(budget, "LIMIT_SECONDS", 3600.0)
    out = tmp_path / "p"
    r = CliRunner().invoke(app, ["patch", "--prefill", "k1000", "--pass", "1", "--out", str(out)])
    one_line_error(r, "--prefill k1000 --pass 1: 142 patches of 1000 passes each", "ask for less")
    assert not out.exists()
    from fbt_probe.loading import resolve_model

    m, _ = resolve_model("default")
    wide = budget.seconds(m, 142 * 70016 * 1000)
    assert budget.seconds(m, 142 * 70016 * 1) < 3600 < wide


BOUNDED = {  # every verb that runs a model over data: its prefill option's spelling
    "fit": ["fit", "--prefill", "k1000", "--no-controls"],
    "lens": ["lens", "--prefill", "k16", "--no-tuned"],  # these three read at most 16 passes
    "trajectory": ["trajectory", "--prefill", "k16"],
    "heads": ["heads", "--prefill", "k16"],
    "stability": ["stability", "--prefill", "k1000", "--decode-tokens", "0"],
    "intervene": ["intervene", "--prefill", "k1000", "-i", "interchange_state"],
    "patch": ["patch", "--prefill", "k1000"],
    "attribute": ["attribute", "--prefill", "k1000"],
}


@pytest.mark.parametrize("verb", list(BOUNDED))
def test_every_verb_prices_its_work_before_it_starts(tmp_path, monkeypatch, verb):
    """One estimate (fbt_probe.runtime.budget) for every verb: with a limit of a millisecond, many
    passes are refused in one line naming --prefill, before any progress line and
    with nothing written (the data they would read generated beforehand)."""
    import fbt_probe.runtime.budget as budget

    data = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=6,
        distractors=(1, 4),
        seed=2,
        twins=True,
    )
    monkeypatch.setattr(budget, "LIMIT_SECONDS", 1e-3)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    args = [*BOUNDED[verb], "--out", str(tmp_path / "out")]
    if verb != "stability":
        args += ["--data", str(data)]
    r = CliRunner().invoke(app, args)
    one_line_error(r, "--prefill", "would take about", "ask for less")
    assert snapshot(tmp_path) == before


def test_eval_prices_its_work_before_it_starts(monkeypatch, model_dir):
    import fbt_probe.runtime.budget as budget

    monkeypatch.setattr(budget, "LIMIT_SECONDS", 1e-3)
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "--n-groups, --modes", "would take about", "ask for less")

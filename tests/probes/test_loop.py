"""fbt-probe loop: closed-loop swaps while generating, on the shipped generation model,
checked against what must hold whatever the model learned."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from probes import run_loop
from probes.loop.run import COLUMNS
from tasks.generate import generate_dataset


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    data = generate_dataset(
        "count_steps", tmp / "cs.parquet", n_groups=8, distractors=(1, 16), seed=4, twins=True
    )
    out = tmp / "results" / "loop"
    res = run_loop("generation", task="count_steps", data=data, modes="standard,fused", out=out)
    return res, out


def test_the_table_and_its_invariants(loop_run):
    res, out = loop_run
    df = pd.read_csv(out / "loop.csv")
    assert list(df.columns) == COLUMNS
    assert set(df["mode"]) == {"standard", "fused"} and set(df.kind) == {
        "none",
        "state",
        "token",
        "both",
    }
    std = df[(df["mode"] == "standard") & (df.kind == "state")]
    # standard decoding feeds no state back: swapping it changes nothing at all
    assert (std[std.metric == "diverged"].value == 0).all()
    assert (std[std.metric == "follows_example"].dropna(subset=["value"]).value == 1).all()
    ld = std[std.metric == "logit_diff"].value.dropna()
    assert len(ld) > 0 and np.allclose(ld, 1.0)
    for (_mode, _kind, _s), g in df[df.metric.str.startswith("follows_")].groupby(
        ["mode", "kind", "step"]
    ):
        if g.value.notna().all():
            assert abs(g.value.sum() - 1) < 1e-9  # example, twin or neither
    curve = df[(df.metric == "diverged_by")].sort_values("later_step")
    for _, g in curve.groupby(["mode", "kind", "step"]):
        assert (np.diff(g.value.to_numpy()) >= -1e-12).all()  # a divergence curve only rises
    assert (out / "figures" / "loop_count_steps.png").is_file()
    assert any("following the twin" in line for line in res.lines)


def test_the_command_refuses_an_unknown_kind(tmp_path):
    r = CliRunner().invoke(app, ["loop", "--kinds", "state,gate", "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "--kinds 'state,gate': unknown kind 'gate'" in r.output
    assert not (tmp_path / "o").exists()


def test_plot_on_the_analysis_own_folder_names_the_folder_above(loop_run):
    _, out = loop_run
    r = CliRunner().invoke(app, ["plot", "--results", str(out)])
    assert r.exit_code == 1
    assert f"it is loop's own folder: pass the folder above it, {out.parent}" in r.stderr
    r = CliRunner().invoke(app, ["plot", "--results", str(out.parent)])
    assert r.exit_code == 0 and "drew 1 figure panel of loop" in r.output  # count_steps only

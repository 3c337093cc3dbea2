"""Plots and the report, drawn from a small hand-made results table."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from probes.plot import plot_all
from probes.report import write_report
from probes.results import layer0_table
from probes.run import COLUMNS


@pytest.fixture
def results(tmp_path):
    rows = []
    rng = np.random.default_rng(0)
    tasks = {"delayed_memory": ["label"], "multi_register": ["RA", "RB"]}
    for task, targets in tasks.items():
        for target, model, prefill, depth in itertools.product(
            targets,
            ["trained", "random_init", "permuted"],
            ["standard", "recurrent", "full"],
            range(3),
        ):
            counts = ["1-256"] + (["1", "16", "256"] if model == "trained" else [])
            for c in counts:
                acc = round(float(rng.uniform(0.5, 1.0)), 4)
                rows.append({"task": task, "target": target, "model": model, "prefill": prefill, "depth": depth,
                             "distractors": c, "overwrites": "all", "accuracy": acc, "ci_low": acc - 0.05,
                             "ci_high": min(1.0, acc + 0.05), "chance": 0.5 if task != "multi_register" else 0.25,
                             "majority": 0.5, "n_examples": 100, "n_groups": 20, "C": 1.0})  # fmt: skip
            if task == "multi_register" and model == "trained":
                for k in range(3):
                    acc = round(float(rng.uniform(0.3, 1.0)), 4)
                    rows.append({"task": task, "target": target, "model": model, "prefill": prefill, "depth": depth,
                                 "distractors": "1-256", "overwrites": str(k), "accuracy": acc, "ci_low": acc,
                                 "ci_high": acc, "chance": 0.25, "majority": 0.3, "n_examples": 30, "n_groups": 10, "C": 1.0})  # fmt: skip
    df = pd.DataFrame(rows).assign(probe="logistic", site="resid")[COLUMNS]
    res = tmp_path / "res"
    res.mkdir()
    df.to_csv(res / "probe_results.csv", index=False)
    return res, df


def test_heatmaps_show_the_tables_numbers(results):
    res, df = results
    drawn = plot_all(res)
    figs = res / "figures"
    for stem in ["heatmap_delayed_memory_prefill_by_depth", "heatmap_multi_register_prefill_by_depth",
                 "heatmap_delayed_memory_depth_by_count", "heatmap_multi_register_overwrites", "lines_delayed_memory"]:  # fmt: skip
        for ext in ("png", "pdf"):
            assert (figs / f"{stem}.{ext}").stat().st_size > 1000
    mat = drawn["prefill_by_depth"]["delayed_memory/label"]
    assert list(mat.index) == ["standard", "recurrent", "full"]
    for p in mat.index:
        for d in mat.columns:
            want = df[
                (df.task == "delayed_memory")
                & (df.model == "trained")
                & (df.prefill == p)
                & (df.depth == d)
                & (df.distractors == "1-256")
            ].accuracy.item()
            assert mat.loc[p, d] == pytest.approx(want)
    m2 = drawn["depth_by_count"]["delayed_memory/label/recurrent"]
    assert m2.loc[2, 16] == pytest.approx(
        df[
            (df.task == "delayed_memory")
            & (df.prefill == "recurrent")
            & (df.depth == 2)
            & (df.distractors == "16")
        ].accuracy.item()
    )
    ow = drawn["overwrites"]["multi_register/full"]
    sel = df[
        (df.task == "multi_register")
        & (df.prefill == "full")
        & (df.depth == 1)
        & (df.overwrites == "2")
    ]
    assert ow.loc[1, 2] == pytest.approx(sel.accuracy.mean())
    line = drawn["lines"]["delayed_memory/label/recurrent/random_init"]
    sel = df[
        (df.task == "delayed_memory")
        & (df.prefill == "recurrent")
        & (df.model == "random_init")
        & (df.distractors == "1-256")
    ].sort_values("depth")
    np.testing.assert_allclose(line.accuracy, sel.accuracy)


def test_report_has_table_and_figures(results):
    res, df = results
    plot_all(res)
    text = write_report(res).read_text()
    t0 = layer0_table(df)
    r = t0[(t0.task == "delayed_memory") & (t0.prefill == "recurrent")].iloc[0]
    assert f"{100 * r.accuracy:.1f} %" in text and "100 %" in text  # ours beside the paper's
    assert (
        "![heatmap_delayed_memory_prefill_by_depth](figures/heatmap_delayed_memory_prefill_by_depth.png)"
        in text
    )


def test_plot_cli_errors_without_results(tmp_path):
    r = CliRunner().invoke(app, ["plot", "--results", str(tmp_path)])
    assert r.exit_code == 1 and "fbt-probe fit" in r.stderr

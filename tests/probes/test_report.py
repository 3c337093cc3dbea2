"""Plots and the report, drawn from a small hand-made results table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from probes.common.probe_results import layer0_table
from probes.fit.plot import plot_all
from probes.report.markdown import write_report


def test_heatmaps_show_the_tables_numbers(results):
    res, df = results
    drawn = plot_all(res)
    figs = res / "figures"
    for stem in [
        "heatmap_delayed_memory_prefill_by_depth",
        "heatmap_multi_register_prefill_by_depth",
        "heatmap_delayed_memory_depth_by_count",
        "heatmap_multi_register_overwrites",
        "lines_delayed_memory",
    ]:
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


def _interventions(flip_state: float, flip_token: float, clean_acc: float = 1.0) -> pd.DataFrame:
    """A hand-made interventions table: delayed_memory under recurrent prefill, 3 depths."""
    from fbt_probe.kernels.patching import STATE_HOOK
    from probes.common.metrics import COLUMNS as IV_COLUMNS
    from probes.common.twins import WINDOWS
    from probes.intervene.registry import ALPHAS, TOKEN_SITE

    rng = np.random.default_rng(1)
    rows = []

    def add(intervention, site, positions, alpha, values):
        for metric, v in zip(("accuracy", "flip_rate", "logit_diff"), values, strict=True):
            rows.append(
                {
                    "task": "delayed_memory",
                    "prefill": "recurrent",
                    "intervention": intervention,
                    "site": site,
                    "positions": positions,
                    "alpha": alpha,
                    "metric": metric,
                    "value": v,
                    "ci_low": v - 0.01,
                    "ci_high": v + 0.01,
                    "n": 100,
                }
            )

    nan = float("nan")
    add("self", STATE_HOOK, "all", nan, (clean_acc, 0.0, 1.0))
    for w in WINDOWS:
        f = flip_state if w == "all" else round(float(rng.uniform(0, 1)), 3)
        add("interchange_state", STATE_HOOK, w, nan, (1 - f, f, 1 - f))
    add("interchange_token", TOKEN_SITE, "label_token", nan, (1 - flip_token, flip_token, 0.5))
    sites = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    for site in sites:
        for name in ("erase_probe", "erase_random"):
            a = round(float(rng.uniform(0, 1)), 3)
            add(name, site, "colon", nan, (a, 1 - a, a))
        for name in ("steer_probe", "steer_random"):
            for alpha in ALPHAS:
                a = round(float(rng.uniform(0, 1)), 3)
                add(name, site, "colon", alpha, (a, 1 - a, a))
    return pd.DataFrame(rows, columns=IV_COLUMNS)


def test_intervention_figures_show_the_table(tmp_path):
    from probes.intervene.plot import plot_interventions

    iv = _interventions(0.9, 0.1)
    drawn = plot_interventions(iv, tmp_path / "figs")
    flips = iv[(iv.intervention == "interchange_state") & (iv.metric == "flip_rate")]
    mat = drawn["interchange_delayed_memory"]
    for w, v in zip(flips.positions, flips.value, strict=True):
        assert mat.loc[w, "recurrent"] == v
    depth = drawn["depth_delayed_memory_recurrent"]
    er = iv[(iv.intervention == "erase_probe") & (iv.metric == "accuracy")]
    # depth order: block inputs, then the last block's output
    assert list(depth["erase_probe"]) == list(er.value)
    steer = drawn["steering_delayed_memory_recurrent"]
    s1 = iv[
        (iv.intervention == "steer_probe")
        & (iv.site == "blocks.1.hook_resid_pre")
        & (iv.metric == "flip_rate")
    ]
    assert list(steer[("steer_probe", 1)]) == list(s1.value)
    for stem in ("interchange_delayed_memory", "depth_delayed_memory", "steering_delayed_memory"):
        assert (tmp_path / "figs" / f"{stem}.png").stat().st_size > 0
        assert (tmp_path / "figs" / f"{stem}.pdf").stat().st_size > 0


@pytest.mark.parametrize(
    "state,token,clean,words",
    [
        (0.9, 0.1, 1.0, "follows the state"),
        (0.05, 0.95, 1.0, "follows the token"),
        (0.1, 0.1, 1.0, "both, redundantly"),
        (0.1, 0.1, 0.3, "say nothing"),
    ],
)
def test_the_headline_reads_the_two_interchanges(state, token, clean, words):
    from probes.intervene.report import headline

    line = headline(_interventions(state, token, clean), "delayed_memory", "recurrent")
    assert words in line and f"{state:.3f}" in line


@pytest.mark.parametrize("clean,words", [(0.549, "say nothing"), (0.95, "follows the state")])
def test_a_battery_without_self_rows_is_read_against_the_clean_accuracy_it_measured(clean, words):
    # `intervene -i interchange_state,interchange_token` runs no `self` rows; the clean run's
    # accuracy then comes from the run's info, and a model that does not do the task gets
    # no verdict on which route it uses
    from probes.intervene.report import headline

    iv = _interventions(0.9, 0.1)
    iv = iv[iv.intervention != "self"]
    assert words in headline(iv, "delayed_memory", "recurrent", clean)
    assert "follows the state" in headline(iv, "delayed_memory", "recurrent")


def test_report_puts_probe_and_erasure_side_by_side(results):
    res, df = results
    iv = _interventions(0.9, 0.1)
    (res / "interventions").mkdir()
    iv.to_csv(res / "interventions" / "interventions.csv", index=False)
    text = write_report(res).read_text()
    assert "## Decodable vs used" in text and "follows the state" in text
    probe0 = df[
        (df.task == "delayed_memory")
        & (df.prefill == "recurrent")
        & (df.depth == 0)
        & (df.model == "trained")
        & (df.distractors == "1-256")
    ].accuracy.iloc[0]
    er0 = iv[
        (iv.intervention == "erase_probe")
        & (iv.site == "blocks.0.hook_resid_pre")
        & (iv.metric == "accuracy")
    ].value.iloc[0]
    row = next(
        ln for ln in text.splitlines() if ln.startswith("| delayed_memory | recurrent | 0 |")
    )
    assert f"{100 * probe0:.1f} %" in row and f"{100 * er0:.1f} %" in row

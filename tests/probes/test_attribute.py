"""fbt-probe attribute: the command on the default model and a tiny Hugging Face model, its
exact check equal to ``fbt-probe patch`` on the same sites, its tables, figures and report
section, and one line for bad input before any work."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from tasks.generate import generate_dataset


@pytest.fixture(scope="module")
def dm(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "dm.parquet"
    return generate_dataset(
        "delayed_memory", path, n_groups=6, distractors=(1, 5), seed=3, twins=True
    )


@pytest.fixture(scope="module")
def attributed(dm, tmp_path_factory):
    out = tmp_path_factory.mktemp("a") / "attr"
    r = CliRunner().invoke(
        app, ["attribute", "--data", str(dm), "--out", str(out), "--check", "all"]
    )
    assert r.exit_code == 0, r.output
    return out, r.output


def test_attribute_writes_patch_columns_edges_agreement_and_figures(attributed):
    out, output = attributed
    df = pd.read_csv(out / "attribution.csv")
    patch_cols = [
        "task",
        "prefill",
        "pass",
        "intervention",
        "site",
        "positions",
        "alpha",
        "metric",
        "value",
        "ci_low",
        "ci_high",
        "n",
    ]
    assert list(df.columns[: len(patch_cols)]) == patch_cols
    assert {"linear", "exact", "exact_ci_low", "exact_ci_high"} <= set(df.columns)
    assert set(df.intervention) == {"patch_resid", "patch_head", "patch_state", "patch_path"}
    assert set(df["pass"]) == {1, 2} and df.exact.notna().all()  # --check all
    assert ((df.ci_low <= df.value + 1e-9) & (df.value <= df.ci_high + 1e-9)).all()
    edges = pd.read_csv(out / "edges.csv")
    fb = edges[edges.feedback]
    assert len(fb) == 1 and fb.iloc[0]["pass"] == 2 and fb.iloc[0].target == "input"
    meta = json.loads((out / "attribution.json").read_text())
    ag = meta["agreement"]["resid_head"]
    assert ag["checked"] == int(df.intervention.isin(["patch_resid", "patch_head"]).sum())
    assert -1 <= ag["rank_correlation"] <= 1 and 0 <= ag["top_k_recall"] <= 1
    assert len(ag["misses"]) == 3
    for kind in ("resid", "head", "path", "check", "edges"):
        assert (out / "figures" / f"attribution_{kind}_delayed_memory.png").stat().st_size > 0
    assert "exact check of" in output and "rank correlation" in output


def test_the_exact_check_is_fbt_probe_patch_on_the_same_sites(attributed, dm, tmp_path):
    out, _ = attributed
    for pass_number in (1, 2):
        r = CliRunner().invoke(
            app,
            [
                "patch",
                "--data",
                str(dm),
                "--out",
                str(tmp_path / f"p{pass_number}"),
                "--depths",
                "all",
                "--pass",
                str(pass_number),
            ],
        )
        assert r.exit_code == 0, r.output
        p = pd.read_csv(tmp_path / f"p{pass_number}" / "patch.csv")
        p = p[p.metric == "logit_diff"]
        a = pd.read_csv(out / "attribution.csv")
        a = a[a["pass"] == pass_number]
        m = a.merge(p, on=["intervention", "site", "positions"], suffixes=("", "_patch"))
        if pass_number == 1:  # no fed-back state enters pass 1: its path patches do nothing
            paths = p[p.intervention == "patch_path"]
            np.testing.assert_allclose(paths.value, 1, atol=1e-5)
            p = p[p.intervention != "patch_path"]
        assert len(m) == len(p)  # every other site patch covers is scored
        np.testing.assert_allclose(m.exact, m.value_patch, atol=1e-5)
    # the estimates rank the sites as the exact patches do, on the whole
    assert (
        json.loads((out / "attribution.json").read_text())["agreement"]["all"]["rank_correlation"]
        > 0.7
    )


def test_attribute_on_a_hugging_face_model_with_edges(tiny_llama, tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset(
        "delayed_memory",
        data,
        n_groups=4,
        distractors=(1, 3),
        seed=2,
        twins=True,
        tokenizer=tiny_llama,
    )
    for prefill in ("recurrent", "full"):
        out = tmp_path / prefill
        r = CliRunner().invoke(
            app,
            [
                "attribute",
                "--model",
                str(tiny_llama),
                "--data",
                str(data),
                "--out",
                str(out),
                "--prefill",
                prefill,
                "--check",
                "6",
            ],
        )
        assert r.exit_code == 0, r.output
        df = pd.read_csv(out / "attribution.csv")
        assert df.exact.notna().sum() == 6
        edges = pd.read_csv(out / "edges.csv")
        assert edges.feedback.any()
    # the library call, with its progress reported batch by batch, then patched run by run
    from probes import run_attribute

    seen = []
    result = run_attribute(
        str(tiny_llama),
        data=data,
        out=tmp_path / "lib",
        check="2",
        progress=lambda i, n, what: seen.append((i, n, what)),
    )
    assert set(result.tables) == {"attribution", "edges"}
    sweep = [s for s in seen if s[2].endswith("attribution")]
    exact = [s for s in seen if "exact check of 2 sites" in s[2]]
    assert sweep[-1][0] == sweep[-1][1] and seen.index(sweep[-1]) < seen.index(exact[0])
    assert [s[0] for s in exact] == list(range(1, exact[0][1] + 1))
    assert exact[0][1] == 2 * sweep[-1][1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kinds", "heads"], "error: --kinds 'heads': choose from resid, head, state, path"),
        (["--kinds", "resid,resid"], "error: --kinds 'resid,resid': resid is named twice"),
        (["--check", "some"], "error: --check 'some': give a number of sites"),
        (["--edges", "yes"], "error: --edges 'yes': choose on, off or auto"),
        (["--prefill", "k0"], "error: "),
        (["--task", "nope"], "error: "),
    ],
)
def test_attribute_refuses_bad_input_in_one_line_before_any_work(tmp_path, args, message):
    r = CliRunner().invoke(app, ["attribute", "--out", str(tmp_path / "a"), *args])
    assert r.exit_code != 0 and r.output.startswith(message), r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()


def test_agreement_counts_a_tie_with_the_kth_exact_effect_as_a_hit():
    from probes.attribute.check import agreement

    # 12 sites: the first 8 patch the same thing (exact 0.0, a tie), the rest barely matter;
    # the estimate ranks sites 4..7 and 8..9 at its top. Of its top 6 (k = n // 2), the four
    # tied ones are hits whichever four of the tie an exact top 6 would list
    exact = [0.0] * 8 + [0.99, 0.98, 0.97, 0.96]
    value = [0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.9, 0.95]
    df = pd.DataFrame(
        {
            "pass": 2,
            "intervention": "patch_resid",
            "site": [f"s{i}" for i in range(12)],
            "positions": "all",
            "value": value,
            "exact": exact,
        }
    )
    ag = agreement(df)["resid_head"]
    assert ag["top_k"] == 6 and ag["top_k_recall"] == pytest.approx(4 / 6)
    assert ag["misses"][0]["site"] == "s8" and ag["hidden"] == 0  # effect 0.8 estimated, 0.01

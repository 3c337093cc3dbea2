"""report.html and the view page: what they hold, checked against the numbers behind them.

(tests/probes/test_browser.py opens both in a real browser.)
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from probes.common.html import colour, markdown_html
from probes.fit.plot import plot_all
from probes.report.markdown import write_report
from tasks import vocab


def page_data(path) -> dict:
    text = path.read_text()
    m = re.search(r'<script id="fbt-data" type="application/json">(.*?)</script>', text, re.S)
    return json.loads(m.group(1))


def test_markdown_becomes_html_with_sortable_tables_and_escaped_text():
    md = "# Title <x>\n\nSome **bold** and `a<b`.\n\n| a | b |\n|---|---|\n| 1 | y |\n\n- one\n- two\n\n![alt](fig.png)\n"
    got = markdown_html(md, lambda alt, path: f"<img data-p='{path}'>")
    assert "<h1>Title &lt;x&gt;</h1>" in got
    assert "<strong>bold</strong>" in got and "<code>a&lt;b</code>" in got
    assert (
        '<table class="sortable"><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>y</td></tr>'
        in got
    )
    assert "<ul><li>one</li><li>two</li></ul>" in got and "<img data-p='fig.png'>" in got


def test_colours_run_from_dark_to_light_and_text_stays_readable():
    assert colour(0.5, 0.5, 1.0) == ("#00204d", "#fff")  # chance: the darkest
    assert colour(1.0, 0.5, 1.0) == ("#ffea46", "#000")
    assert colour(float("nan")) == ("#00204d", "#fff")


def test_report_html_is_offline_and_its_heatmaps_hold_the_tables_numbers(results):  # noqa: F811
    res, df = results
    plot_all(res)
    write_report(res)
    page = (res / "report.html").read_text()
    # offline: nothing is fetched, every figure is inside the page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    imgs = re.findall(r'<img alt="([^"]*)" src="([^"]*)"', page)
    assert imgs and all(src.startswith("data:image/png;base64,") for _, src in imgs)
    assert {a for a, _ in imgs} == {"lines_delayed_memory", "lines_multi_register"}
    # every probe heatmap is interactive; each cell's tooltip carries the row's numbers
    figs = re.findall(r'data-figure="([^"]+)"', page)
    assert sorted(figs) == sorted(p.stem for p in (res / "figures").glob("heatmap_*.png"))
    cells = re.findall(r'data-value="([0-9.]+)" data-tip="([^"]+)"', page)
    pooled = df[(df.model == "trained") & (df.distractors == "1-256") & (df.overwrites == "all")]
    by_count = df[(df.model == "trained") & (df.distractors != "1-256") & (df.prefill != "full")]
    over = df[(df.model == "trained") & (df.overwrites != "all") & (df.prefill != "standard")]
    n_over = len(over.groupby(["prefill", "depth", "overwrites"]))
    assert len(cells) == len(pooled) + len(by_count[by_count.target.isin(["label", "RA"])]) + n_over
    r = pooled[
        (pooled.task == "delayed_memory") & (pooled.prefill == "recurrent") & (pooled.depth == 1)
    ].iloc[0]
    tip = f"delayed_memory label, recurrent prefill, depth 1\naccuracy {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (95 % CI)\nn = 100 examples in 20 groups"
    hit = [v for v, t in cells if t.startswith(tip)]
    assert len(hit) == 1 and float(hit[0]) == pytest.approx(r.accuracy, abs=1e-4)
    # the tables of report.md, sortable
    n_tables = sum(
        1 for line in (res / "report.md").read_text().splitlines() if line.startswith("|---")
    )
    assert page.count('<table class="sortable">') == n_tables


def test_view_page_shows_what_the_probes_lens_and_attention_say(fitted):
    from probes.common.artifacts import find, load_probes
    from probes.common.extract import extract_features
    from probes.report.view import view
    from tasks.dataset import load

    model, tmp, data = fitted
    out, lines = view(
        data=data, probes=tmp / "fit", examples="2,5", prefill="k3", out=tmp / "v.html"
    )
    doc = page_data(out)
    ds = load(data)
    assert [e["row"] for e in doc["examples"]] == [2, 5] and "probes from" in doc["probe_note"]
    probes = load_probes(tmp / "fit")
    for prefill, k in (("standard", 0), ("recurrent", 1)):
        X = extract_features(model, ds, prefill)  # (n, depths, d) at the colon
        for d in range(X.shape[1]):
            want = find(probes, prefill=prefill, depth=d).predict(X[[2, 5], d])
            got = [e["probe"][k]["targets"]["label"][d][e["colon"]] for e in doc["examples"]]
            assert got == [str(w) for w in want]
    ex = doc["examples"][0]
    ids = torch.tensor(ds.token_ids[2][None, : ex["colon"] + 1])
    out3 = model(ids, passes=3)
    for k in range(3):
        # the lens at the top depth is the pass's own output
        top = ex["lens"][k][-1]["cells"]
        argmax = out3.passes[k].logits[0].argmax(-1).tolist()
        assert [c[0] for c in top] == vocab.decode(argmax).split(" ")
        if k:  # fed_state at t in pass k+1 reads the state pass k left at t - 1
            fed = [c[0] for c in ex["lens"][k][0]["cells"]]
            assert (
                ex["lens"][k][0]["name"] == "fed_state"
                and fed[1:] == [c[0] for c in ex["lens"][k - 1][-1]["cells"]][:-1]
            )
    # attention: one character per weight; each query's row sums to 1 (to the rounding), and
    # the weights are the pattern hook's
    from probes.report.view import ALPHABET, LEVELS

    n = len(ex["tokens"])
    assert np.array(ex["attention"]).shape == (3, model.cfg.n_layers, model.n_heads)
    for tri in (t for layers in ex["attention"] for heads in layers for t in heads):
        w = np.array([ALPHABET.index(c) for c in tri]) / LEVELS
        assert len(w) == n * (n + 1) // 2
        sums = [w[q * (q + 1) // 2 : q * (q + 1) // 2 + q + 1].sum() for q in range(n)]
        assert np.allclose(sums, 1.0, atol=(n + 1) / (2 * LEVELS) + 1e-9)
    _, caches = model.run_with_pass_caches(ids, passes=3, names_filter="blocks.1.attn.hook_pattern")
    a = caches.of_pass(2)["blocks.1.attn.hook_pattern"][0, 2]  # pass 2, layer 1, head 2
    rows = torch.tril_indices(n, n)
    got = np.array([ALPHABET.index(c) for c in ex["attention"][1][1][2]]) / LEVELS
    np.testing.assert_allclose(got, a[rows[0], rows[1]].numpy(), atol=0.5 / LEVELS + 1e-6)
    assert "rows 2, 5" in lines[0]


def test_view_without_probes_says_how_to_get_them_and_refuses_bad_input(fitted, tmp_path):
    from probes.report.view import view

    _, tmp, data = fitted
    out, _ = view(
        data=data, probes=tmp_path, examples="0", prefill="standard", out=tmp_path / "v.html"
    )
    doc = page_data(out)
    assert "fbt-probe fit" in doc["probe_note"] and doc["examples"][0]["probe"][0]["targets"] == {}
    for kw, msg in (
        ({"examples": "x"}, "--examples"),
        ({"examples": "99999"}, "--examples"),
        ({"prefill": "k0"}, "--prefill"),
        ({"out": tmp_path / "v.txt"}, "--out"),
        ({"task": "nope"}, "--task"),
    ):
        args = {"data": data, "probes": tmp_path, "out": tmp_path / "w.html", **kw}
        with pytest.raises(ValueError, match=msg):
            view(**args)
    assert not (tmp_path / "w.html").exists()


def test_report_command_writes_both_pages(results):  # noqa: F811
    from typer.testing import CliRunner

    from cli import app

    res, _ = results
    got = CliRunner().invoke(app, ["report", "--results", str(res)])
    assert got.exit_code == 0, got.output
    assert (res / "report.md").is_file() and (res / "report.html").stat().st_size > 1000
    assert pd.read_csv(res / "probe_results.csv").shape[0] > 0


def test_the_interventions_lens_and_trajectory_heatmaps_carry_their_rows_numbers():
    from fbt_probe.kernels.patching import STATE_HOOK
    from probes.intervene.report import depth, interchange
    from probes.lens.report import lens
    from probes.trajectory.report import trajectory

    rng = np.random.default_rng(0)
    iv = []
    for prefill in ("recurrent", "full"):
        for w in ("label_next", "last4", "all"):
            v = float(rng.uniform())
            iv.append(
                dict(
                    task="dm",
                    prefill=prefill,
                    intervention="interchange_state",
                    site=STATE_HOOK,
                    positions=w,
                    alpha=np.nan,
                    metric="flip_rate",
                    value=v,
                    ci_low=v - 0.1,
                    ci_high=v + 0.1,
                    n=64,
                )
            )
        for d in range(3):
            site = f"blocks.{d}.hook_resid_pre"
            for name, alpha in (
                ("erase_probe", np.nan),
                ("erase_random", np.nan),
                ("steer_probe", 4.0),
            ):
                v = float(rng.uniform())
                iv.append(
                    dict(
                        task="dm",
                        prefill=prefill,
                        intervention=name,
                        site=site,
                        positions="colon",
                        alpha=alpha,
                        metric="accuracy",
                        value=v,
                        ci_low=v,
                        ci_high=v,
                        n=64,
                    )
                )
    iv = pd.DataFrame(iv)
    ld = pd.DataFrame(
        [
            dict(
                task="dm",
                lens="logit",
                read=r,
                distractors="1-256",
                metric=m,
                value=float(rng.uniform(0.001, 2)),
                ci_low=0.0,
                ci_high=3.0,
                n=32,
                **{"pass": k},
            )
            for k in (1, 2)
            for r in ("fed_state", "0", "1")
            for m in ("kl", "answer_prob")
            if not (k == 1 and r == "fed_state")
        ]
    )
    tr = pd.DataFrame(
        [
            dict(
                task="dm", metric="convergence", from_answer=o, value=10.0**-k, n=16, **{"pass": k}
            )
            for k in (1, 2, 3)
            for o in (-2, -1, 0)
        ]
    )
    html = "".join(interchange(iv, "dm"))
    assert html.count('class="cell"') == 6
    r = iv[
        (iv.prefill == "full")
        & (iv.positions == "last4")
        & (iv.intervention == "interchange_state")
    ].iloc[0]
    assert (
        f"dm, full, positions last4\nflip rate {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
        in html
    )
    html = "".join(depth(iv, "dm"))
    assert html.count('class="cell"') == 2 * 3 * 3 and "steer_probe α=+4" in html
    html = "".join(lens(ld, "dm"))
    assert html.count('class="cell"') == 2 * 5  # two metrics x (2 reads in pass 1 + 3 in pass 2)
    kl = ld[(ld.metric == "kl") & (ld.read == "1") & (ld["pass"] == 2)].value.item()
    assert f"pass 2, read depth 1\nKL to the final distribution {kl:.3f}" in html
    html = "".join(trajectory(tr, "dm"))
    assert html.count('class="cell"') == 2 * 3  # the last pass (0 by definition) left out
    assert (
        "pass 2, position -1 (0: where the answer is next)\ndistance to the last pass 0.01" in html
    )
    assert lens(ld, "other") == []


def test_view_reads_through_a_tuned_lens_and_refuses_one_of_another_model(fitted, tmp_path):
    from fbt_probe.checkpoint import model_hash
    from fbt_probe.kernels.lens import Translators
    from probes.report.view import view

    model, tmp, data = fitted
    n, d = len(model.depth_hooks()), model.cfg.d_model
    # the identity at every depth: its reads are the logit lens's
    eye = Translators(
        torch.eye(d).repeat(n, 1, 1), torch.zeros(n, d), {"model_hash": model_hash(model)}
    )
    eye.save(tmp_path / "lens" / "tuned_lens")
    out, lines = view(
        data=data, probes=tmp_path, examples="3", prefill="recurrent", out=tmp_path / "v.html"
    )
    assert "tuned lens from" in lines[0]
    rows = {r["name"]: [c[0] for c in r["cells"]] for r in page_data(out)["examples"][0]["lens"][1]}
    assert [k for k in rows if k.startswith("tuned")] == [f"tuned {i}" for i in range(n)]
    assert all(rows[f"tuned {i}"] == rows[f"depth {i}"] for i in range(n))
    other = Translators(torch.eye(d).repeat(n, 1, 1), torch.zeros(n, d), {"model_hash": "0" * 16})
    other.save(tmp_path / "other")
    with pytest.raises(ValueError, match="fitted on model"):
        view(data=data, tuned_lens=tmp_path / "other", out=tmp_path / "w.html")
    _, lines = view(
        data=data, probes=tmp, examples="3", prefill="standard", out=tmp_path / "w.html"
    )
    assert "no tuned lens" in lines[0]

"""fbt-probe steps: per-step probes and the logit lens while the model generates, on the
shipped generation model, checked against what must hold whatever the model learned."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.kernels.generation import step_residuals
from fbt_probe.loading import resolve_model
from probes import run_steps
from probes.report.markdown import write_report
from probes.steps.run import COLUMNS
from tasks import vocab
from tasks.generate import generate_dataset


@pytest.fixture(scope="module")
def gen_model():
    return resolve_model("generation")[0].eval()


@pytest.fixture(scope="module")
def steps_run(gen_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("steps")
    data = generate_dataset(
        "count_steps", tmp / "cs.parquet", n_groups=10, distractors=(1, 8, 64), seed=3
    )
    out = tmp / "results" / "steps"
    res = run_steps(
        gen_model, task="count_steps", data=data, modes="standard,fused", out=out, folds=5
    )
    return res, out, data


def test_the_table_and_its_invariants(steps_run):
    res, out, _ = steps_run
    df = pd.read_csv(out / "steps.csv", dtype={"depth": str, "distractors": str})
    assert list(df.columns) == COLUMNS and len(df) == len(res.tables["steps"])
    assert set(df["mode"]) == {"standard", "fused"}
    assert {"probe", "probe_permuted", "probe_random_init", "lens", "answer", "exact"} <= set(
        df.metric
    )
    last = str(len(resolve_model("generation")[0].depth_hooks()) - 1)
    for mode in ("standard", "fused"):
        g = df[df["mode"] == mode]
        lens = g[(g.metric == "lens") & (g.depth == last)].set_index("step").value
        answer = g[g.metric == "answer"].set_index("step").value
        # the last depth read through the head is the model's own output: its word
        np.testing.assert_allclose(lens.sort_index(), answer.sort_index(), atol=1e-12)
        probes = g[g.metric.str.startswith("probe")]
        assert probes.value.between(0, 1).all() and (probes.ci_low <= probes.value + 1e-9).all()
    # the last step's state (no STEP left) is the same for every example: nothing to probe
    assert df[(df.metric == "probe") & (df.step == 6)].empty
    assert (out / "figures" / "steps_count_steps.png").is_file()


def test_under_standard_decoding_depth_0_is_the_visible_token(gen_model, steps_run):
    """Standard decoding feeds nothing back: a generated step's depth-0 residual is the
    embedding of the token it reads, so two examples that read the same token there cannot be
    told apart, whatever their count."""
    _, _, data = steps_run
    from tasks.dataset import load

    ds = load(data)
    idx = np.flatnonzero(ds.n_distractors == 8)
    p = torch.tensor(np.stack([ds.token_ids[i][: int(ds.colon_index[i]) + 1] for i in idx]))
    d, res = step_residuals(gen_model, p, "standard", 7)
    x0 = res[gen_model.depth_hooks()[0]][:, 1:]  # steps 1.. read tokens 0..
    torch.testing.assert_close(x0, gen_model.embed(d.tokens[:, :-1]), atol=1e-6, rtol=0)
    _, fused = step_residuals(gen_model, p, "fused", 7)
    assert not torch.allclose(fused[gen_model.depth_hooks()[0]][:, 1:], x0)


def test_the_report_has_the_section(steps_run, tmp_path):
    _, out, _ = steps_run
    text = write_report(out.parent).read_text()
    assert "The task state while generating" in text and "**count_steps**" in text


def test_the_command_refuses_a_colon_task_and_a_bad_mode(tmp_path):
    r = CliRunner().invoke(app, ["steps", "--task", "delayed_memory", "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "its answer is read at the colon" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["steps", "--modes", "soft,greedy", "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "--modes 'soft,greedy'" in r.output
    assert not (tmp_path / "o").exists()


def test_the_oracle_words_are_in_the_vocabulary():
    assert {"STEP", "DONE", "NEED", "SET"} <= set(vocab.TOKENS[: vocab.BASE_SIZE])

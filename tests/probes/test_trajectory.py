"""fbt-probe trajectory: distances against the Jacobi property (pass k is exact below position
k), the gate against sigma(W_G e) computed here, the PCA against a known line, and the
command on the default model and a tiny Hugging Face model."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.kernels.trajectory import distance_to_last, pass_states, pca_2d
from fbt_probe.loading import resolve_model
from probes.trajectory.run import CLASSES, COLUMNS
from tasks.generate import generate_dataset


def _check_states(model):
    g = torch.Generator().manual_seed(0)
    T, K = 9, 9
    toks = torch.randint(4, model.cfg.d_vocab, (3, T), generator=g)
    ps = pass_states(model, toks, torch.tensor([T, T, 6]), passes=K)
    d = distance_to_last(ps.states)
    assert d.shape == (K, 3, T)
    assert torch.equal(d[-1], torch.zeros(3, T))
    for k in range(1, K + 1):  # Jacobi pass k is the exact recurrence below position k
        assert float(d[k - 1, :2, :k].abs().max()) < 1e-4
    assert float(d[0, :2, 1:].min()) > 0  # pass 1 has no feedback: it differs from there on
    assert torch.equal(d[:, 2, 6:], torch.zeros(K, T - 6))  # padding
    emb = model.embed(toks)
    expect = torch.sigmoid(emb @ model.fusion.W_G.T).mean(-1)
    torch.testing.assert_close(ps.gate, expect, atol=1e-5, rtol=1e-5)


def test_states_and_gate_on_the_default_model():
    _check_states(resolve_model("default")[0].eval())


def test_states_and_gate_on_a_hugging_face_model(tiny_llama):
    from fbt_probe.hf import load_hf

    _check_states(load_hf(tiny_llama))


def test_pca_finds_the_line_the_points_lie_on():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(200, generator=g)
    u = torch.tensor([3.0, 4.0, 0.0]) / 5
    x = t[:, None] * u * 10 + 0.01 * torch.randn(200, 3, generator=g) + 7
    xy, var = pca_2d(x)
    assert float(var[0]) > 0.999 and float(var.sum()) <= 1.0 + 1e-6
    r = np.corrcoef(xy[:, 0].numpy(), t.numpy())[0, 1]
    assert abs(r) > 0.9999


def test_trajectory_command_on_the_default_model(tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=8, distractors=(1, 6), seed=2, twins=True)
    out = tmp_path / "tr"
    r = CliRunner().invoke(app, ["trajectory", "--data", str(data), "--out", str(out), "-p", "k4"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "trajectory.csv")
    assert list(df.columns) == COLUMNS
    assert set(df.metric) == {"convergence", "accuracy", "flip_rate", "gate"}
    conv = df[df.metric == "convergence"]
    assert set(conv["pass"]) == {1, 2, 3, 4} and conv.from_answer.max() == 0
    assert (conv[conv["pass"] == 4].value == 0).all()
    flips = df[df.metric == "flip_rate"]
    assert set(flips["pass"]) == {2, 3, 4} and set(flips.distractors) == {"1-256", "1", "6"}
    assert set(df[df.metric == "gate"].token_class) == set(CLASSES)
    pca = pd.read_csv(out / "trajectory_pca.csv")
    assert len(pca) == 16 * 4 and set(pca.label) == {"ZERO", "ONE"}
    meta = json.loads((out / "trajectory.json").read_text())
    assert 0 < sum(meta["pca_variance"]["delayed_memory"]) <= 1
    assert (out / "figures" / "trajectory_delayed_memory.png").stat().st_size > 0
    assert "answer top-1 by pass" in r.output


def test_trajectory_command_on_a_hugging_face_model(tiny_llama, tmp_path):
    data = tmp_path / "dt.parquet"
    generate_dataset(
        "done_tracking", data, n_groups=6, distractors=(1, 3), seed=2, tokenizer=tiny_llama
    )
    out = tmp_path / "tr"
    r = CliRunner().invoke(
        app,
        [
            "trajectory",
            "--model",
            str(tiny_llama),
            "--data",
            str(data),
            "--out",
            str(out),
            "-p",
            "k3",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "trajectory.csv")
    assert set(df[df.metric == "convergence"]["pass"]) == {1, 2, 3}
    assert (out / "figures" / "trajectory_done_tracking.png").stat().st_size > 0


def test_trajectory_refuses_one_pass_in_one_line(tmp_path):
    r = CliRunner().invoke(app, ["trajectory", "-p", "standard", "--out", str(tmp_path / "t")])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "error: --prefill standard: this command reads recurrent to k64 (2..64 passes)"
    ]
    assert not (tmp_path / "t").exists()

"""Stability analysis on tiny models: a hand-built contraction converges, an expanding map does not."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.checkpoint import save_model
from fbt_probe.config import build_cfg
from fbt_probe.kernels.stability import HeldoutBatch, jacobi_trajectory, long_soft_decoding, verdict
from fbt_probe.stack import FBTModel


def batch(B=4, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 60, (B, T), generator=g)
    targets = torch.cat([tokens[:, 1:], torch.full((B, 1), -100)], 1)
    answer = torch.zeros(B, T, dtype=torch.bool)
    answer[:, -2] = True
    return HeldoutBatch(tokens, targets, answer, torch.ones(B, T, dtype=torch.bool))


def model_with_wu_scale(scale: float, seed: int = 0, fusion: str = "gated") -> FBTModel:
    m = FBTModel(build_cfg(n_ctx=1100, fusion=fusion), seed=seed).eval()
    with torch.no_grad():
        m.fusion.W_U.mul_(scale)
    return m


def test_contraction_by_hand_converges():
    # additive fusion RMSNorm(e + W_U h) with W_U scaled down: the state barely moves the input
    m = model_with_wu_scale(0.1, fusion="additive")
    rows = jacobi_trajectory(m, batch(), passes=12, lipschitz_at=(3, 10))
    assert verdict(rows) == "converging"
    assert rows[-1]["delta_mean"] < 1e-4 * rows[1]["delta_mean"]
    assert rows[2]["lipschitz"] < 0.5 and rows[9]["lipschitz"] < 0.5
    # and the extreme: W_U = 0 makes the map constant (Lipschitz 0, no change after pass 2)
    rows = jacobi_trajectory(model_with_wu_scale(0.0), batch(), passes=5, lipschitz_at=(3,))
    assert (
        verdict(rows) == "converging" and rows[2]["delta_mean"] == 0 and rows[2]["lipschitz"] == 0
    )


def test_expanding_map_is_reported_as_diverging():
    m = model_with_wu_scale(40.0, seed=1)
    rows = jacobi_trajectory(m, batch(), passes=12, lipschitz_at=(3, 10))
    assert verdict(rows) == "diverging"
    assert rows[2]["lipschitz"] > 1.0 and rows[9]["lipschitz"] > 1.0
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_jacobi_reaches_the_recurrence_exactly_at_pass_T():
    m = model_with_wu_scale(40.0, seed=1)
    rows = jacobi_trajectory(m, batch(T=8), passes=10, lipschitz_at=())
    assert rows[8]["delta_max"] < 1e-5  # pass 9 == pass 8: every position is exact by pass T


def test_long_soft_decoding_is_finite():
    m = FBTModel(build_cfg(n_ctx=1100), seed=0).eval()
    rows = long_soft_decoding(m, torch.tensor([[1, 3, 5, 40, 2]] * 2), n_tokens=300)
    assert len(rows) == 300 and all(r["finite"] for r in rows)
    assert all(0 < r["h_norm_mean"] < 100 for r in rows)
    with pytest.raises(ValueError, match="context"):
        long_soft_decoding(m, torch.tensor([[1, 2]]), n_tokens=2000)


def test_stability_cli(tmp_path):
    m = FBTModel(build_cfg(n_ctx=1100), seed=0).eval()
    save_model(m, tmp_path / "m")
    r = CliRunner().invoke(
        app,
        [
            "stability",
            "--model",
            str(tmp_path / "m"),
            "--prefill",
            "k6",
            "--task",
            "delayed_memory",
            "--out",
            str(tmp_path / "s"),
            "--decode-tokens",
            "50",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "s" / "stability.csv")
    assert {"pass", "delta_mean", "delta_max", "loss", "accuracy"} <= set(df.columns)
    assert df["pass"].tolist() == [1, 2, 3, 4, 5, 6]
    for f in ("stability.png", "stability.pdf", "soft_decoding.png", "soft_decoding.csv"):
        assert (tmp_path / "s" / f).is_file()
    bad = CliRunner().invoke(
        app, ["stability", "--model", str(tmp_path / "m"), "--prefill", "k1001"]
    )
    assert bad.exit_code == 1 and "1..1000" in bad.stderr


def test_lipschitz_of_a_known_linear_map(monkeypatch):
    # the pass maps states through a fixed matrix: the estimate is its largest singular value
    import fbt_probe.kernels.stability as st

    a = torch.tensor([[3.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    monkeypatch.setattr(st, "_feedback_step", lambda m, s, e, p: SimpleNamespace(states=s @ a.T))
    s = torch.randn(1, 3, 2, dtype=torch.float64)
    got = st.lipschitz_estimate(None, s, s, None, torch.ones(1, 3, dtype=torch.bool), iters=40)
    assert got == pytest.approx(float(torch.linalg.matrix_norm(a, ord=2)), rel=1e-6)


def test_lipschitz_is_finite_where_differences_and_autograd_disagree(monkeypatch):
    # differences see -x, autograd sees +x: v·JᵀJv is negative, and its square root was a
    # "math domain error" on a real model (SmolLM2 with a random fusion, pass 2)
    import fbt_probe.kernels.stability as st

    monkeypatch.setattr(
        st, "_feedback_step", lambda m, s, e, p: SimpleNamespace(states=s - 2 * s.detach())
    )
    s = torch.randn(1, 3, 2, dtype=torch.float64)
    got = st.lipschitz_estimate(None, s, s, None, torch.ones(1, 3, dtype=torch.bool))
    assert got == pytest.approx(1.0)


def test_passes_in_chunks_of_sequences_give_the_same_trajectory(monkeypatch):
    # the logits are held a chunk of sequences at a time: one sequence a chunk changes nothing
    import fbt_probe.kernels.stability as st

    m, b = model_with_wu_scale(1.0), batch(B=5, T=24)
    whole = jacobi_trajectory(m, b, passes=4, lipschitz_at=(3,))
    monkeypatch.setattr(st, "LOGITS_BYTES", 1)
    chunked = jacobi_trajectory(m, b, passes=4, lipschitz_at=(3,))
    for w, c in zip(whole, chunked, strict=True):
        assert w.keys() == c.keys()
        for key in w:
            assert c[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6, nan_ok=True), key

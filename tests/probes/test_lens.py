"""fbt-probe lens: the logit lens against the model's own output, the fed-back state against
the pass before, the ridge translators against a known affine map, the tuned-lens artifact,
and the command on the default model and a tiny Hugging Face model."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.kernels.lens import RidgeStats, Translators, lens_batch
from probes.lens.run import COLUMNS
from tasks.generate import generate_dataset


def _prompt_batch(model, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(4, model.cfg.d_vocab, (n, 14), generator=g)
    at = torch.randint(3, 14, (n,), generator=g)
    return toks, at


@torch.no_grad()
def _check_reads_against_the_model(model):
    toks, at = _prompt_batch(model)
    hooks = model.depth_hooks()
    out, caches = model.run_with_pass_caches(
        toks, passes=3, positions=at, names_filter=[*hooks, "fusion.hook_state"]
    )
    rows = torch.arange(len(at))
    for k in range(3):  # at depth L of every pass the logit lens is that pass's output
        torch.testing.assert_close(
            model.read_resid(caches.of_pass(k + 1)[hooks[-1]]),
            out.passes[k].logits_at(rows, at),
            atol=1e-4,
            rtol=1e-4,
        )
    # the head on the fed-back state at t is the pass before's output at t - 1
    fed = model.read_state(caches.of_pass(2)["fusion.hook_state"])
    torch.testing.assert_close(fed, out.passes[0].logits_at(rows, at - 1), atol=1e-4, rtol=1e-4)
    answer = toks[rows, at]
    r = lens_batch(model, toks, at, answer, passes=3)["logit"]
    assert r.reads[:2] == ["fed_state", "fed_value"] and len(r.reads) == 2 + len(hooks)
    np.testing.assert_allclose(r.kl[:, 2, -1], 0.0, atol=1e-5)  # the last pass's own output
    assert np.isnan(r.kl[:, 0, :2]).all() and not np.isnan(r.kl[:, 1:, :]).any()
    logp = out.logits[rows, at].float().log_softmax(-1)
    np.testing.assert_allclose(r.prob[:, 2, -1], logp[rows, answer].exp().numpy(), rtol=1e-4)
    expect_rank = (logp > logp[rows, answer][:, None]).sum(-1).numpy()
    assert (r.rank[:, 2, -1] == expect_rank).all()
    # pass 1's output scored against the last pass's: the KL computed the textbook way
    first = out.passes[0].logits_at(rows, at).float().log_softmax(-1)
    kl = (logp.exp() * (logp - first)).sum(-1).numpy()
    assert kl.min() > 1e-3  # the passes differ: the check can fail
    np.testing.assert_allclose(r.kl[:, 0, -1], kl, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r.prob[:, 0, -1], first[rows, answer].exp().numpy(), rtol=1e-4)


def test_the_logit_lens_at_the_last_depth_is_each_pass_output_on_the_default_model(default_model):
    _check_reads_against_the_model(default_model)


def test_the_logit_lens_at_the_last_depth_is_each_pass_output_on_a_hugging_face_model(tiny_llama):
    from fbt_probe.hf import load_hf

    _check_reads_against_the_model(load_hf(tiny_llama))


def test_ridge_translators_recover_an_affine_map_and_the_last_depth_is_the_identity():
    g = torch.Generator().manual_seed(0)
    d, n = 8, 400
    A, b = torch.randn(d, d, generator=g), torch.randn(d, generator=g)
    stats = RidgeStats(n_depths=3, d=d)
    for _ in range(4):  # in batches: the sums add up
        x = torch.randn(n, d, generator=g)
        stats.add(0, x, x @ A + b)
        stats.add(1, x, 2 * x)
    tr = stats.solve({"model_hash": "x"})
    assert stats.n == 4 * n
    torch.testing.assert_close(tr.A[0], A, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tr.b[0], b, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tr.A[1], 2 * torch.eye(d), atol=2e-2, rtol=2e-2)
    assert torch.equal(tr.A[2], torch.eye(d)) and torch.equal(tr.b[2], torch.zeros(d))


def test_a_tuned_lens_saves_reloads_and_predicts_the_same(default_model, tmp_path):
    from fbt_probe.checkpoint import model_hash

    n, d = len(default_model.depth_hooks()), default_model.cfg.d_model
    g = torch.Generator().manual_seed(1)
    mhash = model_hash(default_model)
    tr = Translators(
        torch.randn(n, d, d, generator=g),
        torch.randn(n, d, generator=g),
        {"model_hash": mhash, "passes": 3},
    )
    tr.save(tmp_path / "tl")
    back = Translators.load(tmp_path / "tl", default_model, mhash)
    x = torch.randn(5, d, generator=g)
    for depth in range(n):
        assert torch.equal(back.apply(depth, x), tr.apply(depth, x))
    assert back.meta["passes"] == 3
    with pytest.raises(ValueError, match="was fitted on model .* not on this one"):
        Translators.load(tmp_path / "tl", default_model, "0" * 16)
    with pytest.raises(FileNotFoundError, match="no tuned lens in"):
        Translators.load(tmp_path / "nowhere", default_model, mhash)
    A = tr.A.clone()
    A[0, 0, 0] = float("nan")
    Translators(A, tr.b, {"model_hash": mhash}).save(tmp_path / "nan")
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        Translators.load(tmp_path / "nan", default_model, mhash)
    # a saved lens and --no-tuned cannot both take effect: refused before any work
    r = CliRunner().invoke(
        app,
        [
            "lens",
            "--tuned-lens",
            str(tmp_path / "tl"),
            "--no-tuned",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert r.exit_code != 0 and r.output.strip().splitlines() == [
        "error: --tuned-lens reads a saved tuned lens, --no-tuned reads none: give one"
    ]
    assert not (tmp_path / "out").exists()


def test_lens_command_on_the_default_model(tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=16, distractors=(1, 6), seed=2)
    out = tmp_path / "lens"
    r = CliRunner().invoke(app, ["lens", "--data", str(data), "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "lens.csv")
    assert list(df.columns) == COLUMNS
    assert set(df.lens) == {"logit", "tuned"} and set(df["pass"]) == {1, 2, 3}
    assert set(df.distractors) == {"1-256", "1", "6"}
    meta = json.loads((out / "lens.json").read_text())
    assert meta["datasets"]["delayed_memory"]["n_measured"] == 16  # 8 of 16 groups, 2 counts
    assert meta["tuned_lens"]["fitted_on"]["delayed_memory"]["n_examples"] == 16
    last = df[(df.read == "4") & (df["pass"] == 3) & (df.metric == "kl")]
    assert (last.value.abs() < 1e-4).all()  # the last pass's own output, for both lenses
    assert (out / "figures" / "lens_delayed_memory.png").stat().st_size > 0
    assert (out / "tuned_lens" / "translators.safetensors").is_file()
    assert "tops the logit lens" in r.output
    from probes import Figure, get_analysis

    section = get_analysis("lens").report(tmp_path)
    assert section[0].startswith("## What each (pass, depth) predicts")
    assert any(str(p).startswith("- delayed_memory: the answer first tops") for p in section)
    figs = [p for p in section if isinstance(p, Figure)]
    assert [f.path for f in figs] == [tmp_path / "lens" / "figures" / "lens_delayed_memory.png"]
    assert figs[0].html and not figs[0].keep_png  # drawn from lens.csv in report.html
    # the saved lens is read back instead of fitted: every example is measured
    r = CliRunner().invoke(
        app,
        [
            "lens",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "again"),
            "--tuned-lens",
            str(out / "tuned_lens"),
        ],
    )
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "again" / "lens.json").read_text())
    assert meta["datasets"]["delayed_memory"]["n_measured"] == 32
    assert not (tmp_path / "again" / "tuned_lens").exists()


def test_lens_command_on_a_hugging_face_model(tiny_llama, tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset(
        "delayed_memory", data, n_groups=8, distractors=(1, 3), seed=2, tokenizer=tiny_llama
    )
    out = tmp_path / "lens"
    r = CliRunner().invoke(
        app,
        [
            "lens",
            "--model",
            str(tiny_llama),
            "--data",
            str(data),
            "--out",
            str(out),
            "--prefill",
            "recurrent",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "lens.csv")
    assert set(df["pass"]) == {1, 2} and {"fed_state", "fed_value"} <= set(df.read)
    assert (out / "figures" / "lens_delayed_memory.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prefill", "k0"], "error: --prefill: unknown prefill 'k0'"),
        (["--prefill", "full"], "error: --prefill full: this command reads Jacobi passes"),
        (["-k", "2"], "error: -k is gone: use --prefill k2"),
        (["--tuned-lens", "nowhere"], "error: no tuned lens in nowhere"),
        (["--position", "colon+1"], "error: invalid position 'colon+1'"),
    ],
)
def test_lens_refuses_bad_input_in_one_line(tmp_path, args, message):
    r = CliRunner().invoke(
        app, ["lens", "--task", "delayed_memory", "--out", str(tmp_path / "l"), *args]
    )
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[0].startswith(message)
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "l" / "lens.csv").exists()


@pytest.mark.parametrize(
    "task,offset", [("delayed_memory", 0), ("done_tracking", 0), ("multi_register", 1)]
)
def test_the_lens_reads_where_the_answer_is_next(default_model, tmp_path, task, offset):
    from probes.lens.run import answer_positions
    from tasks import vocab
    from tasks.dataset import load

    ds = load(generate_dataset(task, tmp_path / "d.parquet", n_groups=4, distractors=(2,), seed=1))
    at, answer = answer_positions(ds, default_model, "answer")
    assert (at == ds.colon_index + offset).all()
    for i in range(len(ds)):
        assert ds.token_ids[i][at[i] + 1] == answer[i] == vocab.encode([ds.labels[i][0]])[0]
    at, _ = answer_positions(ds, default_model, "colon-1")
    assert (at == ds.colon_index - 1).all()

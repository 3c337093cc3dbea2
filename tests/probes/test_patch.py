"""fbt-probe patch: the whole residual at depth 0 gives the twin's answer, every head's patch
together is the attention output's, a path patch without feedback changes nothing, and the
command on the default model and a tiny Hugging Face model."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import parse_prefill
from probes.common.metrics import CLEAN, TWIN, Record, summarise
from probes.common.twins import answer_logits, batches, pairs_of
from probes.patch.run import head_hook, patch_batch, twin_acts
from tasks.dataset import load
from tasks.generate import generate_dataset


@pytest.fixture(scope="module")
def dm(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "dm.parquet"
    return load(
        generate_dataset("delayed_memory", path, n_groups=6, distractors=(1, 5), seed=3, twins=True)
    )


def _battery(model, ds, prefill, kinds):
    pairs = pairs_of(ds)
    rec = Record(len(pairs))
    pf = parse_prefill(prefill)
    with torch.inference_mode():
        for b in batches(pairs, 64, "cpu"):
            patch_batch(model, b, pf, kinds, rec, pairs, range(len(model.depth_hooks())))
    return rec, pairs, summarise(rec, pairs, ds.task, pf.name, 0)


@pytest.mark.parametrize("prefill", ["standard", "recurrent"])
def test_the_whole_residual_at_depth_0_gives_the_twins_answer(dm, prefill):
    model = resolve_model("default")[0].eval()
    rec, pairs, df = _battery(model, dm, prefill, ("resid",))
    key = next(k for k in rec.hits if k.site == "blocks.0.hook_resid_pre" and k.positions == "all")
    np.testing.assert_allclose(rec.hits[key][2], rec.hits[TWIN][2], atol=1e-4)
    ld = df[
        (df.site == "blocks.0.hook_resid_pre")
        & (df.positions == "all")
        & (df.metric == "logit_diff")
    ]
    assert abs(float(ld.value.iloc[0])) < 1e-5
    # the label-bearing token's own embedding at depth 0 is the token interchange
    assert {"label", "answer-0", "answer-3", "all"} <= set(df.positions)


@torch.inference_mode()
def test_every_heads_patch_together_is_the_attention_outputs(dm):
    from fbt_probe.kernels.patching import clean_run, patched_output, replace_where

    model = resolve_model("default")[0].eval()
    pf = parse_prefill("recurrent")
    b = batches(pairs_of(dm), 64, "cpu")[0]
    names = ["blocks.1.attn.hook_z", "blocks.1.hook_attn_out"]
    _, acts = twin_acts(model, b, pf, names)
    b.clean = clean_run(model, b.tokens, pf)
    t = torch.arange(b.tokens.shape[1])[None]
    after = (t <= b.answer[:, None]) & (t >= b.label_pos[:, None])
    start = int(b.label_pos.min())
    heads = [
        ("blocks.1.attn.hook_z", head_hook(h, after, acts[names[0]]))
        for h in range(model.cfg.n_heads)
    ]
    a = answer_logits(patched_output(model, b.clean, start, heads, None, 1), b, start)
    whole = [("blocks.1.hook_attn_out", replace_where(after, acts[names[1]]))]
    c = answer_logits(patched_output(model, b.clean, start, whole, None, 1), b, start)
    torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
    clean = answer_logits(b.clean.out, b, 0)
    assert float((a - clean).abs().max()) > 1e-3  # the patch did something


def test_a_path_patch_without_feedback_changes_nothing(dm):
    from fbt_probe.config import build_cfg
    from fbt_probe.stack import FBTModel

    model = FBTModel(build_cfg(fusion="none", n_layers=2), seed=0).eval()
    rec, _, df = _battery(model, dm, "recurrent", ("path",))
    paths = [k for k in rec.hits if k.intervention == "patch_path"]
    assert len(paths) == 3 * model.cfg.n_heads
    for k in paths:
        np.testing.assert_allclose(rec.hits[k][2], rec.hits[CLEAN][2], atol=1e-5)


def test_patch_command_on_the_default_model(dm, tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=6, distractors=(1, 5), seed=3, twins=True)
    out = tmp_path / "p"
    r = CliRunner().invoke(app, ["patch", "--data", str(data), "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "patch.csv")
    assert set(df.intervention) == {"patch_resid", "patch_head", "patch_path"}
    meta = json.loads((out / "patch.json").read_text())
    model = resolve_model("default")[0]
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert meta["patched_runs"] == meta["n_batches"] * ((L + 1) * 6 + L * H + 3 * H)
    for kind in ("resid", "head", "path"):
        assert (out / "figures" / f"patch_{kind}_delayed_memory.png").stat().st_size > 0
    assert "move the answer most" in r.output


def test_patch_on_a_hugging_face_model_patches_residuals_and_refuses_heads_without_hooks(
    tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    from fbt_probe.hf.tiny import model_folder

    folder = model_folder(tmp_path / "llama", "llama")
    data = tmp_path / "dm.parquet"
    generate_dataset(
        "delayed_memory", data, n_groups=6, distractors=(1, 3), seed=2, twins=True, tokenizer=folder
    )
    r = CliRunner().invoke(
        app,
        [
            "patch",
            "--model",
            str(folder),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "p"),
            "--kinds",
            "resid",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "p" / "patch.csv")
    ld = df[
        (df.site == "blocks.0.hook_resid_pre")
        & (df.positions == "all")
        & (df.metric == "logit_diff")
    ]
    assert abs(float(ld.value.iloc[0])) < 1e-4
    # an attention layout fbt-probe does not know has no per-head hooks: heads are refused
    from fbt_probe.hf import HFFeedbackModel

    monkeypatch.setattr(HFFeedbackModel, "n_heads", property(lambda self: 0))
    r = CliRunner().invoke(
        app, ["patch", "--model", str(folder), "--data", str(data), "--out", str(tmp_path / "q")]
    )
    assert r.exit_code == 1 and "has no per-head hooks here" in r.output
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prefill", "full"], "error: --prefill full: patch acts on a Jacobi pass"),
        (["--kinds", "heads"], "error: --kinds 'heads': choose from resid, head, path"),
        (["--pass", "3"], "error: --pass 3: recurrent prefill has passes 1..2"),
    ],
)
def test_patch_refuses_bad_input_in_one_line(tmp_path, args, message):
    r = CliRunner().invoke(app, ["patch", "--out", str(tmp_path / "p"), *args])
    assert r.exit_code == 1 and r.output.startswith(message)
    assert len(r.output.strip().splitlines()) == 1


@torch.inference_mode()
def test_patching_pass_1_feeds_the_twins_states_into_pass_2(dm):
    # every position of depth 0 in pass 1 is the twin's pass 1; pass 2 then fuses the twin's
    # pass-1 states with the clean embeddings: forward(init_states=...) computes exactly that
    from probes.patch.run import Runner

    model = resolve_model("default")[0].eval()
    pf = parse_prefill("recurrent")
    b = batches(pairs_of(dm), 64, "cpu")[0]
    out, caches = model.run_with_pass_caches(
        b.twin_tokens, passes=2, names_filter="blocks.0.hook_resid_pre"
    )
    from fbt_probe.kernels.patching import clean_run, replace_where

    b.clean = clean_run(model, b.tokens, pf)
    every = torch.ones_like(b.tokens, dtype=torch.bool)
    hook = [
        (
            "blocks.0.hook_resid_pre",
            replace_where(every, caches.of_pass(1)["blocks.0.hook_resid_pre"]),
        )
    ]
    got, first = Runner(model, b, pf, at_pass=0)(hook, 0, 0)
    ref = model(b.tokens, passes=1, init_states=out.passes[0].states)
    assert first == 0
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert float((got.logits - b.clean.logits).abs().max()) > 1e-2


@torch.inference_mode()
def test_the_last_pass_reuses_the_clean_run_and_equals_running_every_pass_again(dm):
    from fbt_probe.kernels.patching import clean_run
    from probes.patch.run import Runner

    model = resolve_model("default")[0].eval()
    pf = parse_prefill("k3")
    b = batches(pairs_of(dm), 64, "cpu")[0]
    _, acts = twin_acts(model, b, pf, ["blocks.2.attn.hook_z"])
    b.clean = clean_run(model, b.tokens, pf)
    t = torch.arange(b.tokens.shape[1])[None]
    after = (t <= b.answer[:, None]) & (t >= b.label_pos[:, None])
    start = int(b.label_pos.min())
    hook = [("blocks.2.attn.hook_z", head_hook(3, after, acts["blocks.2.attn.hook_z"]))]
    cached = Runner(model, b, pf, at_pass=2)
    whole = Runner(model, b, pf, at_pass=2)
    whole.early = True  # the path an earlier pass takes: every pass run again, whole
    a, b_ = cached(hook, start, 2), whole(hook, start, 2)
    assert not cached.early and a[1] == start and b_[1] == 0
    torch.testing.assert_close(
        answer_logits(a[0], b, a[1]), answer_logits(b_[0], b, 0), atol=1e-5, rtol=1e-5
    )


def test_patch_command_in_an_earlier_pass(dm, tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=6, distractors=(1, 5), seed=3, twins=True)
    out = tmp_path / "p"
    r = CliRunner().invoke(
        app,
        ["patch", "--data", str(data), "--out", str(out), "--pass", "1", "--kinds", "resid,path"],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "patch.csv")
    assert set(df["pass"]) == {1} and json.loads((out / "patch.json").read_text())["pass"] == 1
    # pass 1 has no fed-back state: a path patch there changes nothing
    paths = df[(df.intervention == "patch_path") & (df.metric == "logit_diff")]
    np.testing.assert_allclose(paths.value, 1.0, atol=1e-4)
    assert "recurrent prefill, pass 1" in r.output

"""Upcycling a Hugging Face model with the fusion only (optim.learn = "fusion"): the stack
keeps its weights, a checkpoint and the run's model/ hold the fusion alone, and the model
folder names its base, checked by hash when it loads. On a tiny Llama folder made here, with
the upcycle-smollm2 recipe made short."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cli import app
from fbt_probe.hf import FUSION_CONFIG, load_hf
from fbt_probe.hf.tiny import bpe_tokenizer, model_folder
from fbt_probe.train.recipes import named_config

pytest.importorskip("transformers")
SHORT = [
    "--set",
    "steps=12",
    "--set",
    "data.batch_size=4",
    "--set",
    "run.eval_examples=4",
    "--set",
    "run.checkpoint_every=6",
]


def train(base, out, *more):
    return CliRunner().invoke(
        app,
        [
            "train",
            "--init-from",
            str(base),
            "--config",
            "upcycle-smollm2",
            *SHORT,
            "--out",
            str(out),
            *more,
        ],
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("up")
    base = model_folder(d / "base", "llama", bpe_tokenizer())
    r = train(base, d / "run")
    assert r.exit_code == 0, r.output
    return d, base, d / "run"


def test_only_the_fusion_learns_and_the_folder_names_its_base(run):
    d, base, out = run
    folder = out / "model"
    assert sorted(p.name for p in folder.iterdir()) == [
        "fbt_probe_meta.json",
        "fusion.safetensors",
        "fusion_config.json",
    ]
    rec = json.loads((folder / FUSION_CONFIG).read_text())["base"]
    assert rec["path"] == str(base)
    start, trained = load_hf(base), load_hf(folder)
    s0, s1 = start.hf.state_dict(), trained.hf.state_dict()
    assert all(torch.equal(s0[k], s1[k]) for k in s0)  # the stack: bit for bit the base's
    f0, f1 = start.fusion.state_dict(), trained.fusion.state_dict()
    assert all(not torch.equal(f0[k], f1[k]) for k in ("W_U", "W_G"))
    # the checkpoint holds the fusion's parameters alone (and their AdamW state)
    state = torch.load(out / "state.pt", weights_only=False)
    assert sorted(state["model"]) == ["fusion.W_G", "fusion.W_U", "fusion.norm.w"]


def test_a_run_in_parts_ends_where_one_run_does(run, tmp_path):
    d, base, out = run
    part = tmp_path / "part"
    assert train(base, part, "--stop-after", "6").exit_code == 0
    r = train(base, part, "--resume")
    assert r.exit_code == 0, r.output
    a = load_file(str(out / "model" / "fusion.safetensors"))
    b = load_file(str(part / "model" / "fusion.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_fusion_folder_is_a_model_every_command_reads(run):
    d, base, out = run
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(out / "model"),
            "--n-groups",
            "5",
            "--task",
            "delayed_memory",
            "--modes",
            "standard,fused",
        ],
    )
    assert r.exit_code == 0, r.output


def test_a_missing_or_different_base_is_refused_in_one_line(run, tmp_path):
    d, base, out = run
    moved = tmp_path / "fusion"
    shutil.copytree(out / "model", moved)
    cfg = json.loads((moved / FUSION_CONFIG).read_text())
    cfg["base"]["path"] = str(tmp_path / "nowhere")
    (moved / FUSION_CONFIG).write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["eval", "--model", str(moved)])
    assert r.exit_code == 1 and "nowhere" in r.output and "which is not there" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    # a base of other weights: one weight changed
    other = tmp_path / "other"
    shutil.copytree(base, other)
    w = load_file(str(other / "model.safetensors"))
    k = sorted(w)[0]
    w[k] = w[k] + 1e-3
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    cfg["base"]["path"] = str(other)
    (moved / FUSION_CONFIG).write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["eval", "--model", str(moved)])
    assert r.exit_code == 1 and "other weights" in r.output and "Traceback" not in r.output


def test_fusion_only_refuses_a_schedule_of_one_pass_steps():
    cfg = named_config("upcycle-smollm2")
    with pytest.raises(ValueError, match=r"schedule\[1\] draws one-pass batches only"):
        cfg.with_overrides({"schedule.1.passes": [1.0]})
    with pytest.raises(ValueError, match="optim.learn must be one of"):
        cfg.with_overrides({"optim.learn": "stack"})
    assert (
        cfg.with_overrides({"optim.learn": "all", "schedule.1.passes": [1.0]}).optim.learn == "all"
    )

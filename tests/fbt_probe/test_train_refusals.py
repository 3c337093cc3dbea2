"""Training refuses what it cannot run or continue: settings checked before a run folder is
made, a resume that would not continue the same run, a checkpoint or signal mid-write."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from tests.refusals import ROOT, full_disk_after, no_temp_files, one_line_error, snapshot


def test_resume_from_a_truncated_checkpoint_or_config(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--set", "steps=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    state = out / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    r = CliRunner().invoke(app, ["train", "--out", str(out), "--resume"])
    one_line_error(r, "state.pt", "cannot be read", "truncated")
    (out / "train_config.json").write_text("{oops")
    r = CliRunner().invoke(
        app, ["train", "--config", "tiny", "--set", "steps=2", "--out", str(out), "--resume"]
    )
    one_line_error(r, "train_config.json", "not valid JSON")


def _edit_state(run: Path, fn) -> None:
    import torch

    state = torch.load(run / "state.pt", weights_only=False)
    torch.save(fn(state), run / "state.pt")


def _from_another_seed(run: Path) -> None:
    other = run.parent / "other"
    args = ["train", "-c", "tiny", "--set", "steps=4", "--set", "run.seed=1", "--out", str(other)]
    assert CliRunner().invoke(app, [*args, "--stop-after", "2"]).exit_code == 0
    (run / "state.pt").write_bytes((other / "state.pt").read_bytes())
    shutil.rmtree(other)


def _edit_recipe(run: Path) -> None:
    cfg = json.loads((run / "train_config.json").read_text())
    cfg["steps"] = 6
    (run / "train_config.json").write_text(json.dumps(cfg))


RESUME_CASES = {
    "recipe edited": (_edit_recipe, "state.pt was written by another recipe or seed than"),
    "state.pt of another seed": (
        _from_another_seed,
        "state.pt was written by another recipe or seed",
    ),
    "step far beyond": (
        lambda r: _edit_state(r, lambda s: {**s, "step": 10**12}),
        "state.pt is at step 1000000000000, outside this run's 0..4",
    ),
    "negative step": (lambda r: _edit_state(r, lambda s: {**s, "step": -3}), "at step -3, outside"),
    "step not an int": (lambda r: _edit_state(r, lambda s: {**s, "step": "2"}), "at step '2'"),
    "history cut": (
        lambda r: _edit_state(r, lambda s: {**s, "history": s["history"][:1]}),
        "state.pt is damaged: its history does not hold its 2 steps",
    ),
    "an empty dict": (
        lambda r: _edit_state(r, lambda s: {}),
        "state.pt is not a training checkpoint",
    ),
    "a list": (lambda r: _edit_state(r, lambda s: [1, 2]), "state.pt is not a training checkpoint"),
    "model weights corrupt": (
        lambda r: (r / "model" / "model.safetensors").write_bytes(b"\x00" * 64),
        "model.safetensors cannot be read",
    ),
    "model weights cut": (
        lambda r: (r / "model" / "model.safetensors").write_bytes(
            (r / "model" / "model.safetensors").read_bytes()[:-100]
        ),
        "model.safetensors cannot be read",
    ),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_refuses_what_it_cannot_continue_and_changes_nothing(stopped_run, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    spoil, needle = RESUME_CASES[case]
    spoil(run)
    before = snapshot(tmp_path)
    r = CliRunner().invoke(app, ["train", "--out", str(run), "--resume"])
    one_line_error(r, needle)
    assert snapshot(tmp_path) == before  # nothing rewritten, nothing new


def test_a_stopped_run_still_resumes_to_the_end(stopped_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    r = CliRunner().invoke(app, ["train", "--out", str(run), "--resume"])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "metrics.json").read_text())["steps_done"] == 4


@pytest.mark.parametrize(
    "setting,msg",
    [
        ("steps=abc", "steps must be an integer, got 'abc'"),
        ("steps=2.5", "steps must be an integer, got 2.5"),
        ("steps=true", "steps must be an integer, got True"),
        ("steps=0", "steps must be >= 1"),
        ("schedule.0.passes=5", r"schedule\[0\].passes must be a list, got 5"),
        ("optim.lr=[1", "optim.lr must be a number, got '\\[1'"),
        ("run.eval_every=0", "eval_every"),
        ("run.checkpoint_every=0", "checkpoint_every"),
        ("optim.warmup_steps=-5", "warmup_steps must be >= 0"),
        ("run.eval_examples=0", "eval_examples"),
        ("data.count_dist=normal", "count_dist must be one of"),
        ("fixed_point.exact=yes", "fixed_point.exact must be true or false, got 'yes'"),
        ("model.n_heads=3", "not divisible by n_heads 3"),
        # non-finite numbers and values out of range, each named by its dotted key
        ("optim.lr=NaN", r"optim.lr is nan; it must be a finite number"),
        ("optim.lr=Infinity", r"optim.lr is inf; it must be a finite number"),
        ("optim.lr=5", r"optim.lr must be in \(0, 1\], got 5"),
        ("optim.lr=-1e-3", r"optim.lr must be in \(0, 1\], got -0.001"),
        ("optim.grad_clip=0", r"optim.grad_clip must be > 0"),
        ("model.init_std=1e30", r"model.init_std must be in \(0, 1\]"),
        ("objective.answer_weight=[1, Infinity]", r"objective.answer_weight.1 is inf"),
        ("schedule.0.passes=[NaN]", r"schedule.0.passes.0 is nan"),
        ("model.jitter=-Infinity", r"model.jitter is -inf"),
        # the run folder is runs/<name>: one folder name
        ("name=../esc", r"name must be one folder name \(no '/', not '..'\), got '../esc'"),
        ("name=..", r"name must be one folder name"),
        ("name=a/b", r"name must be one folder name"),
        # a batch that cannot fit: refused before the run folder exists, not killed later
        (
            "data.batch_size=100000000",
            r"data.batch_size 100000000 would keep at least [\d,]+ GiB "
            r"of activations in a step \(3 passes of 256 distractors",
        ),
    ],
)
def test_training_settings_are_type_checked_before_anything_is_made(tmp_path, setting, msg):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out), "--set", setting])
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert r.stderr.startswith("error: ") and re.search(msg, r.stderr), r.stderr
    assert not out.exists()


def test_train_flags_that_cannot_apply_are_refused(tmp_path):
    fresh = tmp_path / "fresh"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(fresh), "--resume"])
    one_line_error(r, f"nothing to resume: {fresh} has no checkpoint")
    # the flags that moved to other verbs name their replacement
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--world-size", "4", "--out", str(fresh)])
    one_line_error(
        r,
        "train --show, --dry-run and --world-size: moved to another command; use 'fbt-probe recipe",
    )
    r = CliRunner().invoke(app, ["train", "--seeds", "0-2", "--out", str(fresh)])
    one_line_error(
        r, "train --seeds: moved to another command; use 'fbt-probe seeds run --seeds 0-2 ...'"
    )
    r = CliRunner().invoke(
        app, ["train", "-c", "tiny", "--set", "run.seed=-1", "--out", str(fresh)]
    )
    one_line_error(r, "run.seed must be >= 0, got -1")
    assert not fresh.exists()


def test_a_full_disk_at_a_checkpoint_leaves_no_partial_state(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "save", lambda obj, path, *a, **k: full_disk_after(1000)(path))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--set", "steps=2", "--out", str(out)])
    # the progress lines of the steps run come first; the error is the one line after them
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert err[-1] == f"error: cannot write {out / 'state.pt'}: No space left on device"
    assert all(line.startswith("train tiny: ") for line in err[:-1])
    assert not (out / "state.pt").exists() and no_temp_files(out) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_training_says_aborted_and_keeps_no_partial_file(tmp_path, sig):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        "import cli; cli.main()",
        "train",
        "-c",
        "tiny",
        "--set",
        "steps=100000",
        "--set",
        "run.checkpoint_every=1",
        "--out",
        str(out),
    ]
    # Ctrl-C in a terminal reaches a process whose SIGINT is the default; a runner started in
    # the background by a non-interactive shell passes SIGINT on ignored, and Python then never
    # raises KeyboardInterrupt: give the child the terminal's disposition
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    t0 = time.monotonic()
    while not (out / "state.pt").exists() and p.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.01)  # until it has checkpointed once: it is mid-run
    assert p.poll() is None, "the run ended before it started"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig and err.strip().splitlines()[-1] == "error: aborted"
    assert "Traceback" not in err and no_temp_files(out) == []


@pytest.mark.parametrize("what", ["binary", "directory"])
def test_a_config_that_is_not_a_recipe_file_is_named(tmp_path, what):
    path = tmp_path / "r.toml"
    if what == "binary":
        path.write_bytes(bytes(range(128, 256)))
    else:
        path.mkdir()
    r = CliRunner().invoke(app, ["train", "--config", str(path), "--out", str(tmp_path / "run")])
    one_line_error(r, str(path), "not a text file" if what == "binary" else "is a directory")
    assert not (tmp_path / "run").exists()

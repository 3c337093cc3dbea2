"""Bad input through the command line: one line on stderr naming the culprit, a non-zero
exit, no traceback, nothing new in the output folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from fbt_probe.checkpoint import save_model
from fbt_probe.config import build_cfg
from fbt_probe.stack import FBTModel
from tasks.generate import generate_dataset


def one_line_error(r, *needles):
    err = r.stderr.strip()
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output and len(err.splitlines()) == 1, r.output
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, err


def files_under(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture
def model_dir(tmp_path):
    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), tmp_path / "m")
    return tmp_path / "m"


def edit_json(path, fn):
    d = json.loads(path.read_text())
    path.write_text(json.dumps(fn(d)))


EVAL = ["eval", "--json", "--n-groups", "5", "--task", "delayed_memory", "--model"]


@pytest.mark.parametrize(
    "field,value",
    [("n_heads", 8), ("positional", "none"), ("depth_scaling", False), ("jitter", 0.3)],
)
def test_an_edited_model_config_is_refused(model_dir, field, value):
    # n_heads 4 -> 8 or positional -> none change no tensor shape: only the config's hash
    # in meta.json shows the edit
    edit_json(model_dir / "config.json", lambda d: {**d, field: value})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "changed after the model was saved")


def test_a_mistyped_model_config_names_the_field(model_dir):
    # a folder written before configs were hashed: the type check still names the field
    edit_json(
        model_dir / "meta.json", lambda d: {k: v for k, v in d.items() if k != "config_sha256"}
    )
    edit_json(model_dir / "config.json", lambda d: {**d, "depth_scaling": "false"})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "depth_scaling must be true or false, got 'false'")


@pytest.mark.parametrize(
    "text,msg", [("[1, 2]", "must hold a JSON object"), ("{oops", "is not valid JSON")]
)
def test_a_broken_meta_json_is_refused(model_dir, text, msg):
    (model_dir / "meta.json").write_text(text)
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "meta.json", msg)


def test_small_option_checks(tmp_path, model_dir):
    out = tmp_path / "out"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--distractors",
            "",
            "--out",
            str(out / "d.parquet"),
        ],
    )
    one_line_error(r, "--distractors is empty")
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--prefill", "k5000", "--out", str(out)]
    )
    one_line_error(r, "unknown prefill 'k5000'")
    assert files_under(out) == []


# every list option goes through one parser (fbt_probe.util.lists): an item named twice is refused in
# one line naming the option, before any work
@pytest.mark.parametrize(
    "argv,culprit",
    [
        (
            ["fit", "-p", "standard,standard", "--task", "delayed_memory"],
            "--prefill 'standard,standard': standard is named twice",
        ),
        (
            ["fit", "--task", "delayed_memory,delayed_memory"],
            "--task 'delayed_memory,delayed_memory': delayed_memory is named twice",
        ),
        (["eval", "--modes", "soft,soft"], "--modes 'soft,soft': soft is named twice"),
        (["eval", "--task", "done_tracking, done_tracking"], "done_tracking is named twice"),
        (
            ["intervene", "--intervention", "self,self"],
            "--intervention 'self,self': self is named twice",
        ),
        (["intervene", "--depths", "0,1,0"], "--depths '0,1,0': 0 is named twice"),
        (["patch", "--kinds", "resid,resid"], "--kinds 'resid,resid': resid is named twice"),
        (["patch", "--depths", "1,1"], "--depths '1,1': 1 is named twice"),
        (
            ["attribute", "--kinds", "head,state,head"],
            "--kinds 'head,state,head': head is named twice",
        ),
        (["lens", "--task", "done_tracking,done_tracking"], "done_tracking is named twice"),
        (
            ["trajectory", "--task", "multi_register,multi_register"],
            "multi_register is named twice",
        ),
        (
            ["generate", "--task", "delayed_memory", "--distractors", "0-8,4"],
            "--distractors '0-8,4': 4 is named twice",
        ),
        (["seeds", "run", "--seeds", "0-2,1"], "--seeds '0-2,1': 1 is named twice"),
        (["view", "--examples", "3,3"], "--examples '3,3': 3 is named twice"),
        (["patch", "--kinds", "resid,,head"], "--kinds 'resid,,head': an empty item"),
    ],
)
def test_an_item_named_twice_in_any_list_option_is_refused_before_any_work(
    tmp_path, monkeypatch, argv, culprit
):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, argv)
    one_line_error(r, culprit)
    assert files_under(tmp_path) == []


# an option's bounds are checked once, by its options dataclass: on the command line and in
# the library call alike, before any work
SEEDED = ["fit", "intervene", "lens", "trajectory", "patch", "attribute", "heads"]


def console(argv, monkeypatch, capsys) -> tuple[int, str]:
    """``fbt-probe ARGV`` as the console script runs it (cli.main, which makes a usage error
    one line too), in this process: (exit code, stderr). The signal handlers main installs
    are put back."""
    import cli

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "argv", ["fbt-probe", *argv])
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("verb", SEEDED)
def test_a_negative_seed_is_refused_naming_it_on_every_analysis(
    tmp_path, monkeypatch, capsys, verb
):
    import probes

    monkeypatch.chdir(tmp_path)
    one_line_error(CliRunner().invoke(app, [verb, "--seed", "-1"]), "--seed must be at least 0")
    code, err = console([verb, "--seed", "-1"], monkeypatch, capsys)
    assert code == 1 and err == "error: --seed must be at least 0, got -1\n", err
    with pytest.raises(ValueError, match="--seed must be at least 0, got -1"):
        getattr(probes, f"run_{verb}")(seed=-1)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["patch", "--task", "done_tracking,delayed_memory"],
        ["attribute", "--task", "all"],
        ["view", "--task", "delayed_memory,done_tracking"],
        ["stability", "--task", "done_tracking,multi_register"],
    ],
)
def test_a_verb_of_one_task_refuses_a_list_naming_task(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    one_line_error(
        CliRunner().invoke(app, argv), f"--task '{argv[2]}': this command takes one task"
    )
    assert files_under(tmp_path) == []


# ---- output paths: never replace what is not a regular file; check before the work -------
@pytest.fixture
def odd_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target.parquet"
    target.write_text("keep me")
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    folder = tmp_path / "folder"
    folder.mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("a file")
    return {"fifo": fifo, "link": link, "folder": folder, "plain": plain, "target": target}


@pytest.mark.parametrize(
    "which,kind", [("fifo", "a FIFO"), ("link", "a symlink"), ("folder", "a directory")]
)
def test_generate_force_never_replaces_what_is_not_a_regular_file(odd_paths, which, kind):
    path = odd_paths[which]
    r = CliRunner().invoke(
        app,
        ["generate", "--task", "delayed_memory", "--out", str(path), "--force", "--n-groups", "4"],
    )
    one_line_error(r, str(path), kind, "refusing to replace it")
    assert odd_paths["target"].read_text() == "keep me"  # the symlink's target is untouched
    assert os.path.islink(odd_paths["link"]) and stat.S_ISFIFO(os.lstat(odd_paths["fifo"]).st_mode)


@pytest.mark.parametrize(
    "cmd",
    [
        ["fit", "--task", "delayed_memory"],
        ["stability", "--prefill", "k2", "--decode-tokens", "0"],
        ["plot", "--results", "{plain}"],
        ["train", "-c", "tiny"],
    ],
)
@pytest.mark.parametrize("which", ["plain", "fifo"])
def test_an_out_folder_that_is_a_file_fails_before_the_work(odd_paths, cmd, which):
    cmd = [c.format(plain=odd_paths["plain"]) for c in cmd]
    before = files_under(odd_paths["folder"].parent)
    r = CliRunner().invoke(app, [*cmd, "--out", str(odd_paths[which])])
    one_line_error(r, str(odd_paths[which]), "not a folder")
    assert files_under(odd_paths["folder"].parent) == before


def test_sigterm_removes_the_partial_file(tmp_path):
    # generate killed while it writes: no hidden temp file stays behind. The write is short,
    # so a signal can come after it ends: such a run must have written its file whole, and
    # the test tries again with a larger file until one is stopped mid-write
    from tasks.dataset import load

    for n_groups in (6000, 12000, 24000):
        folder = tmp_path / str(n_groups)
        folder.mkdir()
        cmd = [
            sys.executable,
            "-c",
            "import cli; cli.main()",
            "generate",
            "--task",
            "multi_register",
            "--n-groups",
            str(n_groups),
            "--out",
            str(folder / "big.parquet"),
        ]
        p = subprocess.Popen(cmd, cwd=Path(__file__).parents[1], stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while not any(folder.iterdir()) and p.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.005)  # until the temporary file appears
        assert p.poll() is None, "the run ended before it started writing"
        p.terminate()
        _, err = p.communicate(timeout=60)
        # it finished first (the signal, if it came while Python shut down, ended it there):
        # the file is whole, and nothing else is there
        if p.returncode in (0, -signal.SIGTERM):
            assert [f.name for f in folder.iterdir()] == ["big.parquet"]
            assert len(load(folder / "big.parquet")) == n_groups * 10
            continue
        assert p.returncode == 143 and err.strip().splitlines()[-1] == "error: aborted"
        assert list(folder.iterdir()) == []
        return
    pytest.fail("every run finished before the signal came")


# ---- datasets, caches, results tables, checkpoints, verdicts --------------------------------
def _dataset(tmp_path):
    return generate_dataset(
        "delayed_memory", tmp_path / "d.parquet", n_groups=6, distractors=(1, 4), seed=2
    )


def _rewrite(path, fn):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    pq.write_table(fn(t), path)


@pytest.mark.parametrize(
    "what", ["zero rows", "colon outside", "metadata shape", "metadata JSON", "metadata list"]
)
def test_a_broken_dataset_is_refused_with_its_name(tmp_path, model_dir, what):
    import pyarrow as pa

    from tasks.dataset import META_KEY

    data = _dataset(tmp_path)
    if what == "zero rows":
        _rewrite(data, lambda t: t.slice(0, 0))
        msg = "holds no examples"
    elif what == "colon outside":

        def shift(t):
            col = pa.array([999] * t.num_rows, pa.int32())
            return t.set_column(t.schema.get_field_index("colon_index"), "colon_index", col)

        _rewrite(data, shift)
        msg = "has no colon at its colon_index"
    else:

        def meta(t):
            m = json.loads(
                t.schema.metadata[META_KEY.encode() if isinstance(META_KEY, str) else META_KEY]
            )
            m["task"] = ["delayed_memory"]
            return t.replace_schema_metadata({META_KEY: json.dumps(m).encode()})

        if what == "metadata shape":
            _rewrite(data, meta)
            msg = "no task name"
        else:
            text = b"{oops" if what == "metadata JSON" else b"[1, 2]"
            _rewrite(data, lambda t: t.replace_schema_metadata({META_KEY: text}))
            msg = "not valid JSON" if what == "metadata JSON" else "must be a JSON object"
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--data", str(data), "--out", str(out)]
    )
    one_line_error(r, str(data), msg)
    assert files_under(out) == []


def test_a_cache_entry_of_the_wrong_shape_is_recomputed(tmp_path, model_dir):
    import numpy as np

    from fbt_probe.checkpoint import load_model
    from probes.common.extract import extract_cached
    from tasks.dataset import load

    ds, m = load(_dataset(tmp_path)), load_model(model_dir)
    f, _ = extract_cached(m, ds, "standard", tmp_path / "c")
    (entry,) = (tmp_path / "c").glob("*.npy")
    np.save(entry, np.zeros((3, 2), dtype=np.float32))
    again, hit = extract_cached(m, ds, "standard", tmp_path / "c")
    assert not hit and np.array_equal(again, f)


@pytest.mark.parametrize(
    "content,msg",
    [
        ("task,target,model\n", "lacks columns"),
        (None, "has a header but no rows"),
        ("\x00\x01\x02binary\xff", "not a probe results table"),
        ("bad", "holds values that are not numbers"),
    ],
)
def test_plot_refuses_a_broken_results_table(tmp_path, content, msg):
    res = tmp_path / "res"
    res.mkdir()
    head = "task,target,model,prefill,depth,distractors,overwrites,accuracy,chance\n"
    if content is None:
        content = head
    elif content == "bad":
        content = head + "delayed_memory,label,trained,standard,0,1-256,all,high,0.5\n"
    (res / "probe_results.csv").write_bytes(content.encode("latin-1"))
    r = CliRunner().invoke(app, ["plot", "--results", str(res)])
    one_line_error(r, "probe_results.csv", msg)
    assert not (res / "figures").exists() or files_under(res / "figures") == []


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


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run stopped at step 2 of 4: a checkpoint, its recipe and a model folder."""
    out = tmp_path_factory.mktemp("resume") / "run"
    args = ["train", "-c", "tiny", "--set", "steps=4", "--set", "run.checkpoint_every=2"]
    r = CliRunner().invoke(app, [*args, "--out", str(out), "--stop-after", "2"])
    assert r.exit_code == 0, r.output
    return out


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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


def test_stability_with_too_few_passes_is_inconclusive():
    from fbt_probe.kernels.stability import verdict

    rows = [{"delta_mean": float("nan")}, {"delta_mean": 0.2}, {"delta_mean": 0.3}]
    assert verdict(rows) == "inconclusive"
    assert verdict(rows[:1]) == "inconclusive"
    assert verdict([*rows, {"delta_mean": float("inf")}]) == "diverging"


def test_seeds_and_a_huge_dataset_are_refused_before_the_work(tmp_path, model_dir):
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--seed", "-1", "--out", str(out)]
    )
    one_line_error(r, "--seed must be >= 0")
    r = CliRunner().invoke(
        app, ["generate", "--task", "multi_register", "--n-groups", "100000000", "--out", str(out)]
    )
    one_line_error(r, "--n-groups 100000000 would need about", "GiB")
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--seed", "-2", "--out", str(tmp_path / "r")]
    )
    one_line_error(r, "--seed must be at least 0, got -2")
    assert files_under(tmp_path) == [
        Path("m"),
        *sorted(Path("m") / p.name for p in model_dir.iterdir()),
    ]


def test_a_failed_figure_write_leaves_nothing(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from probes.fit.plot import save_figure

    fig = plt.figure()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fig, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_figure(fig, tmp_path / "figs", "x")
    assert files_under(tmp_path / "figs") == []


# ---- training configuration: checked field by field, before the run folder is made -------
def test_the_cli_error_boundary(tmp_path, monkeypatch):
    import fbt_probe.train.loop as T

    def broken(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(T, "train", broken)
    out = tmp_path / "z"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines() == [
        "error: unexpected ZeroDivisionError: division by zero (a bug or an unusual input; "
        "FBT_DEBUG=1 shows the traceback)"
    ]
    monkeypatch.setenv("FBT_DEBUG", "1")
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out)])
    assert isinstance(r.exception, ZeroDivisionError)


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


# ---- more option checks, all before any work -------------------------------------------
@pytest.mark.parametrize(
    "args,msg",
    [
        (["fit", "--prefill", "k1001"], "k<N> (N passes, 1..1000)"),
        (["intervene", "--task", "delayed_memory", "--prefill", "k5000"], "1..1000"),
        (["eval", "--n-groups", "100000000"], "--n-groups 100000000 would need about"),
        (["stability", "--decode-tokens", "10000000"], "--decode-tokens must be in 0..4000"),
    ],
)
def test_sizes_beyond_what_runs_are_refused(tmp_path, model_dir, args, msg):
    # an unbounded k-pass prefill once kept every pass's logits and was killed for memory
    out = tmp_path / "out"
    extra = [] if args[0] == "eval" else ["--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--model", str(model_dir), *extra])
    one_line_error(r, msg)
    assert not out.exists()


def test_fit_checks_folds_and_sites_before_it_makes_the_results_folder(tmp_path, model_dir):
    one = generate_dataset(
        "delayed_memory", tmp_path / "one.parquet", n_groups=3, distractors=(1, 4), seed=2
    )
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--data", str(one), "--out", str(out)]
    )
    one_line_error(r, "--folds 5: the delayed_memory dataset has only 3 groups")
    data = _dataset(tmp_path)
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "-p",
            "standard",
            "--site",
            "fusion.hook_state",
            "--out",
            str(out),
        ],
    )
    one_line_error(r, "fusion.hook_state fires under none of the prefills standard")
    assert not out.exists()


# ---- Hugging Face model folders ----------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from fbt_probe.hf.tiny import model_folder

    return model_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


def _hf_variant(src, dst, broken):
    import shutil

    shutil.copytree(src, dst)
    broken(dst)
    return dst


@pytest.mark.parametrize(
    "what,msg",
    [
        ("weights", "is not a loadable Hugging Face model"),
        ("fusion weights", "fusion.safetensors cannot be read"),
        ("fusion config", "fusion_config.json is not valid JSON"),
        ("half fusion", "has fusion.safetensors but no fusion_config.json"),
        ("no tokenizer", "has no tokenizer: save one beside the model"),
    ],
)
@pytest.mark.parametrize("cmd", ["eval", "fit", "stability"])
def test_a_broken_hugging_face_folder_is_refused_with_its_name(
    hf_folder, tmp_path, what, msg, cmd, monkeypatch
):
    from fbt_probe.hf import FORMAT

    fusion_cfg = {
        "format": FORMAT,
        "version": 1,
        "fusion": "gated",
        "jitter": 0.0,
        "norm_eps": 1e-6,
        "d_model": 32,
    }

    def broken(d):
        if what == "weights":
            (d / "model.safetensors").write_bytes(b"garbage")
        if what in ("fusion weights", "half fusion", "fusion config"):
            (d / "fusion.safetensors").write_bytes(b"x")
        if what == "fusion weights":
            (d / "fusion_config.json").write_text(json.dumps(fusion_cfg))
        if what == "fusion config":
            (d / "fusion_config.json").write_text("{oops")
        if what == "no tokenizer":
            for f in [*d.glob("tokenizer*"), *d.glob("special_tokens*")]:
                f.unlink()

    folder = _hf_variant(hf_folder, tmp_path / "m", broken)
    monkeypatch.chdir(tmp_path)  # a dataset generated before the refusal would land in data/
    before = files_under(tmp_path)
    args = {
        "eval": ["eval", "--n-groups", "5", "--task", "delayed_memory"],
        "fit": ["fit", "--task", "delayed_memory", "--out", "res"],
        "stability": ["stability", "--prefill", "k2", "--decode-tokens", "0", "--out", "st"],
    }[cmd]
    r = CliRunner().invoke(app, [*args, "--model", str(folder)])
    one_line_error(r, str(folder), msg)
    assert files_under(tmp_path) == before


# ---- failed writes: a full disk, an unwritable folder (injected: root can write anywhere) ---
def _no_temp_files(folder):
    return [p for p in files_under(folder) if p.name.startswith(".") or p.suffix == ".tmp"]


def _full_disk_after(n_bytes):
    def write(path, *a, **k):
        Path(path).write_bytes(b"\0" * n_bytes)  # part of it went out, then the disk filled
        raise OSError(28, "No space left on device")

    return write


def test_a_full_disk_while_fit_writes_its_table_leaves_no_partial_file(
    tmp_path, model_dir, monkeypatch
):
    import pandas as pd

    data = _dataset(tmp_path)
    monkeypatch.setattr(pd.DataFrame, "to_csv", lambda self, path, **k: _full_disk_after(100)(path))
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "-p",
            "standard",
            "--no-controls",
            "--out",
            str(out),
        ],
    )
    # the work's progress lines may come first (on a slow machine): the error is the last line
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"error: cannot write {out / 'probe_results.csv'}: No space left on device"
    assert not out.exists() and _no_temp_files(tmp_path) == []


def test_a_full_disk_at_a_checkpoint_leaves_no_partial_state(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "save", lambda obj, path, *a, **k: _full_disk_after(1000)(path))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--set", "steps=2", "--out", str(out)])
    # the progress lines of the steps run come first; the error is the one line after them
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert err[-1] == f"error: cannot write {out / 'state.pt'}: No space left on device"
    assert all(line.startswith("train tiny: ") for line in err[:-1])
    assert not (out / "state.pt").exists() and _no_temp_files(out) == []


def test_a_full_disk_while_a_hugging_face_folder_is_written_keeps_the_old_one(
    hf_folder, tmp_path, monkeypatch
):
    import safetensors.torch

    from fbt_probe.hf import load_hf, save_hf

    m = load_hf(hf_folder)
    out = save_hf(m, tmp_path / "m")
    before = {p: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(
        safetensors.torch, "save_file", lambda sd, path, **k: _full_disk_after(10)(path)
    )
    with pytest.raises(OSError, match=f"cannot write {out}: No space left on device"):
        save_hf(m, out)
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_unwritable_folder_is_named_and_left_clean(tmp_path, monkeypatch):
    import fbt_probe.util.files

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    # as root a folder's mode does not stop a write: the creation of the temp file is denied
    monkeypatch.setattr(fbt_probe.util.files, "_create_file", denied)
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--n-groups", "4", "--out", str(out)]
    )
    one_line_error(r, f"cannot write {out}: Permission denied")
    assert files_under(tmp_path) == []


# ---- signals ------------------------------------------------------------------------------
def test_a_ctrl_c_while_the_temp_file_is_created_leaves_nothing(tmp_path, monkeypatch):
    import fbt_probe.util.files as D

    real = D._create_file

    def created_then_interrupted(path):  # the signal lands once the file exists
        real(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "_create_file", created_then_interrupted)
    out = tmp_path / "state.pt"
    out.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        D.atomic_write(out, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    assert out.read_bytes() == b"old"


def test_a_ctrl_c_between_a_folders_two_replaces_puts_the_old_one_back(tmp_path, monkeypatch):
    import fbt_probe.util.files as D

    out = tmp_path / "model"
    out.mkdir()
    (out / "w").write_bytes(b"old")
    real, calls = os.replace, []

    def replace(a, b):  # the first replace (out -> old) done, then the signal
        real(a, b)
        calls.append(b)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(D.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        D.atomic_folder(out, lambda tmp: (Path(tmp) / "w").write_bytes(b"new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (out / "w").read_bytes() == b"old"


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
        cwd=Path(__file__).parents[1],
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
    assert "Traceback" not in err and _no_temp_files(out) == []


def test_a_signal_at_any_moment_gives_its_exit_code_one_line_and_no_partial_file(tmp_path):
    # the console script itself, as a user runs it; the signals land from its first moment
    # (loading modules) through the work to its exit, spread over one run's measured length
    from tasks.dataset import load

    script = Path(sys.executable).with_name("fbt-probe")
    if not script.is_file():
        pytest.skip("the fbt-probe console script is not installed beside this python")

    def start(out):
        cmd = [
            str(script),
            "generate",
            "--task",
            "done_tracking",
            "--n-groups",
            "300",
            "--out",
            str(out),
        ]
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    t0 = time.monotonic()
    p = start(tmp_path / "whole.parquet")
    assert p.wait(timeout=120) == 0
    length = time.monotonic() - t0
    outcomes = set()
    for i in range(12):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        p = start(folder / "d.parquet")
        time.sleep(length * (i + 0.5) / 12)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        files = [f.name for f in folder.iterdir()]
        if err.strip().splitlines()[-1:] == ["KeyboardInterrupt"] and "File" in err:
            # Ctrl-C while Python itself compiles or finds cli.py (the console script's
            # `from cli import main`, before cli's first line runs): no handler of ours can
            # exist yet; nothing has been written
            frames = [ln for ln in err.splitlines() if ln.strip().startswith("File ")]
            assert len(frames) == 1 and frames[0].strip().endswith("in <module>"), err
            assert "from cli import main" in err and files == [], err
            continue
        assert "Traceback" not in err and "Exception" not in err, err
        if p.returncode == 0:  # it ended before the signal came
            outcomes.add("done")
        elif p.returncode == -sig:  # before Python ran a line of fbt-probe, or after its
            assert err == "", err  # last: the system ends it (a shell shows 128 + signal)
        else:
            assert p.returncode == 128 + sig, (p.returncode, err)
            assert err.strip().splitlines()[-1] == "error: aborted", err
            outcomes.add("aborted")
        assert files in ([], ["d.parquet"]), files  # nothing partial, no temporary file
        if files:
            assert len(load(folder / "d.parquet")) == len(load(tmp_path / "whole.parquet"))
    assert "aborted" in outcomes


# ---- seed studies trust no folder they did not check ----------------------------------------
@pytest.fixture(scope="module")
def finished_seeds(tmp_path_factory):
    """Finished tiny runs of seeds 0 and 1 (2 steps), as a study names them."""
    root = tmp_path_factory.mktemp("seeds")
    for s in (0, 1):
        args = [
            "train",
            "-c",
            "tiny",
            "--set",
            "steps=2",
            "--set",
            f"run.seed={s}",
            "--set",
            f"name=tiny-seed{s}",
            "--out",
            str(root / f"seed-{s}"),
        ]
        assert CliRunner().invoke(app, args).exit_code == 0
    return root


SEED_CASES = {
    "seed 1's run in seed 0's folder": (
        lambda d: shutil.copytree(d / "from" / "seed-1", d / "study" / "seed-0"),
        "seed-0 was trained with seed 1, not seed 0",
    ),
    "metrics.json not JSON": (
        lambda d: (d / "study" / "seed-0" / "metrics.json").write_text("{oops"),
        "seed-0/metrics.json cannot be read as JSON",
    ),
    "metrics.json a list": (
        lambda d: (d / "study" / "seed-0" / "metrics.json").write_text("[1]"),
        "seed-0/metrics.json is not a JSON object",
    ),
    "seed_row.json not JSON": (
        lambda d: (d / "study" / "seed-0" / "seed_row.json").write_bytes(b"\xff\xfe"),
        "seed-0/seed_row.json cannot be read as JSON",
    ),
    "seed_row.json with a text": (
        lambda d: (d / "study" / "seed-0" / "seed_row.json").write_text('{"probe/x": "high"}'),
        "seed-0/seed_row.json is damaged: 'probe/x' is not a number",
    ),
}


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_a_seed_study_refuses_a_folder_it_cannot_trust(finished_seeds, tmp_path, case):
    shutil.copytree(finished_seeds, tmp_path / "from")
    study = tmp_path / "study"
    study.mkdir()
    spoil, needle = SEED_CASES[case]
    if case != "seed 1's run in seed 0's folder":
        shutil.copytree(tmp_path / "from" / "seed-0", study / "seed-0")
    spoil(tmp_path)
    before = snapshot(tmp_path)
    args = ["seeds", "run", "--seeds", "0", "-c", "tiny", "--set", "steps=2", "--out", str(study)]
    r = CliRunner().invoke(app, args)
    one_line_error(r, needle)
    assert snapshot(tmp_path) == before


# ---- one writer per output --------------------------------------------------------------------
HOLD = (
    "import sys\nfrom fbt_probe.util.files import claim\nwith claim(sys.argv[1]):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)
ROOT = Path(__file__).resolve().parents[1]


def hold(path):
    """Another process that holds ``path`` as a writer does, until its stdin closes."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def _writers(tmp_path, model_dir):
    data = _dataset(tmp_path)
    twins = generate_dataset(
        "delayed_memory",
        tmp_path / "tw.parquet",
        n_groups=6,
        distractors=(1, 4),
        seed=2,
        twins=True,
    )
    tiny = ["-c", "tiny", "--set", "steps=2"]
    return {
        "generate": (
            tmp_path / "g.parquet",
            ["generate", "--task", "delayed_memory", "--n-groups", "4"],
        ),
        "fit": (tmp_path / "res", ["fit", "--model", str(model_dir), "--data", str(data)]),
        "intervene": (
            tmp_path / "iv",
            ["intervene", "--model", str(model_dir), "--data", str(twins)],
        ),
        "train": (tmp_path / "run", ["train", *tiny]),
        "train --resume": (tmp_path / "stopped", ["train", "--resume"]),
        "seeds run": (tmp_path / "study", ["seeds", "run", "--seeds", "0", *tiny]),
    }


@pytest.mark.parametrize(
    "cmd", ["generate", "fit", "intervene", "train", "train --resume", "seeds run"]
)
def test_a_second_writer_of_one_output_is_refused_naming_the_holder(
    tmp_path, model_dir, stopped_run, cmd
):
    shutil.copytree(stopped_run, tmp_path / "stopped")
    out, args = _writers(tmp_path, model_dir)[cmd]
    holder = hold(out)
    try:
        before = snapshot(tmp_path)
        r = CliRunner().invoke(app, [*args, "--out", str(out)])
        one_line_error(r, f"{out} is being written by process {holder.pid}", "since")
        assert snapshot(tmp_path) == before
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0 and not (out.parent / f".{out.name}.lock").exists()


def test_two_generate_processes_at_once_one_writes_the_other_is_refused(tmp_path):
    out = tmp_path / "d.parquet"
    cmd = [
        sys.executable,
        "-c",
        "import cli; cli.main()",
        "generate",
        "--task",
        "multi_register",
        "--n-groups",
        "6000",
        "--out",
        str(out),
    ]
    first = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lock = tmp_path / ".d.parquet.lock"
    t0 = time.monotonic()
    while not lock.exists() and first.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert second.returncode == 1 and "Traceback" not in second.stderr
    [line] = second.stderr.strip().splitlines()[-1:]
    assert f"{out} is being written by process {first.pid}" in line
    from tasks.dataset import load

    assert len(load(out)) > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


@pytest.mark.parametrize("how", ["killed", "damaged"])
def test_a_claim_whose_writer_is_gone_is_cleared(tmp_path, how):
    out = tmp_path / "d.parquet"
    lock = tmp_path / ".d.parquet.lock"
    if how == "killed":  # SIGKILL: no clean-up ran, the claim stays behind
        holder = hold(out)
        holder.kill()
        holder.wait(timeout=30)
        holder.stdin.close()
        holder.stdout.close()
    else:  # a half-written claim, a minute old
        lock.write_text("{")
        os.utime(lock, (time.time() - 120, time.time() - 120))
    assert lock.exists()
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--n-groups", "4", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


def test_generate_out_with_a_trailing_slash_is_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--n-groups", "4", "--out", "newdir/"]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "newdir" / "delayed_memory.parquet").is_file()
    assert "wrote newdir/delayed_memory.parquet" in r.output


# ---- Hugging Face folders and tokenizers: every refusal names the folder and the file -------
def _config_edit(key, value):
    def edit(d):
        edit_json(d / "config.json", lambda c: {**c, key: value})

    return edit


def _fusion_edit(fn):
    def edit(d):
        from fbt_probe.hf import load_hf, save_hf

        save_hf(load_hf(d), d / "f")  # the folder with a fusion beside it
        for p in (d / "f").iterdir():
            p.replace(d / p.name)
        (d / "f").rmdir()
        path = d / "fusion_config.json"
        path.write_text(json.dumps(fn(json.loads(path.read_text()))))

    return edit


HF_CASES = {
    "not a causal LM": (
        _config_edit("architectures", ["BertForMaskedLM"]),
        "config.json: architecture BertForMaskedLM is not a causal LM",
    ),
    "unknown model type": (
        _config_edit("model_type", "nonsense"),
        "config.json is not a Hugging Face model config",
    ),
    "vocabulary below the tokenizer's": (
        _config_edit("vocab_size", 10),
        "config.json: vocab_size 10 is smaller than the tokenizer's",
    ),
    "context too short": (
        _config_edit("max_position_embeddings", 8),
        "exceeds the context length 8 ({folder}/config.json)",
    ),
    "fusion config a list": (
        _fusion_edit(lambda c: [1]),
        "fusion_config.json is not an fbt-probe fusion config",
    ),
    "jitter a string": (
        _fusion_edit(lambda c: {**c, "jitter": "x"}),
        "fusion_config.json: jitter must be a number in [0, 1), got 'x'",
    ),
    "jitter 5": (
        _fusion_edit(lambda c: {**c, "jitter": 5}),
        "fusion_config.json: jitter must be a number in [0, 1), got 5",
    ),
    "unknown fusion": (
        _fusion_edit(lambda c: {**c, "fusion": "sum"}),
        "fusion_config.json: fusion must be one of",
    ),
    "d_model a string": (
        _fusion_edit(lambda c: {**c, "d_model": "a"}),
        "fusion_config.json: d_model must be a positive integer",
    ),
    "tokenizer.json broken": (
        lambda d: (d / "tokenizer.json").write_text("{"),
        "(tokenizer.json, tokenizer_config.json) has no usable tokenizer",
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_hugging_face_refusal_names_the_folder_and_the_file(
    hf_folder, tmp_path, monkeypatch, case
):
    broken, needle = HF_CASES[case]
    folder = _hf_variant(hf_folder, tmp_path / "m", broken)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    r = CliRunner().invoke(
        app, ["eval", "--n-groups", "5", "--task", "delayed_memory", "--model", str(folder)]
    )
    one_line_error(r, str(folder), needle.format(folder=folder))
    assert snapshot(tmp_path) == before


def test_a_tokenizer_without_a_colon_token_is_refused_before_anything_is_written(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fbt_probe.hf.tiny import model_folder
    from tasks import vocab

    words = ["<unk>", *(t for t in vocab.TOKENS if t != vocab.COLON)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")
    folder = model_folder(tmp_path / "m", "llama", tok)
    before = snapshot(tmp_path)
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--n-groups",
            "4",
            "--tokenizer",
            str(folder),
            "--out",
            str(out),
        ],
    )
    one_line_error(r, f"{folder}/tokenizer.json has no token of its own for the colon ':'")
    assert snapshot(tmp_path) == before


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


# ---- what research/hardening_audit.py found: each option named, each refused before work --
AUDIT_FOUND = [
    (["generate", "--task", "delayed_memory", "--distractors", "-1"], "--distractors '-1'"),
    (
        ["generate", "--task", "delayed_memory", "--distractors", "300"],
        "--distractors '300': distractor count 300 outside [0, 256]",
    ),
    (["generate", "--task", "delayed_memory", "--distractors", "5-2"], "--distractors '5-2'"),
    (["generate", "--task", "delayed_memory", "--distractors", "0,,1"], "--distractors '0,,1'"),
    (["eval", "--modes", "nope"], "--modes 'nope': unknown decoding mode 'nope'"),
    (["eval", "--modes", "standard,,full"], "--modes 'standard,,full'"),
    (
        ["stability", "--prefill", "k2"],
        "--decode-tokens 1000: the prompt and the decoded tokens need",
    ),
    (
        ["lens", "--position", "nope"],
        "--position 'nope': task delayed_memory declares no such position",
    ),
    (["lens", "--position", ""], "--position ''"),
    (["patch", "--depths", "1,,2"], "--depths '1,,2'"),
    (["heads", "--seed", "-1"], "--seed must be at least 0, got -1"),
]


@pytest.mark.parametrize(
    "args,needle", AUDIT_FOUND, ids=[" ".join(a[:1] + a[-2:]) for a, _ in AUDIT_FOUND]
)
def test_options_the_audit_found_are_refused_by_name_before_any_work(
    model_dir, tmp_path, monkeypatch, args, needle
):
    monkeypatch.chdir(tmp_path)  # a default dataset generated before the refusal would land here
    extra = [] if args[0] == "generate" else ["--model", str(model_dir), "--task", "delayed_memory"]
    before = snapshot(tmp_path)
    out = [] if args[0] == "eval" else ["--out", str(tmp_path / "out")]
    r = CliRunner().invoke(app, [*args, *extra, *out])
    one_line_error(r, needle)
    assert snapshot(tmp_path) == before


# ---- work bounded before it starts (fbt_probe.runtime.budget) -----------------------------------------
def test_a_patch_sweep_past_the_budget_is_refused_in_one_line_before_it_runs(tmp_path, monkeypatch):
    import fbt_probe.runtime.budget as budget

    # an hour's budget on any machine: the default sweep (about two minutes of 2 cores) runs,
    # a thousand passes re-run for every patch (a day or more) is refused by name
    monkeypatch.setattr(budget, "LIMIT_SECONDS", 3600.0)
    out = tmp_path / "p"
    r = CliRunner().invoke(app, ["patch", "--prefill", "k1000", "--pass", "1", "--out", str(out)])
    one_line_error(r, "--prefill k1000 --pass 1: 142 patches of 1000 passes each", "ask for less")
    assert not out.exists()
    from fbt_probe.loading import resolve_model

    m, _ = resolve_model("default")
    wide = budget.seconds(m, 142 * 70016 * 1000)
    assert budget.seconds(m, 142 * 70016 * 1) < 3600 < wide


BOUNDED = {  # every verb that runs a model over data: its prefill option's spelling
    "fit": ["fit", "--prefill", "k1000", "--no-controls"],
    "lens": ["lens", "--prefill", "k16", "--no-tuned"],  # these three read at most 16 passes
    "trajectory": ["trajectory", "--prefill", "k16"],
    "heads": ["heads", "--prefill", "k16"],
    "stability": ["stability", "--prefill", "k1000", "--decode-tokens", "0"],
    "intervene": ["intervene", "--prefill", "k1000", "-i", "interchange_state"],
    "patch": ["patch", "--prefill", "k1000"],
    "attribute": ["attribute", "--prefill", "k1000"],
}


@pytest.mark.parametrize("verb", list(BOUNDED))
def test_every_verb_prices_its_work_before_it_starts(tmp_path, monkeypatch, verb):
    """One estimate (fbt_probe.runtime.budget) for every verb: with a limit of a millisecond, many
    passes are refused in one line naming --prefill, before any progress line and
    with nothing written (the data they would read generated beforehand)."""
    import fbt_probe.runtime.budget as budget

    data = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=6,
        distractors=(1, 4),
        seed=2,
        twins=True,
    )
    monkeypatch.setattr(budget, "LIMIT_SECONDS", 1e-3)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    args = [*BOUNDED[verb], "--out", str(tmp_path / "out")]
    if verb != "stability":
        args += ["--data", str(data)]
    r = CliRunner().invoke(app, args)
    one_line_error(r, "--prefill", "would take about", "ask for less")
    assert snapshot(tmp_path) == before


def test_eval_prices_its_work_before_it_starts(monkeypatch, model_dir):
    import fbt_probe.runtime.budget as budget

    monkeypatch.setattr(budget, "LIMIT_SECONDS", 1e-3)
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "--n-groups, --modes", "would take about", "ask for less")


def test_a_model_name_no_folder_can_have_is_not_found():
    r = CliRunner().invoke(app, [*EVAL, "x" * 300])
    one_line_error(r, "model folder not found: xxx")

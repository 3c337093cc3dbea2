"""File safety (``fbt_probe.util.files``) as the commands meet it: outputs checked before the
work, written whole or not at all (a full disk, an unwritable folder, a signal), one writer
per output."""

from __future__ import annotations

import json
import os
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
from tasks.generate import generate_dataset
from tests.refusals import (
    ROOT,
    files_under,
    full_disk_after,
    hold,
    no_temp_files,
    one_line_error,
    small_dataset,
    snapshot,
)


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
        p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
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


def test_a_full_disk_while_fit_writes_its_table_leaves_no_partial_file(
    tmp_path, model_dir, monkeypatch
):
    import pandas as pd

    data = small_dataset(tmp_path)
    monkeypatch.setattr(pd.DataFrame, "to_csv", lambda self, path, **k: full_disk_after(100)(path))
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
    assert not out.exists() and no_temp_files(tmp_path) == []


def test_a_full_disk_while_a_hugging_face_folder_is_written_keeps_the_old_one(
    tiny_llama, tmp_path, monkeypatch
):
    import safetensors.torch

    from fbt_probe.hf import load_hf, save_hf

    m = load_hf(tiny_llama)
    out = save_hf(m, tmp_path / "m")
    before = {p: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(
        safetensors.torch, "save_file", lambda sd, path, **k: full_disk_after(10)(path)
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


def _writers(tmp_path, model_dir):
    data = small_dataset(tmp_path)
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


def test_a_signal_right_after_the_lock_is_created_leaves_no_lock(tmp_path, monkeypatch):
    import fbt_probe.util.files as files

    def interrupted(fd, *a, **k):  # the signal lands between the exclusive create and the write
        os.close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fdopen", interrupted)
    with pytest.raises(KeyboardInterrupt), files.claim(tmp_path / "out.parquet"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_releasing_a_claim_leaves_another_writers_lock(tmp_path):
    import fbt_probe.util.files as files

    lock = files.lock_path(tmp_path / "out.parquet")
    lock.write_text(json.dumps({"pid": os.getpid() + 1}) + "\n")
    files._release(lock, tried=True)
    assert lock.exists()

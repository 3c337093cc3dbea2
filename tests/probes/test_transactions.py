"""One output transaction per command (``fbt_probe.util.transaction``): every analysis's
verb, ``report`` and ``view`` write all their outputs at once or not at all; an earlier run's
outputs are replaced only with ``--force`` (stale ones included); one writer at a time; a
failed write or a signal leaves the destination as it was and nothing new on disk."""

from __future__ import annotations

import errno
import os
import shutil
import signal
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
from fbt_probe.util.transaction import existing_outputs, transaction
from probes import ANALYSES
from tasks.generate import generate_dataset
from tests.refusals import hold, one_line_error, snapshot

# every registered analysis: a run of a few seconds on a tiny model
QUICK = {
    "fit": ["fit", "--prefill", "standard,recurrent", "--no-controls", "--folds", "2"],
    "lens": ["lens", "--prefill", "k2"],
    "trajectory": ["trajectory", "--prefill", "k3"],
    "heads": ["heads", "--prefill", "recurrent"],
    "stability": [
        "stability",
        "--prefill",
        "k4",
        "--decode-tokens",
        "8",
        "--task",
        "delayed_memory",
    ],
    "intervene": [
        "intervene",
        "--prefill",
        "recurrent",
        "-i",
        "interchange_state",
        "--task",
        "delayed_memory",
    ],
    "patch": ["patch", "--prefill", "recurrent", "--groups", "2"],
    "attribute": ["attribute", "--prefill", "recurrent", "--groups", "2"],
    "steps": ["steps", "--modes", "standard,soft", "--no-controls", "--folds", "2"],
    "loop": ["loop", "--modes", "soft", "--kinds", "state"],
}
GENERATED = ("steps", "loop")  # read a generated-answer task's dataset
# the other verbs that write outputs a user could lose: (argv, the output, its kind)
PAGES = ["report", "view"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tx")
    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), tmp / "m")
    data = generate_dataset(
        "delayed_memory", tmp / "dm.parquet", n_groups=6, distractors=(1, 4), seed=2, twins=True
    )
    generate_dataset(
        "count_steps", tmp / "cs.parquet", n_groups=6, distractors=(1, 4), seed=2, twins=True
    )
    return tmp, tmp / "m", data


def argv(verb: str, work, out: Path) -> list[str]:
    tmp, model, data = work
    if verb in QUICK:
        given = data.with_name("cs.parquet") if verb in GENERATED else data
        extra = [] if verb == "stability" else ["--data", str(given)]
        return [*QUICK[verb], "--model", str(model), *extra, "--out", str(out)]
    if verb in ("report", "plot"):
        return [verb, "--results", str(out)]
    return [
        "view",
        "--model",
        str(model),
        "--data",
        str(data),
        "--examples",
        "0",
        "--prefill",
        "k2",
        "--probes",
        str(out),
        "--out",
        str(out / "view.html"),
    ]


def outputs(verb: str) -> tuple[str, ...]:
    return (
        ANALYSES[verb].outputs
        if verb in ANALYSES
        else {"report": ("report.md", "report.html"), "view": ("view.html",)}[verb]
    )


def invoke(args, cwd: Path):
    old = os.getcwd()
    os.chdir(cwd)  # any default file (a dataset, the feature cache) lands in the test's folder
    try:
        return CliRunner().invoke(app, args)
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def first_runs(work, tmp_path_factory):
    """Each verb run once into a folder of its own (report and view over a fit's)."""
    done = {}
    for verb in [*QUICK, *PAGES]:
        out = tmp_path_factory.mktemp(verb) / "out"
        if verb in PAGES:
            shutil.copytree(done["fit"], out)
        r = invoke(argv(verb, work, out), work[0])
        assert r.exit_code == 0, (verb, r.output)
        done[verb] = out
    return done


def leftovers(parent: Path) -> list[str]:
    """Staging folders, temporary files and claims left beside an output."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_every_analysis_is_tried_here():
    assert set(QUICK) == set(ANALYSES), "add a quick run of the new analysis to QUICK"


@pytest.mark.parametrize("verb", [*QUICK, *PAGES])
def test_an_earlier_run_is_kept_without_force_and_replaced_whole_with_it(
    verb, work, first_runs, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(first_runs[verb], out)
    declared = {p.relative_to(out) for p in existing_outputs(out, outputs(verb))}
    if verb in QUICK:  # the declaration names every file the verb wrote
        wrote = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
        assert all(any(f == d or d in f.parents for d in declared) for f in wrote), wrote - declared
    stale = next((out / p.replace("*", "stale") for p in outputs(verb) if "*" in p), None)
    if stale is not None:
        stale.parent.mkdir(exist_ok=True)
        stale.write_text("an earlier run's output this run does not write")
    (out / "mine.txt").write_text("the user's own file")
    before = snapshot(tmp_path)

    r = invoke(argv(verb, work, out), work[0])
    one_line_error(r, "exists", "--force")
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []

    r = invoke([*argv(verb, work, out), "--force"], work[0])
    assert r.exit_code == 0, r.output
    assert stale is None or not stale.exists()
    assert (out / "mine.txt").read_text() == "the user's own file"
    assert {p.relative_to(out) for p in existing_outputs(out, outputs(verb))} == declared
    assert leftovers(tmp_path) == [] and leftovers(out) == []
    assert ".tmp" not in r.output  # the lines name the destination, not the staging folder
    for f in out.rglob("*.json"):
        assert ".tmp" not in f.read_text(), f


def failing_write(monkeypatch, suffix: str) -> None:
    """A full disk for the files of ``suffix`` a command writes."""
    real = os.replace

    def replace(src, dst, *a, **kw):  # a temporary file or a staged one, put in place
        if str(dst).endswith(suffix) and any(p.endswith(".tmp") for p in Path(src).parts):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)


def write_error(r, out: Path) -> None:
    """After its progress lines, one error line naming the file in the destination."""
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write {out}") and ".tmp" not in last, last
    assert last.endswith("No space left on device"), last


def suffixes(verb: str, first_runs) -> list[str]:
    return sorted({p.suffix for p in first_runs[verb].rglob("*") if p.is_file()} - {".md"})


@pytest.mark.parametrize("verb", [*QUICK, *PAGES])
def test_a_failed_write_leaves_the_earlier_outputs_as_they_were(
    verb, work, first_runs, tmp_path, monkeypatch
):
    """The verb's last kind of file (by suffix) cannot be written: its earlier outputs are
    all kept, nothing new is on disk (the slow test below tries every kind)."""
    out = tmp_path / "out"
    shutil.copytree(first_runs[verb], out)
    before = snapshot(tmp_path)
    failing_write(monkeypatch, ".html" if verb in PAGES else suffixes(verb, first_runs)[-1])
    r = invoke([*argv(verb, work, out), "--force"], work[0])
    write_error(r, out)
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == [] and leftovers(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("verb", list(QUICK))
def test_any_kind_of_output_that_fails_leaves_the_earlier_outputs(
    verb, work, first_runs, tmp_path, monkeypatch
):
    for suffix in suffixes(verb, first_runs):
        out = tmp_path / suffix.strip(".") / "out"
        shutil.copytree(first_runs[verb], out)
        before = snapshot(out.parent)
        with monkeypatch.context() as m:
            failing_write(m, suffix)
            r = invoke([*argv(verb, work, out), "--force"], work[0])
        write_error(r, out)
        assert snapshot(out.parent) == before and leftovers(out.parent) == [], suffix


@pytest.mark.parametrize("verb", [*QUICK, *PAGES, "plot"])
def test_a_second_writer_is_refused_naming_the_first(verb, work, first_runs, tmp_path):
    """Another process (a real one) holds the output: refused in one line, before any work."""
    out = tmp_path / "out"
    shutil.copytree(first_runs[verb] if verb in QUICK else first_runs["fit"], out)
    target = out / "view.html" if verb == "view" else out
    holder = hold(target)
    try:
        before = snapshot(tmp_path)
        r = invoke([*argv(verb, work, out), *["--force"] * (verb != "plot")], work[0])
        one_line_error(r, f"{target} is being written by process {holder.pid}")
        assert snapshot(tmp_path) == before
    finally:
        holder.communicate("", timeout=30)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
@pytest.mark.parametrize("error", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()])
def test_a_move_into_place_that_fails_puts_everything_back(tmp_path, monkeypatch, fail_at, error):
    out = tmp_path / "out"
    (out / "figures").mkdir(parents=True)
    for name, text in [
        ("a.csv", "old a"),
        ("b.json", "old b"),
        ("figures/p_1.png", "old fig"),
        ("figures/q.png", "not ours"),
        ("stale.csv", "old stale"),
    ]:
        (out / name).write_text(text)
    before = snapshot(tmp_path)
    real, moves = os.replace, []

    def replace(src, dst, *a, **kw):
        if any(p.endswith(".tmp") for p in Path(src).parent.parts) and Path(dst).is_relative_to(
            out
        ):
            moves.append(dst)
            if len(moves) == fail_at + 1:
                raise error
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(type(error)):
        with transaction(out, ("a.csv", "b.json", "stale.csv", "figures/p_*"), force=True) as stage:
            (stage / "figures").mkdir()
            for name in ("a.csv", "b.json", "figures/p_2.png"):
                (stage / name).write_text("new")
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_a_transaction_that_succeeds_replaces_only_what_it_names(tmp_path):
    out = tmp_path / "out"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "p_1.png").write_text("old")
    (out / "figures" / "q.png").write_text("not ours")
    (out / "a.csv").write_text("old")
    with transaction(out, ("a.csv", "figures/p_*"), force=True) as stage:
        (stage / "figures").mkdir()
        (stage / "a.csv").write_text("new")
        (stage / "figures" / "p_2.png").write_text("new")
    assert {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()} == {
        "a.csv": "new",
        "figures/p_2.png": "new",
        "figures/q.png": "not ours",
    }
    assert leftovers(tmp_path) == []


SIGNALLED = [pytest.param(v, marks=[] if v == "lens" else [pytest.mark.slow]) for v in QUICK]


def staged(parent: Path, with_a_file: bool) -> bool:
    folders = [p for p in parent.glob(".*.tmp") if p.is_dir()]
    return bool(folders) and (
        not with_a_file or any(f.is_file() for d in folders for f in d.rglob("*"))
    )


@pytest.mark.parametrize("moment", ["starting", "working", "written"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("verb", SIGNALLED)
def test_a_signal_leaves_the_earlier_outputs_as_they_were(
    verb, sig, code, moment, work, first_runs, tmp_path
):
    """The console script, a real process, stopped while it starts or once it has begun
    writing: exit 130 or 143 with one line and no traceback (or ended by the system before
    a line of fbt-probe ran), the earlier outputs as they were and nothing new on disk; where
    it finished first, its outputs whole."""
    script = Path(sys.executable).with_name("fbt-probe")
    if not script.is_file():
        pytest.skip("the fbt-probe console script is not installed beside this python")
    out = tmp_path / "out"
    shutil.copytree(first_runs[verb], out)
    before = snapshot(tmp_path)
    p = subprocess.Popen(
        [str(script), *argv(verb, work, out)[0:], "--force"],
        cwd=work[0],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    t0 = time.monotonic()
    if moment == "starting":
        time.sleep(0.3)
    else:  # its staging folder is there (the work has begun), or holds a file (it writes)
        while not staged(tmp_path, moment == "written") and p.poll() is None:
            assert time.monotonic() - t0 < 120
            time.sleep(0.005)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    if p.returncode == 0:  # it ended before the signal came: its outputs are whole
        assert leftovers(tmp_path) == [] and existing_outputs(out, outputs(verb))
        return
    if p.returncode == -sig:  # before Python ran a line of fbt-probe: the system ended it
        assert err == "" or "from cli import main" in err, err
    else:
        assert p.returncode == code, err
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: aborted", err
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []

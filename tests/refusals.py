"""What every refusal test checks: one line on stderr naming the culprit, a non-zero exit, no
traceback, nothing new; and the helpers that set such a case up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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


def edit_json(path, fn):
    d = json.loads(path.read_text())
    path.write_text(json.dumps(fn(d)))


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


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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


def small_dataset(tmp_path):
    return generate_dataset(
        "delayed_memory", tmp_path / "d.parquet", n_groups=6, distractors=(1, 4), seed=2
    )


def no_temp_files(folder):
    return [p for p in files_under(folder) if p.name.startswith(".") or p.suffix == ".tmp"]


def full_disk_after(n_bytes):
    def write(path, *a, **k):
        Path(path).write_bytes(b"\0" * n_bytes)  # part of it went out, then the disk filled
        raise OSError(28, "No space left on device")

    return write


EVAL = ["eval", "--json", "--n-groups", "5", "--task", "delayed_memory", "--model"]

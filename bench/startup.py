"""How long the command line takes to start: ``fbt-probe --help`` (every verb listed, the
analyses' from the registry) and ``fbt-probe fit --help`` (one analysis's verb built from its
options dataclass), against ``python -c pass`` (the interpreter alone) and, where given, the
same commands of another checkout (``--baseline DIR``, e.g. a ``git worktree`` of an older
revision) run with this interpreter. Interleaved rounds; each figure is the median of its
runs, each ratio the median of its per-round ratios to this checkout's ``--help``.

Run: .venv/bin/python -m bench.startup [--baseline DIR]   (prints a table, writes bench/startup.json)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import machine, table, write_json

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 21


def timed(argv: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=cwd, capture_output=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another checkout whose cli.py is timed too")
    args = ap.parse_args()
    py = sys.executable
    runs = {
        "python -c pass": ([py, "-c", "pass"], ROOT),
        "fbt-probe --help": ([py, "cli.py", "--help"], ROOT),
        "fbt-probe fit --help": ([py, "cli.py", "fit", "--help"], ROOT),
    }
    if args.baseline:
        runs["baseline --help"] = ([py, str(args.baseline / "cli.py"), "--help"], args.baseline)
        runs["baseline fit --help"] = (
            [py, str(args.baseline / "cli.py"), "fit", "--help"],
            args.baseline,
        )
    seconds = {k: [] for k in runs}
    for _ in range(ROUNDS):
        for name, (argv, cwd) in runs.items():
            seconds[name].append(timed(argv, cwd))
    ref = np.array(seconds["fbt-probe --help"])
    rows = [
        {
            "command": k,
            "ms (median)": round(1e3 * float(np.median(v)), 1),
            "ratio to --help": round(float(np.median(np.array(v) / ref)), 3),
        }
        for k, v in seconds.items()
    ]
    print(table(rows, ["command", "ms (median)", "ratio to --help"]))
    write_json("startup", {"machine": machine(), "rounds": ROUNDS, "rows": rows})


if __name__ == "__main__":
    main()

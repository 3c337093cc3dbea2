"""After outputs became one transaction per command, do the README's promises hold on inputs
nobody listed? A third audit, by mechanism: every option of every registered analysis (read
from its options dataclass, so a new analysis is audited too) with values of the wrong kind,
range or file type; every artifact a command reads (probes, fit and intervention tables, a
tuned lens, seed rows, a dataset, a model folder, a feature-cache entry) damaged in six ways;
and an earlier run's outputs met again without ``--force``. Each case runs in this process
(``hardening_audit.run_cli``) in a scratch folder, with the work's limit at a millisecond, so
that an input that passes every check is refused where the work is priced instead of running.

    python research/hardening_audit_3.py [--json audit.json] [--only SUBSTRING]

A case falls short when it gives a traceback, more than one stderr line, a message that
names neither the option as spelled nor the file, or changes or leaves files. An input that
reaches the work (the pricing's refusal, or exit 0) is reported as accepted: a finding only
where the value should have been refused. The cases that found something are kept as tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import typing
from dataclasses import fields
from pathlib import Path

from hardening_audit import run_cli, snapshot

BAD = {  # values of the wrong kind or range, by the option's type
    int: ["-1", "-2147483649", "99999999999999", "abc", "1.5", "", "1e3", "0x10"],
    str: ["", " ", "nope", ",", "a,a", "\u00e9\u00e9", "x" * 300],
    Path: ["{missing}", "{dir}", "{empty}", "{garbage}", "{fifo}", "{under_file}", ""],
    list: ["", "nope"],
}
# the artifacts commands read, and the command that reads each (``{root}`` is the scratch folder)
ARTIFACTS = {
    "probes/probes.json": ["intervene", "--probes", "{res}", "-i", "erase_probe"],
    "probes/probes.safetensors": ["intervene", "--probes", "{res}", "-i", "erase_probe"],
    "probe_results.json": ["report", "--results", "{res}"],
    "probe_results.csv": ["plot", "--results", "{res}"],
    "interventions/interventions.csv": ["report", "--results", "{res}"],
    "interventions/interventions.json": ["report", "--results", "{res}"],
    "lens/lens.csv": ["plot", "--results", "{res}"],
    "lens/tuned_lens/tuned_lens.json": ["lens", "--tuned-lens", "{res}/lens/tuned_lens"],
    "lens/tuned_lens/translators.safetensors": ["lens", "--tuned-lens", "{res}/lens/tuned_lens"],
    "study/seed_rows.json": ["seeds", "merge", "{res}/study", "--out", "{root}/merged"],
    "d.parquet": ["fit", "--data", "{res}/d.parquet"],
    "m/config.json": ["eval", "--n-groups", "5", "--model", "{res}/m"],
    "m/model.safetensors": ["eval", "--n-groups", "5", "--model", "{res}/m"],
}
DAMAGE = ["empty", "half", "garbage", "a list", "nan", "a folder"]


def kind(annotation) -> type | None:
    origin = typing.get_origin(annotation)
    if origin is list:
        return list
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kind(args[0]) if args else None
    return annotation if annotation in (int, str, Path) else None


def base(verb: str, root: Path, without: str) -> list[str]:
    """A run of ``verb`` that works, less the option under test."""
    args = [verb, "--model", str(root / "m"), "--out", str(root / "new" / verb)]
    if verb != "stability":
        args += ["--data", str(root / "tw.parquet")]
    else:  # the default 1000 decoded tokens exceed the tiny model's context
        args += ["--decode-tokens", "8"]
    if verb in ("fit", "lens", "trajectory", "intervene", "heads"):
        args += ["--task", "delayed_memory"]
    drop = {
        without,
        "--model" if without == "--model" else "",
        "--data" if without == "--data" else "",
    }
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        out.append(a)
    return out


def option_cases(root: Path) -> list[tuple[str, list[str], str]]:
    from probes import ANALYSES

    cases = []
    for name, analysis in ANALYSES.items():
        hints = typing.get_type_hints(analysis.options_class)
        for f in fields(analysis.options_class):
            k = kind(hints[f.name])
            flag = (f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",))[0]
            if k is None or flag.startswith("--no-") or "/" in flag:
                continue
            for value in BAD[k]:
                v = value.format(**paths(root))
                cases.append(
                    (
                        f"{name} {flag} {value!r}",
                        [*base(name, root, flag), flag, v],
                        f"{flag}|{v}" if "/" in v else flag,
                    )
                )
    return cases


def paths(root: Path) -> dict:
    return {
        "missing": str(root / "missing" / "x"),
        "dir": str(root / "adir"),
        "empty": str(root / "empty.bin"),
        "garbage": str(root / "garbage.bin"),
        "fifo": str(root / "fifo"),
        "under_file": str(root / "garbage.bin" / "x"),
    }


def damage(path: Path, how: str) -> None:
    data = path.read_bytes() if path.is_file() else b""
    if how == "a folder":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.mkdir()
        return
    path.write_bytes(
        {
            "empty": b"",
            "half": data[: len(data) // 2],
            "garbage": os.urandom(200),
            "a list": b"[1, 2]",
            "nan": data.replace(b"0.", b"NaN", 3) if b"0." in data else b"NaN",
        }[how]
    )


def artifact_cases(root: Path) -> list[tuple[str, list[str], str, str, str]]:
    cases = []
    for rel, argv in ARTIFACTS.items():
        verb = argv[0]
        for how in DAMAGE:
            full = [a.format(root=root, res=root / "copy") for a in argv]
            if verb in ("intervene", "lens", "fit"):
                full += ["--model", str(root / "m"), "--out", str(root / "new" / verb)]
                if verb != "fit":
                    full += ["--data", str(root / "tw.parquet"), "--task", "delayed_memory"]
            file = root / "copy" / rel  # named by its path, or by its folder and its name
            cases.append(
                (f"{rel} {how} -> {verb}", full, f"{file}|{file.parent}&{file.name}", rel, how)
            )
    return cases


def names(line: str, culprit: str) -> bool:
    """Whether ``line`` names the culprit: any of its ``|`` alternatives, each a flag (as
    spelled, or its field name) or all of its ``&`` parts."""
    low = line.lower()
    for alt in culprit.split("|"):
        if all(p.lower() in low for p in alt.split("&")):
            return True
        if alt.startswith("--") and alt.lstrip("-").replace("-", "_") in low:
            return True
    return False


def outcome(argv: list[str], culprit: str, root: Path) -> str:
    before = snapshot(root)
    code, err, escaped = run_cli(argv)
    lines = err.strip().splitlines()
    if escaped is not None or "Traceback" in err:
        return f"SHORT traceback ({type(escaped).__name__}: {escaped})"
    left = [p for p in set(snapshot(root)) - set(before) if not p.startswith((".cache", "data/"))]
    changed = [p for p in before if p in snapshot(root) and snapshot(root)[p] != before[p]]
    if code == 0 or (lines and "would take about" in lines[-1]):
        return "accepted" + (f" (left {sorted(left)[:2]})" if left and code else "")
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"SHORT not one error line: {err.strip()[-200:]!r}"
    if not names(lines[0], culprit):
        return f"SHORT does not name {culprit}: {lines[0][:200]!r}"
    if left or changed:
        return f"SHORT left or changed files: {sorted(left + changed)[:3]}"
    return "refused"


def setup(root: Path) -> None:
    from typer.testing import CliRunner

    from cli import app
    from fbt_probe.checkpoint import save_model
    from fbt_probe.config import build_cfg
    from fbt_probe.stack import FBTModel
    from tasks.generate import generate_dataset

    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), root / "m")
    generate_dataset("delayed_memory", root / "d.parquet", n_groups=6, distractors=(1, 4), seed=2)
    generate_dataset(
        "delayed_memory", root / "tw.parquet", n_groups=6, distractors=(1, 4), seed=2, twins=True
    )
    (root / "adir").mkdir()
    (root / "empty.bin").write_bytes(b"")
    (root / "garbage.bin").write_bytes(os.urandom(100))
    os.mkfifo(root / "fifo")
    res, m, tw = root / "res", str(root / "m"), str(root / "tw.parquet")
    for argv in (
        ["fit", "-p", "standard,recurrent", "--no-controls", "--folds", "2", "--data", tw],
        [
            "intervene",
            "-p",
            "recurrent",
            "-i",
            "interchange_state",
            "--data",
            tw,
            "--task",
            "delayed_memory",
            "--out",
            str(res / "interventions"),
        ],
        ["lens", "-p", "k2", "--data", tw, "--task", "delayed_memory", "--out", str(res / "lens")],
    ):
        r = CliRunner().invoke(
            app, [*argv, "--model", m] + ([] if "--out" in argv else ["--out", str(res)])
        )
        assert r.exit_code == 0, r.output
    shutil.copytree(root / "m", res / "m")
    shutil.copy(root / "d.parquet", res / "d.parquet")
    study = Path(__file__).resolve().parents[1] / "figures" / "seeds" / "smear-ramp"
    (res / "study").mkdir()
    shutil.copy(study / "seed_rows.json", res / "study" / "seed_rows.json")


def audit(only: str = "") -> list[tuple[str, str]]:
    """(case, outcome) of every case whose name holds ``only``, run in a scratch folder."""
    import fbt_probe.runtime.budget as budget

    results, cwd, limit = [], os.getcwd(), budget.LIMIT_SECONDS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.chdir(root)  # whatever a command writes by default lands here, and is seen
        try:
            setup(root)
            budget.LIMIT_SECONDS = 1e-3  # an input that passes every check is refused at pricing
            for name, argv, culprit in option_cases(root):
                if only in name:
                    results.append((name, outcome(argv, culprit, root)))
                    shutil.rmtree(root / "new", ignore_errors=True)
            for name, argv, culprit, rel, how in artifact_cases(root):
                if only in name:
                    shutil.copytree(root / "res", root / "copy")
                    damage(root / "copy" / rel, how)
                    results.append((name, outcome(argv, culprit, root)))
                    for leftover in ("copy", "new", "merged"):
                        shutil.rmtree(root / leftover, ignore_errors=True)
        finally:
            budget.LIMIT_SECONDS = limit
            os.chdir(cwd)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every case and its outcome here")
    ap.add_argument("--only", default="", help="run only the cases whose name holds this")
    a = ap.parse_args()
    report = a.json.resolve() if a.json else None
    results = audit(a.only)
    counts: dict = {}
    for name, what in results:
        counts[what.split(" ")[0]] = counts.get(what.split(" ")[0], 0) + 1
        if what.startswith("SHORT") or (what.startswith("accepted") and "(" in what):
            print(f"{name}: {what}")  # noqa: T201 - a script's report
    print(f"{len(results)} cases: {counts}")  # noqa: T201
    if report:
        report.write_text(json.dumps([{"case": n, "outcome": w} for n, w in results], indent=1))


if __name__ == "__main__":
    main()

"""Does every bad input get what the README promises: a non-zero exit, one stderr line that
starts with "error:" and names the culprit, no traceback, no pre-existing file changed and
nothing new left on disk? This audit feeds the command line inputs a new user could type by
mistake, on surfaces the first audit (the refusal tests, tests/*/test_*refusals.py) did not reach: every setting
of a training recipe with values of the wrong kind or range (checked by `fbt-probe recipe`,
the same validation `train` runs before it makes its folder), and the options of the other
commands. Each case runs in this process (typer's CliRunner) in a scratch folder.

    python research/hardening_audit.py [--json audit.json] [--only SUBSTRING]

It prints one line per case that falls short and a count per kind; the cases that found
something are kept as tests in tests/probes/test_option_refusals.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from fbt_probe.train.recipes import load_recipe

# values of the wrong kind or range for a setting of each type
BAD = {
    int: ["-1", "abc", "1.5", "true", "[1]", "1e300"],
    float: ["NaN", "Infinity", "-Infinity", "abc", "[0.1]", "-1"],
    bool: ["maybe", "2", "[]"],
    str: ["[1]", "{}", "12"],
    list: ["5", "abc", "[NaN]", "[-1]", "[[1]]"],
}


def flat(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a config dict (schedule phases and their lists included)."""
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v and k != "task_params" and k != "tasks":
            out.update(flat(v, key))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def setting_cases() -> list[tuple[str, list[str], str]]:
    """(case, argv, the key the message must name) for every setting of the tiny recipe."""
    cases = []
    for key, value in flat(load_recipe("tiny").to_dict()).items():
        kind = bool if isinstance(value, bool) else type(value) if value is not None else int
        if kind is tuple:
            kind = list
        if key in ("name", "init_from") or kind not in BAD or key.endswith(".why"):
            continue
        for bad in BAD[kind]:
            cases.append(
                (
                    f"--set {key}={bad}",
                    ["recipe", "tiny", "--set", f"{key}={bad}"],
                    key.split(".")[-1],
                )
            )
    return cases


def option_cases(root: Path) -> list[tuple[str, list[str], str]]:
    """Bad values of the other commands' options (``root`` holds a model and a dataset)."""
    m, d = str(root / "m"), str(root / "d.parquet")
    gen = ["generate", "--task", "delayed_memory", "--out", str(root / "new.parquet")]
    fit = ["fit", "--model", m, "--data", d, "--out", str(root / "res")]
    ev = ["eval", "--model", m, "--task", "delayed_memory"]
    iv = ["intervene", "--model", m, "--task", "delayed_memory", "--out", str(root / "iv")]
    st = ["stability", "--model", m, "--task", "delayed_memory", "--out", str(root / "st")]
    st0 = [*st, "--decode-tokens", "0"]
    lens = ["lens", "--model", m, "--task", "delayed_memory", "--out", str(root / "ln")]
    tr = ["trajectory", "--model", m, "--task", "delayed_memory", "--out", str(root / "tj")]
    pa = ["patch", "--model", m, "--task", "delayed_memory", "--out", str(root / "pa")]
    he = ["heads", "--model", m, "--task", "delayed_memory", "--out", str(root / "he")]
    rows = [
        (gen, "--n-groups", ["0", "-3", "abc", "10000000000"]),
        (gen, "--distractors", ["", "-1", "300", "1-", "a,b", "5-2", "0,,1"]),
        (gen, "--seed", ["-1", "x"]),
        (gen, "--task", ["nope", "", "delayed_memory,done_tracking"]),
        (gen, "--tokenizer", [str(root / "missing"), d, str(root)]),
        (fit, "--folds", ["0", "1", "-2", "1000"]),
        (fit, "--prefill", ["nope", "k0", "k-1", "k", "standard,,recurrent", ""]),
        (fit, "--passes", ["0", "-1"]),
        (fit, "--probe", ["svm", ""]),
        (fit, "--site", ["nope", "blocks.99.hook_resid_pre", "resid@colon-999", "resid@colon+1"]),
        (fit, "--seed", ["-5"]),
        (fit, "--device", ["tpu", "cuda:x", "cuda:99"]),
        (fit, "--model", [str(root / "missing"), d, "meta-llama/Llama-3.2-1B"]),
        (fit, "--data", [str(root / "missing.parquet"), m, str(root / "m" / "meta.json")]),
        (ev, "--n-groups", ["0", "4", "-1"]),
        (ev, "--modes", ["nope", "", "standard,,full"]),
        (ev, "--seed", ["-1"]),
        (iv, "--intervention", ["nope", "", "self,,erase"]),
        (iv, "--seed", ["-1"]),
        (iv, "--probes", [str(root / "missing"), d]),
        (st0, "--prefill", ["k0", "k1001", "-2", "x", "full"]),
        (st0, "--passes", ["3"]),  # the old spelling, refused naming --prefill
        (st, "--decode-tokens", ["-1", "5000", "400"]),
        (lens, "--prefill", ["k0", "k17", "-1", "full"]),
        (lens, "--position", ["nope", ""]),
        (lens, "--tuned-lens", [str(root / "missing"), d]),
        (lens, "--batch-size", ["0"]),
        (lens, "--task", ["nope"]),
        (tr, "--prefill", ["standard", "k65", "k0"]),
        (tr, "--batch-size", ["0", "-4"]),
        (tr, "--data", [str(root / "missing.parquet")]),
        (pa, "--kinds", ["nope", ""]),
        (pa, "--pass", ["0", "-1", "99"]),
        (pa, "--depths", ["nope", "99", "-1", "1,,2"]),
        (pa, "--prefill", ["full", "nope", "k0"]),
        (pa, "--task", ["nope", "delayed_memory,done_tracking"]),
        (he, "--prefill", ["k0", "k17"]),
        (he, "--seed", ["-1"]),
        (he, "--data", [d]),  # a dataset without twins
    ]
    cases = []
    for base, opt, values in rows:
        for v in values:
            cases.append((f"{base[0]} {opt} {v!r}", [*base, opt, v], opt))
    return cases


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def run_cli(argv: list[str]) -> tuple[int, str, BaseException | None]:
    """``fbt-probe ARGV`` as the console script runs it (``cli.main``: usage errors become
    one line too), in this process: (exit code, stderr, an exception that escaped)."""
    import sys

    import cli

    runner, saved = CliRunner(), sys.argv
    with runner.isolation() as streams:
        sys.argv = ["fbt-probe", *argv]
        code, escaped = 0, None
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # noqa: BLE001 - what the audit looks for
            code, escaped = 1, e
        finally:
            sys.argv = saved
        err = streams[1].getvalue().decode()
    return code, err, escaped


def check(argv: list[str], needle: str, root: Path) -> str | None:
    """None if the promise holds for ``argv``, else what falls short."""
    before = snapshot(root)
    code, err, escaped = run_cli(argv)
    lines = err.strip().splitlines()
    if escaped is not None or "Traceback" in err:
        return f"traceback ({type(escaped).__name__}: {escaped})"
    if code == 0:
        return "accepted (exit 0)"
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"not one error line: {err.strip()[:160]!r}"
    name, value = needle.lstrip("-"), argv[-1]
    named = name.lower() in lines[0].lower() or name.replace("-", "_") in lines[0]
    if not named and not ("/" in value and value in lines[0]):  # a file is its own culprit
        return f"does not name {needle}: {lines[0][:160]!r}"
    if snapshot(root) != before:
        return "changed or left files"
    return None


def setup(root: Path) -> None:
    from fbt_probe.checkpoint import save_model
    from fbt_probe.config import build_cfg
    from fbt_probe.stack import FBTModel
    from tasks.generate import generate_dataset

    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), root / "m")
    generate_dataset("delayed_memory", root / "d.parquet", n_groups=6, distractors=(1, 4), seed=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every case and its outcome here")
    ap.add_argument("--only", default="", help="run only the cases whose name holds this")
    a = ap.parse_args()
    import os

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup(root)
        os.chdir(root)  # whatever a command writes by default lands here, and is seen
        cases = [c for c in setting_cases() + option_cases(root) if a.only in c[0]]
        results = [(name, check(argv, needle, root)) for name, argv, needle in cases]
    short = [(n, why) for n, why in results if why]
    for n, why in short:
        print(f"{n}: {why}")  # noqa: T201 - a script's report
    print(f"{len(results)} cases, {len(short)} fall short")  # noqa: T201
    if a.json:
        a.json.write_text(json.dumps([{"case": n, "short": why} for n, why in results], indent=1))


if __name__ == "__main__":
    main()

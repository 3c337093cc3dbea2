"""The shape of the code a newcomer reads: short functions, a thin CLI, one path for each idea."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("fbt_probe", "probes", "tasks", "cli.py")
MAX_FUNCTION_LINES = 60  # decorators and docstring included
# the analyses' verbs are generated from the registry, so the CLI holds only the verbs that
# are not analyses; each command's code after its docstring only parses, calls one library
# function and prints; each --help ends with an example (EXAMPLES)
MAX_CLI_LINES = 500
MAX_MODULE_LINES = 400
MAX_COMMAND_BODY = 20


def _python_files(*roots: str) -> list[Path]:
    out = []
    for r in roots:
        p = ROOT / r
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return out


def function_lengths() -> list[tuple[int, str]]:
    """(lines, where) of every function and method of the library, longest first."""
    rows = []
    for f in _python_files(*LIBRARY):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                where = f"{f.relative_to(ROOT)}:{node.lineno} {node.name}"
                rows.append((node.end_lineno - start + 1, where))
    return sorted(rows, reverse=True)


def test_no_library_function_is_longer_than_60_lines():
    rows = function_lengths()
    assert len(rows) > 300  # the walk found the library
    print("\nthe five longest functions:")
    for n, where in rows[:5]:
        print(f"  {n:3d}  {where}")
    too_long = [f"{where} ({n} lines)" for n, where in rows if n > MAX_FUNCTION_LINES]
    assert not too_long, "longer than 60 lines: " + ", ".join(too_long)


def test_the_cli_is_thin():
    text = (ROOT / "cli.py").read_text()
    lines = text.count("\n")
    assert lines <= MAX_CLI_LINES, f"cli.py has {lines} lines"
    bodies = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command"
            for d in node.decorator_list
        ):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            bodies[node.name] = body[-1].end_lineno - body[0].lineno + 1
    # the walk found the commands (the analyses' verbs are generated, not written here)
    assert {"generate", "train", "recipe", "seeds_run", "seeds_merge", "convert", "eval_", "plot",
            "reproduce", "view", "report"} <= set(bodies), sorted(bodies)  # fmt: skip
    fat = {k: n for k, n in bodies.items() if n > MAX_COMMAND_BODY}
    assert not fat, f"commands whose code passes {MAX_COMMAND_BODY} lines: {fat}"


def test_nothing_edits_sys_path_and_research_imports_the_package():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                            "*.py", "*.sh", "*.md"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    offenders = [f for f in files if (ROOT / f).is_file() and f != "tests/test_code_shape.py"
                 and "sys.path.insert" in (ROOT / f).read_text()]  # fmt: skip
    assert offenders == []
    readme = (ROOT / "research" / "README.md").read_text()
    for script in sorted((ROOT / "research").glob("*.*")):
        if script.name != "README.md":
            assert f"`{script.name}`" in readme, f"research/README.md does not list {script.name}"


def test_no_code_finds_a_position_axis_by_a_hooks_name():
    pattern = re.compile(r"""endswith\(["']hook_pattern["']\)""")
    found = [
        str(f.relative_to(ROOT)) for f in _python_files(*LIBRARY) if pattern.search(f.read_text())
    ]
    assert found == []


def test_the_prefill_words_are_read_in_one_function():
    # every other module asks fbt_probe.prefill.parse_prefill (or parse_prefills) for them
    word = re.compile(r"""==\s*["'](recurrent|full)["']|["'](recurrent|full)["']\s*==""")
    found = [str(f.relative_to(ROOT)) for f in _python_files(*LIBRARY)
             if word.search(f.read_text()) and f.name != "prefill.py"]  # fmt: skip
    assert found == []


def test_no_module_is_over_400_lines():
    long = {str(f.relative_to(ROOT)): n for f in _python_files("fbt_probe", "probes", "tasks")
            if (n := f.read_text().count("\n")) > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}


def test_every_registered_analysis_has_its_folder_test_file_and_docs_section():
    from probes import ANALYSES

    docs = (ROOT / "docs" / "analyses.md").read_text()
    assert len(ANALYSES) >= 7
    for name in ANALYSES:
        assert (ROOT / "probes" / name / "__init__.py").is_file(), f"probes/{name}/ is missing"
        assert (ROOT / "tests" / "probes" / f"test_{name}.py").is_file(), (
            f"tests/probes/test_{name}.py"
        )
        assert f"\n## {name}\n" in docs, f"docs/analyses.md has no section '## {name}'"


def test_no_module_sets_a_plotting_backend():
    found = [str(f.relative_to(ROOT)) for f in _python_files(*LIBRARY, "research", "bench")
             if "matplotlib.use(" in f.read_text()]  # fmt: skip
    assert found == []


def test_the_tests_mirror_the_packages_with_one_conftest():
    tests = ROOT / "tests"
    assert {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"} >= {
        "fbt_probe", "probes", "tasks"}  # fmt: skip
    assert [str(p.relative_to(tests)) for p in tests.rglob("conftest.py")] == ["conftest.py"]
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert set(flat) <= {"test_code_shape.py", "test_readme.py", "test_docs.py", "test_bench.py",
                         "test_hardening.py", "test_cli.py"}, flat  # fmt: skip


def test_every_verb_spells_and_counts_passes_one_way():
    """The number of Jacobi passes is --prefill on every verb that runs passes (the old
    --passes and -k are hidden and refused), and a pass named alone is counted from 1."""
    import click
    import typer

    from cli import app
    from probes.common.options import option_help

    root = typer.main.get_command(app)
    seen = {}

    def walk(group, words=()):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if hasattr(cmd, "commands"):
                walk(cmd, (*words, name))
            else:
                seen[" ".join((*words, name))] = cmd

    walk(root)
    assert len(seen) >= 18
    for verb, cmd in seen.items():
        for p in cmd.params:
            flags = set(getattr(p, "opts", ())) | set(getattr(p, "secondary_opts", ()))
            if flags & {"--passes", "-k"}:
                assert p.hidden, f"{verb} shows {flags & {'--passes', '-k'}}"
            if "--pass" in flags:  # an analysis's help is its options' docstrings
                docs = option_help(cmd.options) if getattr(cmd, "options", None) else {}
                assert "counted from 1" in (docs.get(p.name) or p.help or ""), verb
            if "--prefill" in flags:
                assert "-p" in flags, verb
    runs_passes = {"fit", "intervene", "lens", "trajectory", "patch", "heads", "stability", "view"}
    for verb in runs_passes:
        assert any("--prefill" in getattr(p, "opts", ()) for p in seen[verb].params), verb

"""The shape of the code a newcomer reads: short functions, a thin CLI, one path for each idea."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("fbt_probe", "probes", "tasks", "cli.py")
# Sizes count statements, not physical lines: the formatter owns the layout, so packing lines
# never meets a rule and splitting by concern is the only way to. A statement is one
# ``ast.stmt`` (a compound one counts once, its body's statements too); docstrings are free.
# The numbers are tighter than the physical caps they replace (60 and 400 lines, which
# packed lines had let hold up to 45 and 237 statements): a function over 40 was split by
# concern (one writer per part, one panel per function, one check per kind).
MAX_FUNCTION_STATEMENTS = 40
# the analyses' verbs are generated from the registry, so the CLI holds only the verbs that
# are not analyses; each command's code after its docstring only parses, calls one library
# function and prints; each --help ends with an example (EXAMPLES)
MAX_CLI_STATEMENTS = 200
MAX_MODULE_STATEMENTS = 250
MAX_COMMAND_STATEMENTS = 15


def _python_files(*roots: str) -> list[Path]:
    out = []
    for r in roots:
        p = ROOT / r
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return out


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def statements(nodes) -> int:
    """The statements in ``nodes`` and everything inside them, docstrings and bare string
    expressions (an option's help under its field) left out."""
    return sum(
        1
        for top in nodes
        for node in ast.walk(top)
        if isinstance(node, ast.stmt) and not _is_docstring(node)
    )


def function_sizes() -> list[tuple[int, str]]:
    """(statements, where) of every function and method of the library, largest first."""
    rows = []
    for f in _python_files(*LIBRARY):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{f.relative_to(ROOT)}:{node.lineno} {node.name}"
                rows.append((statements(node.body), where))
    return sorted(rows, reverse=True)


def test_statements_count_logical_lines_not_physical_ones():
    one = ast.parse(
        'def f():\n    """doc."""\n    x = g(1,\n          2)\n    if x:\n        return x\n'
    )
    assert statements(one.body[0].body) == 3  # the assignment, the if, the return


def test_no_library_function_has_more_than_40_statements():
    rows = function_sizes()
    assert len(rows) > 300  # the walk found the library
    print("\nthe five largest functions:")
    for n, where in rows[:5]:
        print(f"  {n:3d}  {where}")
    too_long = [f"{where} ({n})" for n, where in rows if n > MAX_FUNCTION_STATEMENTS]
    assert not too_long, f"more than {MAX_FUNCTION_STATEMENTS} statements: " + ", ".join(too_long)


def test_the_cli_is_thin():
    text = (ROOT / "cli.py").read_text()
    n = statements(ast.parse(text).body)
    assert n <= MAX_CLI_STATEMENTS, f"cli.py has {n} statements"
    bodies = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command"
            for d in node.decorator_list
        ):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            bodies[node.name] = statements(body)
    # the walk found the commands (the analyses' verbs are generated, not written here)
    assert {
        "generate",
        "train",
        "recipe",
        "seeds_run",
        "seeds_merge",
        "convert",
        "eval_",
        "plot",
        "reproduce",
        "view",
        "report",
    } <= set(bodies), sorted(bodies)
    fat = {k: n for k, n in bodies.items() if n > MAX_COMMAND_STATEMENTS}
    assert not fat, f"commands whose code passes {MAX_COMMAND_STATEMENTS} statements: {fat}"


def test_nothing_edits_sys_path_and_research_imports_the_package():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.sh", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    offenders = [
        f
        for f in files
        if (ROOT / f).is_file()
        and f != "tests/test_code_shape.py"
        and "sys.path.insert" in (ROOT / f).read_text()
    ]
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
    found = [
        str(f.relative_to(ROOT))
        for f in _python_files(*LIBRARY)
        if word.search(f.read_text()) and f.name != "prefill.py"
    ]
    assert found == []


def test_no_module_has_more_than_250_statements():
    big = {
        str(f.relative_to(ROOT)): n
        for f in _python_files("fbt_probe", "probes", "tasks")
        if (n := statements(ast.parse(f.read_text()).body)) > MAX_MODULE_STATEMENTS
    }
    assert big == {}


def test_the_formatter_owns_the_layout():
    """``ruff format --check`` passes on the whole tree, and the formatter's skip marker is kept for
    literal tables only: a marker on anything else is a line bent to pass a size rule."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    marker = re.compile(r"#\s*fmt:\s*skip\s*$", re.M)
    marked = {
        f: n
        for f in files
        if (ROOT / f).is_file() and (n := len(marker.findall((ROOT / f).read_text())))
    }
    assert sum(marked.values()) <= 20, marked
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    done = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


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
    found = [
        str(f.relative_to(ROOT))
        for f in _python_files(*LIBRARY, "research", "bench")
        if "matplotlib.use(" in f.read_text()
    ]
    assert found == []


def test_the_tests_mirror_the_packages_with_one_conftest():
    tests = ROOT / "tests"
    assert {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"} >= {
        "fbt_probe",
        "probes",
        "tasks",
    }
    assert [str(p.relative_to(tests)) for p in tests.rglob("conftest.py")] == ["conftest.py"]
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert set(flat) <= {
        "test_code_shape.py",
        "test_readme.py",
        "test_docs.py",
        "test_bench.py",
        "test_cli.py",
    }, flat


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


# ---- layering: each module imports only from its own layer or the layers below ----------
# the layers, lowest first; a module belongs to the layer of its longest matching prefix
LAYERS = (
    ("util", ("fbt_probe.util",)),
    ("runtime", ("fbt_probe.runtime",)),
    ("tasks", ("tasks",)),
    ("model", ("fbt_probe",)),
    ("hf/train", ("fbt_probe.hf", "fbt_probe.train", "fbt_probe.loading")),
    ("kernels", ("fbt_probe.kernels",)),
    ("analyses", ("probes",)),
    ("cli", ("cli",)),
)
OURS = ("fbt_probe", "tasks", "probes", "cli")
# what one analysis folder may import from probes: what they share, and the registry
SHARED = ("probes.common", "probes.analysis")


def layer_of(module: str) -> int:
    best = (-1, -1)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[1]:
                best = (i, len(p))
    return best[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every import of ours in ``path``, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OURS:
                found.append((node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names if a.name.split(".")[0] in OURS]
    return found


def test_every_module_imports_only_its_own_layer_or_lower():
    upward = []
    files = _python_files(*LIBRARY)
    for f in files:
        here = module_name(f)
        for target, _ in imports_of(f):
            if layer_of(target) > layer_of(here):
                upward.append(
                    f"{here} ({LAYERS[layer_of(here)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert len(files) > 100 and all(layer_of(module_name(f)) >= 0 for f in files)
    assert upward == []


def test_the_layer_rule_can_fail():
    assert layer_of("fbt_probe.util.files") < layer_of("tasks.vocab") < layer_of("fbt_probe.stack")
    assert layer_of("fbt_probe.stack") < layer_of("fbt_probe.hf.wrapper") < layer_of("probes.fit")
    assert layer_of("fbt_probe.kernels.lens") > layer_of("fbt_probe.train.loop")


def test_no_package_imports_one_that_imports_it_back():
    """Folders as packages (a package's own subfolders are part of it): no two import each
    other, directly or round a longer loop."""

    def package(module: str) -> str:
        path = ROOT / Path(*module.split("."))
        top = ".".join(module.split(".")[:2]) if path.is_dir() else module.rsplit(".", 1)[0]
        return top if "." in module else module

    edges: dict[str, set[str]] = {}
    for f in _python_files("fbt_probe", "tasks", "probes"):
        here = package(module_name(f))
        for target, names in imports_of(f):
            for t in (target, *(f"{target}.{n}" for n in names)):
                if (ROOT / Path(*t.split("."))).is_dir() or (
                    ROOT / Path(*t.split("."))
                ).with_suffix(".py").is_file():
                    there = package(t)
                    if there != here:
                        edges.setdefault(here, set()).add(there)

    def reaches(a: str, b: str, seen: set) -> bool:
        return any(
            n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ())
        )

    loops = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if reaches(b, a, {b}))
    assert "fbt_probe.kernels" in edges and loops == []


def test_no_analysis_imports_another():
    from probes import BUILTIN

    crossing = []
    for name in BUILTIN:
        for f in sorted((ROOT / "probes" / name).rglob("*.py")):
            for target, _ in imports_of(f):
                parts = target.split(".")
                if parts[0] == "probes" and len(parts) > 1 and parts[1] != name:
                    if not target.startswith(SHARED):
                        crossing.append(f"{f.relative_to(ROOT)} imports {target}")
    assert crossing == []


def test_no_private_name_crosses_a_module():
    private = [
        f"{f.relative_to(ROOT)} imports {target}.{n}"
        for f in _python_files(*LIBRARY)
        for target, names in imports_of(f)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


# ---- the module map in docs/design.md is the tree --------------------------------------
NAME = re.compile(r"^[\w.]+(\.py|\.js|/)$")
CHILD = re.compile(r"(?<![\w/.])(\w+\.(?:py|js))\b")  # a description names files, not folders
NAME_COLUMN = 18  # descriptions start here; a line indented this far continues the last entry


def map_entries(block: str) -> list[tuple[int, list[str], str]]:
    """(level, names, description) of each entry of the map: a line whose names start before
    the description column, with the lines that continue its description."""
    entries: list[list] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= NAME_COLUMN:
            entries[-1][2] += " " + line.strip()
            continue
        words = line.split()
        names = words if all(NAME.match(w) for w in words) else line[:NAME_COLUMN].split()
        entries.append([indent // 2, names, "" if names == words else line[NAME_COLUMN:]])
    return [tuple(e) for e in entries]


def mapped_paths(block: str) -> tuple[set[str], list[str]]:
    """(the paths the map names, the names it gives that no path has). A folder's entry names
    its children in its own column (nested entries) or in its description; a folder named
    implies its ``__init__.py``."""
    named, missing, parents = set(), [], {}
    for level, names, desc in map_entries(block):
        parent = parents.get(level - 1, "") if level else ""
        folders = [parent + n for n in names if n.endswith("/")]
        for n in names:
            path = parent + n.rstrip("/")
            named |= {path, path + "/__init__.py"} if n.endswith("/") else {path}
            if not (ROOT / path).exists():
                missing.append(path)
        parents[level] = folders[0] if len(folders) == 1 else ""
        for child in CHILD.findall(desc):
            found = [f + child for f in folders if (ROOT / f / child).exists()]
            named |= set(found)
            if folders and not found:
                missing.append(f"{' '.join(names)} {child}")
    return named, missing


def test_the_design_map_names_every_module_and_nothing_else():
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Module map", 1)[1].split("```")[1]
    named, missing = mapped_paths(block)
    modules = {
        str(p.relative_to(ROOT))
        for top in ("fbt_probe", "tasks", "probes")
        for p in (ROOT / top).rglob("*")
        if p.suffix in (".py", ".js") and "__pycache__" not in p.parts
    }
    assert len(modules) > 120
    assert missing == [], f"docs/design.md names what the tree lacks: {missing}"
    unmapped = sorted(modules - named)
    assert unmapped == [], f"docs/design.md's module map lacks: {unmapped}"


def test_the_map_check_can_fail():
    named, missing = mapped_paths(
        "fbt_probe/        x\n  nothere.py      y\n  kernels/        lens.py, gone.py, hf/\n"
    )
    assert "fbt_probe/kernels/lens.py" in named and "fbt_probe/nothere.py" in missing
    assert "kernels/ gone.py" in missing and "fbt_probe/stack.py" not in named


def runtime_imports(path: Path) -> set[str]:
    """The modules of ours ``path`` imports when it runs (inside functions too), leaving out
    what it imports for type checkers only (``if TYPE_CHECKING:``)."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m.split(".")[0] in OURS}


def module_cycles(paths: list[Path]) -> list[list[str]]:
    """The import cycles between modules (a module importing from its own package's
    ``__init__`` is not one: that is how a package offers its names)."""
    names = {module_name(f): f for f in paths}
    edges = {
        m: {t for t in runtime_imports(f) if t in names and t != m and not m.startswith(t + ".")}
        for m, f in names.items()
    }
    cycles, done = [], set()
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges[node]):
                if nxt == start and frozenset(path) not in done:
                    done.add(frozenset(path))
                    cycles.append(path)
                elif nxt not in path and nxt > start:
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_no_two_modules_import_each_other_when_they_run():
    cycles = module_cycles(_python_files("fbt_probe", "tasks", "probes"))
    assert cycles == [], [" -> ".join(c) for c in cycles]


def test_every_public_surface_names_each_name_once():
    import fbt_probe
    import probes
    import tasks

    for package in (fbt_probe, tasks, probes):
        names = list(package.__all__)
        assert len(names) == len(set(names)), package.__name__
        for name in names:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"

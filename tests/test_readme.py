"""The README is for users: short, and its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_is_at_most_150_lines_and_names_the_two_commands():
    text = README.read_text()
    assert text.count("\n") <= 150
    assert "bash scripts/reproduce.sh" in text and "bash scripts/test.sh" in text


def test_the_readmes_python_blocks_run_in_order(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes results/ where it runs
    blocks = python_blocks()
    assert len(blocks) >= 2
    scope: dict = {}
    for block in blocks:  # later blocks use what earlier ones defined, as a reader's session
        exec(compile(block, str(README), "exec"), scope)
    from tasks import vocab

    # the clean run answers the stored bit; zeroing the fed-back state at the colon in pass 2
    # changes that pass's logits there and nowhere before it
    labels = [vocab.TOKEN_TO_ID[ex.answer[0]] for ex in scope["examples"]]
    assert scope["out"].logits[:, -1].argmax(-1).tolist() == labels
    clean, patched = scope["out"].logits, scope["patched"].logits
    assert (clean[:, :-1] == patched[:, :-1]).all() and not (clean[:, -1] == patched[:, -1]).all()
    printed = capsys.readouterr().out
    assert str(labels) in printed and "delayed_memory: answer top-1 by pass" in printed
    assert (tmp_path / "results" / "trajectory" / "trajectory.csv").is_file()
    assert set(scope["result"].tables) == {"trajectory"}


def _commands(group, prefix=()):
    """(words, click command) of every leaf command under ``group`` (the analyses' verbs
    included: the group builds them when asked)."""
    import click

    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_help_ends_with_an_example_that_parses():
    import shlex

    import typer
    from typer.testing import CliRunner

    from cli import app

    root = typer.main.get_command(app)
    seen = []
    for words, cmd in _commands(root):
        got = CliRunner().invoke(app, [*words, "--help"], terminal_width=200)
        assert got.exit_code == 0, words
        last = got.output.strip().splitlines()[-1].strip()
        assert last.startswith("Example: fbt-probe " + " ".join(words)), (words, last)
        argv = shlex.split(last.removeprefix("Example: fbt-probe "))[len(words) :]
        # the example's options and values parse as the command declares them
        ctx = cmd.make_context(" ".join(words), argv)
        assert not ctx.args, (words, ctx.args)
        seen.append(" ".join(words))
    assert {"view", "report", "seeds run", "seeds merge", "fit", "steps", "loop"} <= set(
        seen
    ) and len(seen) == 21


def test_every_docs_page_with_figures_names_the_command_that_made_them():
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        if re.search(r"!\[[^\]]*\]\(", text):
            assert re.search(
                r"`(fbt-probe|python research/|python bench/|bash scripts/)[^`]*`", text
            ), page.name

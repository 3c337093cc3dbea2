"""The README is for users: short, and its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_is_at_most_150_lines_and_names_the_two_commands():
    text = README.read_text()
    assert text.count("\n") <= 150
    assert "bash scripts/reproduce.sh" in text and "bash scripts/test.sh" in text


def test_the_readmes_python_blocks_run_in_order(capsys):
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
    assert str(labels) in capsys.readouterr().out

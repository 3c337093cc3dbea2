"""mkdocs hooks for the docs site (mkdocs.yml names this file).

- The figures the pages show live in the repository's ``figures/``, outside ``docs/``: they
  are added to the site under ``figures/``, and a page's ``../figures/`` links point there.
- Each tutorial, a jupytext percent script ``docs/tutorials/NN_name.py``, becomes the page
  ``tutorials/NN_name.md``: its markdown cells as text, its code cells as code, and a link
  to the script and its paired notebook.
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"


def tutorial_markdown(script: Path) -> str:
    """The page of one tutorial script."""
    nb = jupytext.read(script)
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(cell.source)
        elif cell.source.strip():
            parts.append(f"```python\n{cell.source}\n```")
    links = (
        f"*Run it:* `python docs/tutorials/{script.name}`, or open "
        f"[the notebook]({script.stem}.ipynb) in Jupyter."
    )
    first, _, rest = "\n\n".join(parts).partition("\n")
    return f"{first}\n\n{links}\n{rest}\n"


def on_files(files, config):
    for png in sorted((ROOT / "figures").rglob("*.png")):
        files.append(
            File(
                str(png.relative_to(ROOT)),
                str(ROOT),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    for script in sorted(TUTORIALS.glob("[0-9]*.py")):
        files.append(
            File.generated(config, f"tutorials/{script.stem}.md", content=tutorial_markdown(script))
        )
    return files


def on_page_markdown(markdown, page, config, files):
    # a link n levels up to figures/ from docs/ (n = the page's depth + 1) is figures/ at the
    # site's root, one level less up
    depth = page.file.src_uri.count("/")

    def fix(m):
        ups = len(m.group(2)) // 3
        return m.group(1) + "../" * (ups - 1) + "figures/" if ups == depth + 1 else m.group(0)

    return re.sub(r"(\]\()((?:\.\./)+)figures/", fix, markdown)

"""Merge seed studies of one recipe, run in parts (other seeds later, or on another machine),
into one table and figure: each STUDY is a folder `fbt-probe train --seeds` wrote (or a copy
of its `seed_rows.json`, as under `figures/seeds/`), and OUT receives the merged
`seed_table.csv`, `seed_table.md`, `seed_rows.json` and `seeds.png`, the seeds in order.

    python scripts/merge_seeds.py --out figures/seeds/smear-ramp figures/seeds/smear-ramp runs/seeds-ramp13

A seed in two studies must have the same row in both. Where a study still holds its seeds'
run folders (`seed-<s>/train_config.json`), their recipes must agree but for the seed and the
name; rows without a run folder are taken as they are, and the script says which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_rows(study: Path) -> dict[int, dict]:
    """A study's rows, seed -> row, from its ``seed_rows.json``."""
    path = study / "seed_rows.json"
    if not path.is_file():
        raise ValueError(f"{study}: no seed_rows.json (is it a folder `train --seeds` wrote?)")
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
        raise ValueError(f"{path}: not a study's rows (seed -> measured row)")
    try:
        return {int(s): r for s, r in rows.items()}
    except ValueError:
        raise ValueError(f"{path}: a key is not a seed number") from None


def recipe_of(study: Path, seed: int):
    """The seed's ``probes.seeds.recipe_key``, or None where no run folder is kept."""
    from fbt_probe.train import saved_train_config
    from probes.seeds import recipe_key

    run = study / f"seed-{seed}"
    if not (run / "train_config.json").is_file():
        return None
    return recipe_key(saved_train_config(run))


def merge(studies: list[Path]) -> tuple[dict[int, dict], list[str]]:
    """The merged rows and the ``study/seed`` entries whose recipe could not be checked."""
    rows: dict[int, dict] = {}
    where: dict[int, Path] = {}
    recipe, recipe_from, unchecked = None, None, []
    for study in studies:
        for s, row in load_rows(study).items():
            if s in rows and rows[s] != row:
                raise ValueError(f"seed {s} has different rows in {where[s]} and {study}")
            rows[s], where[s] = row, where.get(s, study)
            r = recipe_of(study, s)
            if r is None:
                unchecked.append(f"{study}/seed-{s}")
            elif recipe is None:
                recipe, recipe_from = r, f"{study}/seed-{s}"
            elif r != recipe:
                raise ValueError(
                    f"{study}/seed-{s} was trained with another recipe than {recipe_from}"
                )
    if not rows:
        raise ValueError("the studies hold no seed")
    return rows, unchecked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="folders holding seed_rows.json")
    ap.add_argument("--out", type=Path, required=True, help="folder for the merged study")
    a = ap.parse_args(argv)
    from probes.seeds import write_study

    try:
        rows, unchecked = merge(a.studies)
        write_study(rows, a.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if unchecked:
        print(f"recipe not checked (no run folder): {', '.join(unchecked)}")
    print((a.out / "seed_table.md").read_text(), end="")
    print(f"wrote {a.out}/seed_table.md, seed_table.csv, seed_rows.json, seeds.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write the fresh initial weights of a recipe's seed as a model folder, optionally with some
parameters taken from another seed's fresh weights, so that training can separate what a seed
draws: `fbt-probe train --set run.seed=D --init-from DIR` trains seed D's data, jitter and
pass draws from the weights this writes. With `--from-seed B --params W_E` the folder holds
seed A's initial weights with seed B's token embedding: whether a seed's result follows its
initial weights (and which of them) or its data order.

    python scripts/init_mix.py --seed 1 --out /tmp/init-1                         # seed 1 as is
    python scripts/init_mix.py --seed 1 --from-seed 0 --params W_E --out /tmp/mix  # W_E of seed 0
    fbt-probe train --set run.seed=1 --init-from /tmp/mix --stop-after 1150 --out /tmp/run
    python scripts/binding_heads.py /tmp/run/model --n-groups 24

`--params` takes parameter-name prefixes, comma-separated (`W_E`, `blocks.0.`, `blocks.1.attn.`,
`fusion.`); each must name at least one parameter. The folder's weights with no `--from-seed`
are bit for bit those `fbt-probe train --set run.seed=A` starts from, so training from it is
that run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fbt_probe.checkpoint import save_model  # noqa: E402
from fbt_probe.model import FBTModel  # noqa: E402
from fbt_probe.recipes import load_recipe  # noqa: E402


def mixed_init(recipe: str, seed: int, from_seed: int | None = None, params: tuple[str, ...] = ()):
    """Seed ``seed``'s fresh model of ``recipe``; the parameters whose names start with one of
    ``params`` are seed ``from_seed``'s. Returns the model and the names taken over."""
    cfg = load_recipe(recipe)
    model = FBTModel(cfg.model, seed=seed)
    if from_seed is None:
        if params:
            raise ValueError("--params needs --from-seed")
        return model, []
    if not params:
        raise ValueError("--from-seed needs --params (which parameters to take from it)")
    other = FBTModel(cfg.model, seed=from_seed).state_dict()
    state = model.state_dict()
    taken = []
    for prefix in params:
        names = [n for n in state if n.startswith(prefix)]
        if not names:
            raise ValueError(f"--params {prefix!r} names no parameter of the model")
        taken += [n for n in names if n not in taken]
    for n in taken:
        state[n] = other[n].clone()
    model.load_state_dict(state)
    return model, taken


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="default", help="built-in recipe or recipe file")
    ap.add_argument("--seed", type=int, required=True, help="the seed whose weights are written")
    ap.add_argument("--from-seed", type=int, default=None, help="the seed --params come from")
    ap.add_argument("--params", default="", help="parameter-name prefixes, comma-separated")
    ap.add_argument("--out", required=True, help="model folder to write (must not exist)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        if out.exists():
            raise ValueError(f"--out {out} exists")
        params = tuple(p for p in a.params.split(",") if p)
        model, taken = mixed_init(a.recipe, a.seed, a.from_seed, params)
        save_model(model, out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f", {len(taken)} tensors from seed {a.from_seed}" if taken else ""
    print(f"wrote {out}: seed {a.seed} of {a.recipe}{what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

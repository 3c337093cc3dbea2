"""Write the fresh initial weights of a recipe's seed as a model folder, optionally with some
parameters taken from another seed's fresh weights, so that training can separate what a seed
draws: `fbt-probe train --set run.seed=D --init-from DIR` trains seed D's data, jitter and
pass draws from the weights this writes. With `--from-seed B --params W_E` the folder holds
seed A's initial weights with seed B's token embedding: whether a seed's result follows its
initial weights (and which of them) or its data order.

    python research/init_mix.py --seed 1 --out /tmp/init-1                         # seed 1 as is
    python research/init_mix.py --seed 1 --from-seed 0 --params W_E --out /tmp/mix  # W_E of seed 0
    fbt-probe train --set run.seed=1 --init-from /tmp/mix --stop-after 1150 --out /tmp/run
    python research/binding_heads.py /tmp/run/model --n-groups 24
    python research/init_mix.py --seed 1 --from-seed 0 --tokens distractors --out /tmp/mix2  # rows

`--params` takes parameter-name prefixes, comma-separated (`W_E`, `blocks.0.`,
`blocks.1.attn.`, `fusion.`); each must name at least one parameter. `--tokens` instead takes
only some rows of the token embedding from the other seed: token names or groups,
comma-separated (`RA,RB`, `registers`, `values`, `counts`, `distractors`, `syntax`; `not:`
before the list takes every other row), to find the tokens whose initial embedding decides an
outcome. The folder's weights with no `--from-seed` are bit for bit those `fbt-probe train
--set run.seed=A` starts from, so training from it is that run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fbt_probe.checkpoint import save_model
from fbt_probe.stack import FBTModel
from fbt_probe.train.recipes import load_recipe
from tasks import vocab

GROUPS = {
    "registers": vocab.REGISTERS,
    "values": vocab.VALUES,
    "counts": vocab.COUNTS,
    "distractors": vocab.DISTRACTORS,
    "syntax": (
        vocab.PAD,
        vocab.BOS,
        vocab.COLON,
        vocab.SET,
        vocab.ZERO,
        vocab.ONE,
        vocab.NEED,
        vocab.STEP,
        vocab.DONE,
        vocab.MORE,
    ),
}


def token_rows(spec: str) -> list[int]:
    """The W_E rows ``--tokens`` names: tokens and groups, comma-separated, ``not:`` inverts."""
    invert = spec.startswith("not:")
    ids: list[int] = []
    for name in (spec[4:] if invert else spec).split(","):
        name = name.strip()
        words = GROUPS.get(name, (name,) if name else ())
        for w in words:
            if w not in vocab.TOKEN_TO_ID:
                raise ValueError(
                    f"--tokens {name!r} is neither a token nor a group ({', '.join(GROUPS)})"
                )
            ids.append(vocab.TOKEN_TO_ID[w])
    if not ids:
        raise ValueError("--tokens names no token")
    chosen = sorted(set(ids))
    return [i for i in range(vocab.VOCAB_SIZE) if i not in chosen] if invert else chosen


def mixed_init(
    recipe: str,
    seed: int,
    from_seed: int | None = None,
    params: tuple[str, ...] = (),
    rows: list[int] | None = None,
):
    """Seed ``seed``'s fresh model of ``recipe``; the parameters whose names start with one of
    ``params`` (or only the W_E ``rows``) are seed ``from_seed``'s. Returns the model and the
    names taken over."""
    cfg = load_recipe(recipe)
    model = FBTModel(cfg.model, seed=seed)
    if from_seed is None:
        if params or rows:
            raise ValueError("--params and --tokens need --from-seed")
        return model, []
    if params and rows:
        raise ValueError("give --params or --tokens, not both")
    if not params and not rows:
        raise ValueError("--from-seed needs --params or --tokens (what to take from it)")
    other = FBTModel(cfg.model, seed=from_seed).state_dict()
    state = model.state_dict()
    if rows:
        state["W_E"][rows] = other["W_E"][rows]
        model.load_state_dict(state)
        return model, [f"W_E[{len(rows)} rows]"]
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
    ap.add_argument(
        "--tokens", default="", help="only these rows of W_E: tokens or groups, comma-separated"
    )
    ap.add_argument("--out", required=True, help="model folder to write (must not exist)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        if out.exists():
            raise ValueError(f"--out {out} exists")
        params = tuple(p for p in a.params.split(",") if p)
        rows = token_rows(a.tokens) if a.tokens else None
        model, taken = mixed_init(a.recipe, a.seed, a.from_seed, params, rows)
        save_model(model, out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f", {', '.join(taken) if rows else f'{len(taken)} tensors'} from seed {a.from_seed}"
    what = what if taken else ""
    print(f"wrote {out}: seed {a.seed} of {a.recipe}{what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

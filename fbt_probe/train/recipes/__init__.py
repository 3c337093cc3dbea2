"""Named training recipes, one TOML file each in this folder, and recipe files of your own.

A recipe file holds only what it changes. ``base`` names what it changes: a built-in recipe
or another file (default: the ``default`` recipe; ``"none"`` = the code defaults of
``TrainConfig``). Groups (``[optim]``, ``[model]``, ...) merge key by key into the base's;
every other value, the ``schedule`` included, replaces the base's. A quoted dotted key
(``"schedule.2.passes" = [...]``) changes one item, as ``--set`` does.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from fbt_probe.train.config import GROUPS, TrainConfig, refuse_flat, set_path
from fbt_probe.train.schedule import table

RECIPE_DIR = Path(__file__).resolve().parent


def recipe_names() -> list[str]:
    """The built-in recipes, ``default`` first."""
    names = sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))
    return sorted(names, key=lambda n: (n != "default", n.lower()))


def read_file(path: Path) -> dict:
    """A recipe or config file (TOML or JSON) as a dict; a one-line error if it isn't one."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a recipe or config file")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file (a recipe is TOML or JSON)") from None
    try:
        d = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold an object of config keys, not {type(d).__name__}")
    return d


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for k, v in change.items():
        if k in GROUPS and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def resolve(d: dict, name: str, seen: tuple[str, ...] = ()) -> TrainConfig:
    """The config that recipe dict ``d`` (named ``name``) describes, its base applied;
    ``seen`` holds the files already on the way here (a cycle of bases is an error)."""
    refuse_flat(d, f"recipe {name}")
    d = dict(d)
    base = d.pop("base", "default")
    if not isinstance(base, str):
        raise ValueError(f"{name}: base must be a recipe name or a file, got {base!r}")
    if base == "none":
        base_dict = TrainConfig().to_dict()
    else:
        base_dict = load_recipe(base, seen).to_dict()
    merged = _merge(base_dict, {k: v for k, v in d.items() if "." not in k})
    merged["name"] = d.get("name", name)
    for k, v in d.items():
        if "." in k:
            set_path(merged, k, v)
    try:
        return TrainConfig.from_dict(merged)
    except ValueError as e:
        raise ValueError(f"recipe {name}: {e}") from None


def load_recipe(spec: str, seen: tuple[str, ...] = ()) -> TrainConfig:
    """A built-in recipe by name, or a recipe/config file (``.toml`` or ``.json``)."""
    builtin = RECIPE_DIR / f"{spec}.toml"
    path = builtin if "/" not in spec and builtin.is_file() else Path(spec)
    if path is builtin or path.suffix in (".toml", ".json") or path.exists():
        ident = str(path.resolve())
        if ident in seen:
            raise ValueError(f"recipe {spec}: its bases form a cycle")
        name = spec if path is builtin else path.stem
        return resolve(read_file(path), name, (*seen, ident))
    raise ValueError(
        f"unknown config {spec!r}; choose from {', '.join(recipe_names())} or a .toml/.json file"
    )


def named_config(name: str) -> TrainConfig:
    """A built-in recipe by name (one of ``recipe_names()``)."""
    if not (RECIPE_DIR / f"{name}.toml").is_file() or "/" in name:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(recipe_names())}")
    return load_recipe(name)


def parse_overrides(items: list[str] | None) -> dict:
    """``--set key=value`` pairs; values parsed as JSON when they can be (numbers, lists, true)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def build_recipe(
    *,
    config: str | None = None,
    overrides: list[str] | None = None,
    init_from: str | Path | None = None,
    run_dir: Path | None = None,
) -> TrainConfig:
    """The recipe a command trains: ``config`` (a name or a file; default 'default', or the
    recipe ``run_dir`` was started with when it has one), ``--set`` ``overrides`` applied,
    and ``init_from`` a model folder to start from."""
    if config is None:
        own = Path(run_dir) / "train_config.json" if run_dir is not None else None
        config = str(own) if own is not None and own.is_file() else "default"
    cfg = load_recipe(config).with_overrides(parse_overrides(overrides))
    if init_from is not None:
        if not Path(init_from).is_dir():
            raise ValueError(
                f"--init-from {init_from}: no such model folder (nothing is downloaded)"
            )
        cfg = cfg.with_overrides({"init_from": str(init_from)})
    return cfg


def describe(
    *,
    config: str | None = None,
    overrides: list[str] | None = None,
    init_from: str | Path | None = None,
    cost: bool = False,
    world_size: int = 8,
) -> str:
    """``fbt-probe recipe``: the resolved recipe (JSON) and its phase table, or with ``cost``
    its parameter count, FLOPs per token and memory per rank over ``world_size`` ranks (the
    model built on the meta device: nothing allocated, nothing trained)."""
    cfg = build_recipe(config=config, overrides=overrides, init_from=init_from)
    if cost:
        from fbt_probe.train.costs import dry_run

        return dry_run(cfg, world_size)

    return json.dumps(cfg.to_dict(), indent=2) + "\n\n" + table(cfg.schedule)

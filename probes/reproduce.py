"""``fbt-probe reproduce``: the whole job on the built-in default model, optionally retrained
first: fit (every task, prefill and control) -> plot -> a default intervention battery ->
lens and trajectory on delayed_memory -> report (report.md and report.html) and a view page of
two examples (view.html)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

# reproduce --train keeps the whole job near 20 minutes, about twice what the default's
# 2 300 steps take on 2 CPU cores (docs/training.md): a machine half as fast still finishes
TRAIN_MINUTES = 19.5
# the paper's one-step probe setting on delayed_memory, and the exact recurrence, what
# inference computes, on done_tracking
BATTERY = (("delayed_memory", "recurrent"), ("done_tracking", "full"))


def retrain_default(argv=None, bars=None) -> None:
    """Train the default recipe into runs/default-<time> and install it as the default; a run
    that stops at ``TRAIN_MINUTES`` is refused with what to do next."""
    from fbt_probe.recipes import named_config
    from fbt_probe.registry import install_default
    from fbt_probe.train import train

    cfg = named_config("default")
    run_dir = Path("runs") / f"default-{time.strftime('%Y%m%d-%H%M%S')}"
    with bars("train default", cfg.steps) if bars else nullcontext() as bar:
        metrics = train(cfg, run_dir, progress=bar, argv=argv, max_minutes=TRAIN_MINUTES)
    if not metrics["finished"]:
        raise ValueError(
            f"training stopped after {TRAIN_MINUTES:g} minutes at step "
            f"{metrics['steps_done']}/{cfg.steps}; finish it with 'fbt-probe train --out "
            f"{run_dir} --resume --as-default', then rerun 'fbt-probe reproduce'"
        )
    install_default(run_dir)


def reproduce(*, out: str | Path = "results", train_first: bool = False, argv=None,
              bars=None) -> list[str]:  # fmt: skip
    """Run the job into ``out``; ``bars(label, total)`` makes progress bars. Returns the
    lines to report: the layer-0 table, the decodable-vs-used verdicts, what was written."""
    from fbt_probe.registry import resolve_model
    from probes.intervene import run_intervene
    from probes.intervene_plot import plot_interventions
    from probes.lens_run import lens as run_lens
    from probes.plot import plot_all
    from probes.report import headline, write_report
    from probes.results import format_layer0, layer0_table
    from probes.run import run_fit
    from probes.trajectory_run import trajectory as run_trajectory
    from probes.view import view
    from tasks.files import check_output_dir

    out = Path(out)
    check_output_dir(out)
    t0 = time.monotonic()
    if train_first:
        retrain_default(argv, bars)
    model, name = resolve_model("default")
    with bars("fit", 1) if bars else nullcontext() as bar:
        df = run_fit(model, name, out_dir=out, progress=bar)
    plot_all(out)
    with bars("intervene", 1) if bars else nullcontext() as bar:
        iv = run_intervene(model, name, list(BATTERY), out / "interventions", probes_dir=out,
                           progress=bar)  # fmt: skip
    plot_interventions(iv, out / "interventions" / "figures")
    anatomy = []
    for label, run in (("lens", run_lens), ("trajectory", run_trajectory)):
        with bars(label, 1) if bars else nullcontext() as bar:
            anatomy += run(task="delayed_memory", out=out / label, progress=bar)[1][:-1]
    report = write_report(out)
    page, _ = view(
        probes=out, out=out / "view.html"
    )  # two examples, the probes and tuned lens above
    lines = [
        format_layer0(layer0_table(df, model.entry_depth)),
        "",
        "Decodable vs used (fbt-probe intervene):",
    ]
    lines += [f"  {headline(iv, t, p)}" for t, p in BATTERY]
    lines += ["", "Feedback anatomy (fbt-probe lens, trajectory):"] + [f"  {a}" for a in anatomy]
    lines += ["", f"wrote {out / 'probe_results.csv'}, {out / 'interventions' / 'interventions.csv'}, "
              f"figures in {out / 'figures'}, report {report} and {report.with_suffix('.html')}, "
              f"examples {page} "
              f"({time.monotonic() - t0:.0f} s)"]  # fmt: skip
    return lines

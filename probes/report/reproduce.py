"""``fbt-probe reproduce``: the whole job on the built-in default model, optionally retrained
first: every registered analysis with reproduce options (fit with its figures, a battery of
interventions, lens, trajectory, patch, heads, stability), then report.md, report.html and a
view page of two examples (view.html)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from fbt_probe.loading import install_default, resolve_model
from fbt_probe.train.loop import train
from fbt_probe.train.recipes import named_config
from fbt_probe.util.files import check_output_dir
from fbt_probe.util.transaction import earlier_run, existing_outputs, transaction
from probes.analysis import ANALYSES, resolve
from probes.report.markdown import OUTPUTS as REPORTS
from probes.report.markdown import write_report
from probes.report.view import view

# reproduce --train keeps the whole job near 20 minutes, about twice what the default's
# 2 300 steps take on 2 CPU cores (docs/training.md): a machine half as fast still finishes
TRAIN_MINUTES = 19.5


def retrain_default(argv=None, bars=None) -> None:
    """Train the default recipe into runs/default-<time> and install it as the default; a run
    that stops at ``TRAIN_MINUTES`` is refused with what to do next."""
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


def earlier_outputs(out: Path) -> list[Path]:
    """What an earlier reproduce (or a verb it runs) left in ``out`` that this one writes."""
    found = existing_outputs(out, (*REPORTS, "view.html"))
    for analysis in ANALYSES.values():
        if analysis.reproduce is not None:
            found += existing_outputs(out / analysis.folder, analysis.outputs)
    return found


def step(analysis, model, name: str, out: Path, progress=None, force: bool = False) -> list[str]:
    """``analysis`` run as reproduce runs it, into ``out/<its folder>``: its ``reproduce``
    options on the loaded ``model``, or its own reproduce function ``(model, name, results,
    into, progress)`` writing into ``into``, a staging folder (``transaction``); returns its
    findings."""
    if not isinstance(analysis.reproduce, dict):
        with transaction(out / analysis.folder, analysis.outputs, force=force) as stage:
            return resolve(analysis.reproduce)(model, name, out, stage, progress)
    options = replace(analysis.options_class(), out=out / analysis.folder, **analysis.reproduce)
    lines = analysis(model=model, options=options, progress=progress, force=force).lines
    return [f"  {line}" for line in lines if not line.startswith("wrote ")]


def reproduce(
    *,
    out: str | Path = "results",
    train_first: bool = False,
    argv=None,
    bars=None,
    force: bool = False,
) -> list[str]:
    """Run the job into ``out``: every registered analysis that has reproduce options, in
    the order they were registered, then report.md, report.html and view.html;
    ``bars(label, total)`` makes progress bars; an earlier run's outputs in ``out`` are
    replaced only with ``force``. Returns the lines to report."""
    out = Path(out)
    check_output_dir(out)
    found = [] if force else earlier_outputs(out)
    if found:  # refused before any work, not at the step that would write over it
        raise FileExistsError(earlier_run(found))
    t0 = time.monotonic()
    if train_first:
        retrain_default(argv, bars)
    model, name = resolve_model("default")
    lines = []
    for analysis in ANALYSES.values():
        if analysis.reproduce is None:
            continue
        with bars(analysis.name, 1) if bars else nullcontext() as bar:
            found = step(analysis, model, name, out, bar, force)
        if found:
            lines += [f"{analysis.name}:", *found, ""]
    report = write_report(out, force=force)
    pages = [report, report.with_suffix(".html")]
    if (out / "probes").is_dir():  # two examples, with the fit's probes and the tuned lens
        pages.append(view(probes=out, out=out / "view.html", force=force)[0])
    lines.append(
        f"wrote {', '.join(map(str, pages))} from the results in {out} "
        f"({time.monotonic() - t0:.0f} s)"
    )
    return lines

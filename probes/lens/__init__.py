"""``lens``: what each (pass, depth) says, through the logit and tuned lenses."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

LENS = register_analysis(Analysis(
    name="lens",
    options="probes.lens.options:LensOptions",
    run="probes.lens.run:run",
    help="What does each (pass, depth) say? The logit and tuned lenses at the colon and the "
    "fed-back state through the head: KL to the last pass's output, the answer's probability and rank.",
    example="fbt-probe lens --task delayed_memory --prefill k3",
    folder="lens",
    section="probes.lens.report:section",
    figures="probes.lens.plot:figures",
    moved={"--passes": "--prefill k<N>", "-k": "--prefill k<N>"},
    reproduce={"task": "delayed_memory"},
))  # fmt: skip

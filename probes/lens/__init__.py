"""``lens``: what each (pass, depth) says, through the logit and tuned lenses."""

from __future__ import annotations

from probes.analysis import PASSES_MOVED, Analysis, register_analysis

LENS = register_analysis(
    Analysis.of_folder(
        "probes.lens",
        help="What does each (pass, depth) say? The logit and tuned lenses at the colon and the "
        "fed-back state through the head: KL to the last pass's output, the answer's probability and rank.",
        example="fbt-probe lens --task delayed_memory --prefill k3",
        moved=PASSES_MOVED,
        reproduce={"task": "delayed_memory"},
        outputs=("lens.csv", "lens.json", "tuned_lens", "figures/lens_*"),
    )
)

"""``attribute``: every site's patching effect estimated from gradients, through every pass,
and checked against exact patches of a sample of its sites."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

ATTRIBUTE = register_analysis(
    Analysis.of_folder(
        "probes.attribute",
        help="Attribution patching through the feedback loop: every residual, head, fed-back state "
        "and q/k/v path of every pass scored from one backward pass (AtP*), edges between components, "
        "and an exact patch of a sample of sites that says how far to trust it.",
        example="fbt-probe attribute --task delayed_memory --prefill recurrent --check 40",
        reproduce={"task": "delayed_memory", "groups": 16},
        outputs=("attribution.csv", "attribution.json", "edges.csv", "figures/attribution_*"),
    )
)

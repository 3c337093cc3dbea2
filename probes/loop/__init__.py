"""``loop``: closed-loop interventions while the model generates."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

LOOP = register_analysis(
    Analysis.of_folder(
        "probes.loop",
        help="Does the rest of a generation follow the fed-back state or the visible tokens? At "
        "each generated step, swap the fed-back state, the token's embedding or both for a twin's "
        "and keep generating: which run the tokens follow, where they diverge, and the normalised "
        "logit difference at every later step.",
        example="fbt-probe loop --task count_steps --modes soft,fused --kinds state,token",
        outputs=("loop.csv", "loop.json", "figures/loop_*"),
    )
)

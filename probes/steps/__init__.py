"""``steps``: the task state at every depth of every generated step, while the model generates."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

STEPS = register_analysis(
    Analysis.of_folder(
        "probes.steps",
        help="Is the task state carried from step to step while the model generates? Probes (with "
        "fit's grouped CV and controls) and the logit lens at every depth of every generated step, "
        "per decoding mode, and the answers by distractor count and answer length.",
        example="fbt-probe steps --task count_steps --modes standard,fused",
        outputs=("steps.csv", "steps.json", "figures/steps_*"),
    )
)

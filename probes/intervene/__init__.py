"""``intervene``: is the decodable state used? Interchange, ablate, erase and steer it at the
colon against each example's counterfactual twin."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

INTERVENE = register_analysis(
    Analysis.of_folder(
        "probes.intervene",
        help="Is the decodable state used? Interchange, ablate, erase and steer it at the colon, "
        "against each example's counterfactual twin; writes a CSV with bootstrap intervals and figures.",
        example="fbt-probe intervene --task done_tracking --prefill full --intervention interchange_state",
        folder="interventions",
        reproduce="probes.intervene.run:reproduce",
        outputs=(
            "interventions.csv",
            "interventions.json",
            "figures/interchange_*",
            "figures/depth_*",
            "figures/steering_*",
        ),
    )
)

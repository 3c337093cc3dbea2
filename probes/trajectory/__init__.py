"""``trajectory``: how the states move over passes."""

from __future__ import annotations

from probes.analysis import PASSES_MOVED, Analysis, register_analysis

TRAJECTORY = register_analysis(
    Analysis.of_folder(
        "probes.trajectory",
        help="How do the states move over passes? Distance to the last pass by position, the answer "
        "position's states on two principal components, answer flips by count, the fusion's gate.",
        example="fbt-probe trajectory --task delayed_memory --prefill k8",
        moved=PASSES_MOVED,
        reproduce={"task": "delayed_memory"},
        outputs=("trajectory.csv", "trajectory_pca.csv", "trajectory.json", "figures/trajectory_*"),
    )
)

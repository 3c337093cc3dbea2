"""``trajectory``: how the states move over passes."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

TRAJECTORY = register_analysis(Analysis(
    name="trajectory",
    options="probes.trajectory.options:TrajectoryOptions",
    run="probes.trajectory.run:run",
    help="How do the states move over passes? Distance to the last pass by position, the answer "
    "position's states on two principal components, answer flips by count, the fusion's gate.",
    example="fbt-probe trajectory --task delayed_memory --prefill k8",
    folder="trajectory",
    section="probes.trajectory.report:section",
    figures="probes.trajectory.plot:figures",
    moved={"--passes": "--prefill k<N>", "-k": "--prefill k<N>"},
    reproduce={"task": "delayed_memory"},
))  # fmt: skip

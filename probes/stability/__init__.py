"""``stability``: does the feedback map contract?"""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

STABILITY = register_analysis(Analysis(
    name="stability",
    options="probes.stability.options:StabilityOptions",
    run="probes.stability.run:run",
    help="Does the feedback map contract? State change, loss and accuracy over Jacobi passes.",
    example="fbt-probe stability --prefill k30 --task done_tracking",
    folder="stability",
    section="probes.stability.report:section",
    figures="probes.stability.plot:figures",
    moved={"--passes": "--prefill k<N>", "-k": "--prefill k<N>"},
    reproduce={"prefill": "k12", "decode_tokens": 200},
))  # fmt: skip

"""``stability``: does the feedback map contract?"""

from __future__ import annotations

from probes.analysis import PASSES_MOVED, Analysis, register_analysis

STABILITY = register_analysis(
    Analysis.of_folder(
        "probes.stability",
        help="Does the feedback map contract? State change, loss and accuracy over Jacobi passes.",
        example="fbt-probe stability --prefill k30 --task done_tracking",
        moved=PASSES_MOVED,
        reproduce={"prefill": "k12", "decode_tokens": 200},
        outputs=("stability.*", "soft_decoding.*"),
    )
)

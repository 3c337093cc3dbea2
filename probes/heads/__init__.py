"""``heads``: attention by head and pass."""

from __future__ import annotations

from probes.analysis import PASSES_MOVED, Analysis, register_analysis

HEADS = register_analysis(
    Analysis.of_folder(
        "probes.heads",
        help="Attention by pass: each head's share on the previous token and, from the answer "
        "position, on the label token and the token after it (where the label's fed-back state "
        "enters); an induction score; one example's pattern pass by pass.",
        example="fbt-probe heads --task delayed_memory --prefill recurrent",
        moved=PASSES_MOVED,
        reproduce={"task": "delayed_memory"},
        outputs=("heads.csv", "heads_pattern.csv", "heads.json", "figures/heads_*"),
    )
)

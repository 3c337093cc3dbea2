"""``heads``: attention by head and pass."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

HEADS = register_analysis(Analysis(
    name="heads",
    options="probes.heads.options:HeadsOptions",
    run="probes.heads.run:run",
    help="Attention by pass: each head's share on the previous token and, from the answer "
    "position, on the label token and the token after it (where the label's fed-back state "
    "enters); an induction score; one example's pattern pass by pass.",
    example="fbt-probe heads --task delayed_memory --prefill recurrent",
    folder="heads",
    section="probes.heads.report:section",
    figures="probes.heads.plot:figures",
    moved={"--passes": "--prefill k<N>", "-k": "--prefill k<N>"},
    reproduce={"task": "delayed_memory"},
))  # fmt: skip

"""``patch``: activation patching against twins, one site at a time."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

PATCH = register_analysis(Analysis(
    name="patch",
    options="probes.patch.options:PatchOptions",
    run="probes.patch.run:run",
    help="Where does the label's difference live? Patch the twin's residual, heads or the "
    "fed-back state into block 0's q/k/v, one at a time: normalised logit difference with intervals.",
    example="fbt-probe patch --task delayed_memory --prefill recurrent --kinds resid,head",
    folder="patch",
    section="probes.patch.report:section",
    figures="probes.patch.plot:figures",
    reproduce={"task": "delayed_memory", "groups": 16},
))  # fmt: skip

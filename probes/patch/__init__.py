"""``patch``: activation patching against twins, one site at a time."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

PATCH = register_analysis(
    Analysis.of_folder(
        "probes.patch",
        help="Where does the label's difference live? Patch the twin's residual, heads or the "
        "fed-back state into block 0's q/k/v, one at a time: normalised logit difference with intervals.",
        example="fbt-probe patch --task delayed_memory --prefill recurrent --kinds resid,head",
        reproduce={"task": "delayed_memory", "groups": 16},
        outputs=("patch.csv", "patch.json", "figures/patch_*"),
    )
)

"""``fit``: group-cross-validated probes at the colon, at every depth and prefill, with
controls; the fitted probes are saved in ``<out>/probes/``."""

from __future__ import annotations

from probes.analysis import Analysis, register_analysis

FIT = register_analysis(
    Analysis.of_folder(
        "probes.fit",
        help="Fit group-cross-validated probes at the colon, at every depth and prefill; the fitted "
        "probes are saved in OUT/probes/.",
        example="fbt-probe fit --task delayed_memory --prefill standard,recurrent --out results",
        folder="",
        moved={"--passes": "--prefill all,k<N> (the prefills and k<N>)"},
        reproduce="probes.fit.run:reproduce",
        outputs=(
            "probe_results.csv",
            "probe_results.json",
            "probes",
            "figures/heatmap_*",
            "figures/lines_*",
        ),
    )
)

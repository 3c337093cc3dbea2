"""Probes and analyses of full-bandwidth models: one folder per analysis, registered once.

``run_<analysis>(model, options)`` runs an analysis as its CLI verb does (``run_fit``,
``run_intervene``, ``run_lens``, ``run_trajectory``, ``run_patch``, ``run_heads``,
``run_stability``); each takes its options dataclass (``FitOptions``, ...) or keyword changes
to its defaults, and returns a ``Result`` (its tables and the lines it reports). Your own
analysis, probe type or intervention is one ``register_*`` call.

Heavy modules (torch, scikit-learn) are imported on first use, so that importing the
registry (as the CLI does) stays quick.
"""

from __future__ import annotations

import importlib

from probes.analysis import (
    ANALYSES,
    Analysis,
    Figure,
    Result,
    analysis_names,
    get_analysis,
    register_analysis,
)
from tasks import imports

# modules of the flat layout, each now in its analysis's folder
imports.install(
    {
        "probes.artifacts": "probes.fit.artifacts",
        "probes.erasers": "probes.intervene.erasers",
        "probes.extract": "probes.common.extract",
        "probes.fit": "probes.fit.cv",
        "probes.heads_plot": "probes.heads.plot",
        "probes.heads_run": "probes.heads.run",
        "probes.html": "probes.report.html",
        "probes.intervene": "probes.intervene.run",
        "probes.intervene_plot": "probes.intervene.plot",
        "probes.interventions": "probes.intervene.registry",
        "probes.lens_plot": "probes.lens.plot",
        "probes.lens_run": "probes.lens.run",
        "probes.patch_plot": "probes.patch.plot",
        "probes.patch_run": "probes.patch.run",
        "probes.plot": "probes.fit.plot",
        "probes.probe": "probes.fit.probe",
        "probes.report": "probes.report.markdown",
        "probes.report_html": "probes.report.page",
        "probes.reproduce": "probes.report.reproduce",
        "probes.results": "probes.fit.results",
        "probes.run": "probes.fit.run",
        "probes.seeds": "probes.seeds.study",
        "probes.stability_plot": "probes.stability.plot",
        "probes.stability_run": "probes.stability.run",
        "probes.trajectory_plot": "probes.trajectory.plot",
        "probes.trajectory_run": "probes.trajectory.run",
        "probes.twins": "probes.common.twins",
        "probes.view": "probes.report.view",
    }
)

# the built-in analyses, in the order reproduce runs them and the report shows them
BUILTIN = (
    "fit",
    "intervene",
    "lens",
    "trajectory",
    "patch",
    "attribute",
    "heads",
    "stability",
    "steps",
    "loop",
)
for _name in BUILTIN:
    importlib.import_module(f"probes.{_name}")

# names whose modules import torch or scikit-learn: loaded when first asked for
_LAZY = {
    "register_probe": "probes.fit.probe",
    "probe_class": "probes.fit.probe",
    "PROBES": "probes.fit.probe",
    "register_intervention": "probes.intervene.registry",
    "INTERVENTIONS": "probes.intervene.registry:REGISTRY",
    "load_probes": "probes.fit.artifacts",
    "write_report": "probes.report.markdown",
    "option": "probes.common.options",
    **{f"{name.title()}Options": f"probes.{name}.options" for name in BUILTIN},
}
# run_fit, run_lens, ...: the registered analyses themselves (calling one runs it)
RUNNERS = {f"run_{name}": analysis for name, analysis in ANALYSES.items()}
globals().update(RUNNERS)

__all__ = [
    "ANALYSES",
    "Analysis",
    "Figure",
    "Result",
    "analysis_names",
    "get_analysis",
    "option",
    "register_analysis",
    *RUNNERS,
    *_LAZY,
]


__getattr__ = imports.lazy_attributes("probes", _LAZY)

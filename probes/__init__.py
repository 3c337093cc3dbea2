"""Probes and analyses of full-bandwidth models: one folder per analysis, registered once.

``run_<analysis>(model, **options)`` runs an analysis as its CLI verb does (``run_fit``,
``run_intervene``, ``run_lens``, ...): its parameters are its options dataclass's fields
(``FitOptions``, ...), each the verb's option of the same name with the same default and
help, and it returns a ``Result`` (its tables and the lines it reports). Your own
analysis, probe type or intervention is one ``register_*`` call.

Heavy modules (torch, scikit-learn) are imported on first use, so that importing the
registry (as the CLI does) stays quick.
"""

from __future__ import annotations

import importlib

from fbt_probe.util import imports
from probes.analysis import (
    ANALYSES,
    Analysis,
    Figure,
    Result,
    analysis_names,
    get_analysis,
    library_call,
    register_analysis,
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
    "register_probe": "probes.common.probe",
    "probe_class": "probes.common.probe",
    "PROBES": "probes.common.probe",
    "register_intervention": "probes.intervene.registry",
    "INTERVENTIONS": "probes.intervene.registry:REGISTRY",
    "load_probes": "probes.common.artifacts",
    "write_report": "probes.report.markdown",
    "option": "probes.common.options",
    **{f"{name.title()}Options": f"probes.{name}.options" for name in BUILTIN},
}
__all__ = [
    "ANALYSES",
    "Analysis",
    "Figure",
    "Result",
    "analysis_names",
    "get_analysis",
    "register_analysis",
    *(f"run_{name}" for name in BUILTIN),
    *_LAZY,
]

_lazy = imports.lazy_attributes("probes", _LAZY)
_CALLS: dict = {}  # name -> (the registered analysis, its library call)


def __getattr__(name: str):
    """``run_<analysis>`` of any registered analysis (made from its options on first use,
    ``probes.analysis.library_call``, and made again if the registration is replaced), or a
    name of ``_LAZY``."""
    if name.startswith("run_") and name[4:] in ANALYSES:
        analysis = ANALYSES[name[4:]]
        if name not in _CALLS or _CALLS[name][0] is not analysis:
            _CALLS[name] = (analysis, library_call(analysis))
        return _CALLS[name][1]
    return _lazy(name)

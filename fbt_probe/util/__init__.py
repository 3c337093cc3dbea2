"""The infrastructure every layer stands on, with no model and no task in it: safe files
(``files``), output transactions (``transaction``), registries (``registry``), list options
(``lists``) and lazy imports (``imports``). It imports nothing of fbt-probe's own."""

"""fbt-probe: full-bandwidth transformers with per-pass caches, training and decoding.

The names a user needs are here (``__all__``); each is imported on first use, so that
``import fbt_probe`` costs nothing until one is asked for::

    from fbt_probe import Prefill, at, load_model

    model = load_model("default")  # or a model folder, a run folder, a Hugging Face folder

Passes are counted from 1 everywhere: ``at(fn, on_pass=2)``, ``caches.of_pass(2)``,
``hook.ctx["pass_number"]``, the CLI's ``--pass`` and every table's ``pass`` column.
"""

from fbt_probe.util import imports

__version__ = "0.2.0"

# name -> "module" (the same name there) or "module:attribute"
_SURFACE = {
    "load_model": "fbt_probe.loading:load",
    "resolve_model": "fbt_probe.loading",
    "random_init_like": "fbt_probe.loading",
    "FeedbackModel": "fbt_probe.feedback",
    "PassOutput": "fbt_probe.feedback",
    "PassCaches": "fbt_probe.caches",
    "FBTModel": "fbt_probe.stack",
    "FBTConfig": "fbt_probe.config",
    "build_cfg": "fbt_probe.config",
    "HFFeedbackModel": "fbt_probe.hf",
    "load_hf": "fbt_probe.hf",
    "save_hf": "fbt_probe.hf",
    "Prefill": "fbt_probe.prefill",
    "parse_prefill": "fbt_probe.prefill",
    "DecodeMode": "fbt_probe.prefill",
    "MODES": "fbt_probe.prefill",
    "at": "fbt_probe.hooks",
    "HookContext": "fbt_probe.hooks",
    "generate_tokens": "fbt_probe.decode",
    "run_recurrence": "fbt_probe.recurrence",
    "model_hash": "fbt_probe.checkpoint",
    "save_model": "fbt_probe.checkpoint",
    "TrainConfig": "fbt_probe.train.config",
    "train": "fbt_probe.train.loop",
    "train_recipe": "fbt_probe.train.loop",
    "named_config": "fbt_probe.train.recipes",
}
__all__ = ["__version__", *_SURFACE]


__getattr__ = imports.lazy_attributes("fbt_probe", _SURFACE)


def __dir__():
    return sorted(__all__)

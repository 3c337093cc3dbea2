"""Training, by concern: ``config`` (TrainConfig), ``recipes`` (named TOML recipes),
``schedule`` and ``steps`` (what each step trains on, a pure function of recipe and step),
``objective`` (the multi-pass loss and one step), ``start`` (the model a run starts from),
``state`` (a run's state, checkpoints and resume checks) and ``loop`` (``train``,
``train_recipe``). The names of the single module this was are still found here."""

from tasks import imports

# what ``fbt_probe.train`` held as one module, by the module that holds it now
_MOVED = {
    "loop": (
        "train",
        "train_recipe",
        "run_steps",
        "finish",
        "save_run_model",
        "rank_device_of",
        "autocast",
        "parallel",
        "Clock",
        "Monitor",
        "take_step",
        "step_record",
    ),
    "objective": (
        "STREAM_EVAL",
        "warm_states",
        "multipass_loss",
        "quick_eval",
        "jitter_hook",
        "smear_hooks",
        "train_step",
    ),
    "start": (
        "build_model",
        "init_folder",
        "initial_weights",
        "frozen_parameters",
        "set_learning",
        "learned_state",
        "load_learned",
        "make_optimizer",
    ),
    "state": (
        "git_revision",
        "Divergence",
        "diverged",
        "without_sharding",
        "saved_train_config",
        "TrainState",
        "check_run",
        "run_identity",
        "CHECKPOINT_KEYS",
        "check_resume",
        "check_saved_weights",
        "check_activation_memory",
        "start_state",
        "record_start",
    ),
}
__getattr__ = imports.lazy_attributes(
    "fbt_probe.train",
    {name: f"fbt_probe.train.{module}" for module, names in _MOVED.items() for name in names},
)

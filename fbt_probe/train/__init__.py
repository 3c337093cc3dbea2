"""Training, by concern: ``config`` (TrainConfig), ``recipes`` (named TOML recipes),
``schedule`` and ``steps`` (what each step trains on, a pure function of recipe and step),
``objective`` (the multi-pass loss and one step), ``start`` (the model a run starts from),
``state`` (a run's state, checkpoints and resume checks), ``loop`` (``train``,
``train_recipe``), ``distributed`` (ranks, shards and placement under torchrun) and
``costs`` (what a recipe's steps cost, priced before it runs)."""

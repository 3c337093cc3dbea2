"""Transformers kept quiet: fbt-probe reports its own progress."""


def quiet() -> None:
    """No progress bars or advice from transformers: fbt-probe reports its own progress."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

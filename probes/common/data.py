"""Which data an analysis reads: the tasks a ``--task`` names, a ``--data`` file, or each task's
default dataset (generated where absent, encoded the way the model reads)."""

from __future__ import annotations

from pathlib import Path

from fbt_probe.hf import HFFeedbackModel, require_tokenizer
from fbt_probe.util.lists import comma_items
from tasks import get_task, task_names
from tasks.dataset import Dataset, load
from tasks.generate import DEFAULT_SEED, default_path, generate_dataset


def load_or_generate(
    task: str, data: str | Path | None, model=None, twins: bool = False
) -> Dataset:
    """The dataset file given, or the default ``data/<task>.parquet`` (generated if absent,
    with the probe seed; with ``twins``, ``data/<task>-twins.parquet``, the same rows with
    their counterfactual twins); for a model with a tokenizer of its own, ``-tok-<fingerprint>``
    before ``.parquet``, encoded with it. The dataset must be encoded the way ``model`` reads."""
    require_tokenizer(model)
    encoding = getattr(model, "encoding", None)
    if data is not None:
        ds = load(data)
        if ds.task != task:
            raise ValueError(f"{data} holds task {ds.task!r}, not {task!r}")
        if twins and not ds.has_twins:
            raise ValueError(f"{data} has no twins: generate it with 'fbt-probe generate --twins'")
        path = Path(data)
    else:
        path = default_path(task, encoding, twins)
        tokenizer = None if encoding is None else encoding.source
        if not path.is_file():
            generate_dataset(task, path, seed=DEFAULT_SEED, twins=twins, tokenizer=tokenizer)
        ds = load(path)
        if twins and tokenizer is not None and "n_shifted" not in ds.meta.get("twins", {}):
            # made before shifted twins were kept (it dropped every twin whose label word
            # took another number of tokens): this default file is remade
            generate_dataset(
                task, path, seed=DEFAULT_SEED, twins=True, tokenizer=tokenizer, force=True
            )
            ds = load(path)
    if model is not None:
        check_encoding(ds, model, path)
    return ds


def check_encoding(ds: Dataset, model, path) -> None:
    """A dataset is read only by a model with the tokenizer it was encoded with."""

    tok = ds.meta.get("tokenizer")
    if isinstance(model, HFFeedbackModel):
        if model.encoding is None:
            raise ValueError(f"{model.source} has no tokenizer: save one beside the model")
        if tok is None:
            raise ValueError(
                f"{path} is encoded with the built-in word vocabulary, not the model's "
                f"tokenizer: generate it with --tokenizer {model.source}"
            )
        if tok["fingerprint"] != model.encoding.fingerprint:
            raise ValueError(
                f"{path} was encoded with another tokenizer ({tok['fingerprint']}, the model's is "
                f"{model.encoding.fingerprint}): generate it with --tokenizer {model.source}"
            )
    elif tok is not None:
        raise ValueError(
            f"{path} is encoded with a Hugging Face tokenizer ({tok.get('source') or tok['fingerprint']}); "
            "the built-in model reads word datasets: generate one without --tokenizer"
        )


def one_task(task: str, all_too: bool = False) -> str:
    """The one task a command takes (``--task``): a registered name, not a list (and 'all'
    only where ``all_too``)."""
    if "," in task or (task == "all" and not all_too):
        also = " or 'all'" if all_too else ""
        raise ValueError(
            f"--task {task!r}: this command takes one task{also}, one of {', '.join(task_names())}"
        )
    if task != "all":
        known(task)
    return task


def known(task: str) -> None:
    """A registered task, or one line naming ``--task`` and the known ones."""
    get_task(task, "--task")


def tasks_and_data(task: str, data: str | Path | None) -> tuple[tuple[str, ...], dict | None]:
    """The tasks a command runs on (``--task``: a name, a comma-separated list or 'all') and,
    with ``--data``, the one dataset file given for its task."""
    if data is not None:
        ds_task = load(data).task
        if task not in ("all", ds_task):
            raise ValueError(f"{data} holds task {ds_task!r}, not {task!r}")
        return (ds_task,), {ds_task: data}
    task_list = task_names() if task == "all" else comma_items(task, "--task")
    for t in task_list:
        known(t)
    return task_list, None

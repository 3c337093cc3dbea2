"""What the generation analyses (``steps``, ``loop``) share: the tasks they read (those whose
answer is generated over many tokens), prompts batched by length, the oracle's answers and intervals over groups."""

from __future__ import annotations

import numpy as np
import torch

from fbt_probe.util.lists import comma_items
from probes.common.bootstrap import GroupBootstrap
from probes.common.data import known
from tasks import get_task, is_generated, task_names, vocab
from tasks.dataset import Dataset

MODES_HELP = (
    "Decoding modes, comma-separated: standard (tokens only), soft (each generated "
    "step fused with the last state), fused (soft after a recurrent prefill), full "
    "(soft after the exact recurrence)."
)


def generation_tasks(task: str) -> tuple[str, ...]:
    """``--task``: a generated-answer task, a comma-separated list, or 'all' (every registered
    task whose answer is generated); a task answered at the colon is refused."""
    names = task_names(generated=True) if task == "all" else comma_items(task, "--task")
    for t in names:
        known(t)
        if not is_generated(t):
            raise ValueError(
                f"--task {t}: its answer is read at the colon, not generated; "
                f"this command reads {', '.join(task_names(generated=True))}"
            )
    return names


def require_words(model) -> None:
    """The generation analyses read the built-in word vocabulary's datasets."""
    if getattr(model, "encoding", None) is not None:
        raise ValueError(
            "--model: the generation analyses read word-vocabulary models (a "
            "model with a tokenizer of its own is not supported by them yet)"
        )


def oracle(ds: Dataset) -> list[tuple[str, ...]]:
    """Every row's answer as the task's oracle reads it from the prompt alone (``solve``),
    checked against the answer the dataset stores."""
    mod = get_task(ds.task)
    params = mod.Params(**ds.meta.get("params", {}))
    out = []
    for i, ids in enumerate(ds.token_ids):
        words = tuple(vocab.decode(ids[: int(ds.colon_index[i]) + 1]).split())
        ans = tuple(mod.solve(words, params))
        if ans != tuple(ds.labels[i]):
            raise ValueError(
                f"{ds.task}: row {i}'s answer {' '.join(ds.labels[i])!r} is not "
                f"the oracle's {' '.join(ans)!r}: the dataset is damaged"
            )
        out.append(ans)
    return out


def by_length(ds: Dataset, rows: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """``rows`` in batches of equal prompt length (at most ``batch_size`` each)."""
    out = []
    lengths = ds.colon_index[rows]
    for n in sorted(set(lengths.tolist())):
        same = rows[lengths == n]
        out += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
    return out


def prompts(ds: Dataset, idx: np.ndarray, device, twin: bool = False) -> torch.Tensor:
    """(batch, pos) the prompts (up to and including the colon) of rows ``idx``."""
    ids = ds.twin_token_ids if twin else ds.token_ids
    c = ds.twin_colon_index if twin and ds.twin_colon_index is not None else ds.colon_index
    return torch.tensor(np.stack([ids[i][: int(c[i]) + 1] for i in idx]), device=device)


def mean_ci(values: np.ndarray, groups: np.ndarray, seed: int) -> tuple[float, float, float, int]:
    """The mean of ``values`` (NaN: not defined for that example, left out) with a 95 %
    interval from the bootstrap over groups, and how many values it is taken over."""
    keep = ~np.isnan(values)
    n = int(keep.sum())
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    v, g = values[keep].astype(float), groups[keep]
    lo, hi = np.nanpercentile(GroupBootstrap(g, seed).mean(v), [2.5, 97.5])
    return float(v.mean()), float(lo), float(hi), n

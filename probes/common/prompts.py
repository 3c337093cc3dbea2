"""Where each prompt of a dataset is read, and the prompts themselves as padded tensors:
what the lens and the trajectory read at the same position."""

from __future__ import annotations

import numpy as np
import torch

from probes.common.extract import site_positions
from probes.common.twins import padded
from tasks import vocab
from tasks.dataset import Dataset


def answer_positions(ds: Dataset, model, position: str) -> tuple[np.ndarray, np.ndarray]:
    """Per example: where it is read and the answer token scored there, the first label's
    first token. ``position`` 'answer' reads where that token is next (the colon of
    delayed_memory and done_tracking; the first register's name after multi_register's
    colon); otherwise a site position (``colon``, ``colon-K``, a declared one)."""
    enc = getattr(model, "encoding", None)
    first = (lambda w: enc.first_token(w)) if enc is not None else (lambda w: vocab.encode([w])[0])
    at, answer = np.zeros(len(ds), np.int64), np.zeros(len(ds), np.int64)
    for i, (ids, labels, c) in enumerate(zip(ds.token_ids, ds.labels, ds.colon_index, strict=True)):
        hits = np.flatnonzero(np.asarray(ids[c + 1 :]) == first(labels[0]))
        if not len(hits):
            raise ValueError(f"row {i}: its first label {labels[0]!r} is not after its colon")
        answer[i], at[i] = first(labels[0]), c + int(hits[0])
    if position != "answer":
        at = site_positions(ds, f"resid@{position}")
    return at, answer


def prompts(ds: Dataset, idx: np.ndarray, lengths: np.ndarray, device) -> torch.Tensor:
    """(len(idx), longest) the examples' first ``lengths`` tokens, right-padded."""
    return padded([ds.token_ids[i][: lengths[i]] for i in idx]).to(device)

"""Task examples as token tensors: a batch that teacher-forced training, the answer's loss and
the analyses that score whole sequences read (``make_batch``). Model-independent: the word
vocabulary, or a model's tokenizer when one is given."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from tasks import vocab
from tasks.base import Example


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # (batch, pos), right-padded
    targets: torch.Tensor  # (batch, pos) next token, -100 where none
    answer: torch.Tensor  # (batch, pos) bool: the target is an answer token
    lengths: torch.Tensor  # (batch,)
    prompt_len: torch.Tensor  # (batch,) tokens up to and including the colon
    tasks: list[str]

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> TrainBatch:
        return replace(
            self,
            **{
                f: getattr(self, f).to(device)
                for f in ("tokens", "targets", "answer", "lengths", "prompt_len")
            },
        )


def make_batch(examples: list[Example], pad_to: int | None = None, encoding=None) -> TrainBatch:
    """``pad_to``: the padded length (default: the longest example's). ``encoding``: a
    model's tokenizer (``tasks.encoding.TokenizerEncoding``) instead of the word vocabulary."""
    if encoding is None:
        ids = [vocab.encode(ex.tokens) for ex in examples]
        colons = [ex.colon_index for ex in examples]
    else:
        enc = [encoding.encode(ex) for ex in examples]
        ids, colons = [e.ids for e in enc], [e.colon_index for e in enc]
    # built as whole arrays, not row by row: batches are drawn every step (and a recipe's
    # whole stream for its digest), where a tensor per row cost more than the sampling
    n = np.array([len(x) for x in ids], dtype=np.int64)
    c = np.array(colons, dtype=np.int64)
    T = max(int(n.max()), pad_to or 0)
    pos = np.arange(T)
    inside = pos < n[:, None]
    tokens = np.full((len(ids), T), vocab.PAD_ID, dtype=np.int64)
    tokens[inside] = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(n.sum()))
    targets = np.full((len(ids), T), -100, dtype=np.int64)
    scored = pos[:-1] < (n - 1)[:, None]  # every position but the last predicts the next token
    targets[:, :-1] = np.where(scored, tokens[:, 1:], -100)
    answer = (pos >= c[:, None]) & (pos < (n - 1)[:, None])
    return TrainBatch(
        torch.from_numpy(tokens),
        torch.from_numpy(targets),
        torch.from_numpy(answer),
        torch.from_numpy(n),
        torch.from_numpy(c + 1),
        [ex.task for ex in examples],
    )

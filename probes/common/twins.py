"""Each example and its counterfactual twin, batched for patched runs, and the windows of
positions a state intervention patches (``fbt-probe intervene``).

Every example of a twin dataset (``generate --twins``) has a twin: the same words except the
label-bearing one. ``pairs_of`` finds each pair's answer position (where the two sequences
first differ after the colon, minus one), ``batches`` groups pairs of nearly equal length,
``window_mask`` says which fed-back states a window patches, and ``donors`` picks, for
``resample_state``, another example to take states from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fbt_probe.kernels.patching import Trace
from tasks import vocab
from tasks.dataset import Dataset

WINDOWS = ("label_next", "last1", "last4", "last16", "last64", "after_label", "all")
# windows that end before the answer: the only ones where "patch only" differs from a patch
# that propagates (a window reaching the answer already patches every later position)
EARLY_WINDOWS = ("label_next",)


@dataclass
class Pairs:
    """The rows of a twin dataset that have a twin, at distractor counts >= 1."""

    rows: np.ndarray  # indices into the dataset
    tokens: list[np.ndarray]  # clean ids up to and including the answer position
    twin_tokens: list[np.ndarray]
    answer: np.ndarray  # position whose next-token prediction is the flipped label
    twin_answer: np.ndarray  # the same in the twin (moved by its shift)
    label_pos: np.ndarray  # the label-bearing token (the first that differs)
    colon: np.ndarray
    target: np.ndarray  # which label flips (index into the task's targets)
    clean_id: np.ndarray  # vocabulary id of the clean label there (its first token)
    twin_id: np.ndarray
    twin_label: np.ndarray  # the twin's label word of the flipped target
    groups: np.ndarray
    labels: np.ndarray  # (n, n_targets) label words

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shift(self) -> np.ndarray:
        """How far each twin's colon sits from its example's: 0 for an aligned twin; not 0
        where a tokenizer gives the two label words different numbers of tokens."""
        return self.twin_answer - self.answer

    def subset(self, keep: np.ndarray) -> Pairs:
        """The pairs at the indices ``keep``."""
        return Pairs(
            **{
                f: [v[i] for i in keep] if isinstance(v, list) else v[keep]
                for f, v in vars(self).items()
            }
        )


def pairs_of(ds: Dataset, min_count: int = 1) -> Pairs:
    """The examples that have a twin; the answer position is where the two sequences first
    differ after the colon, minus one (the position that predicts that word), each counted
    from its own colon."""
    if not ds.has_twins:
        raise ValueError(
            f"dataset of {ds.task} has no twins: generate it with 'fbt-probe generate --twins'"
        )
    rows = np.flatnonzero((ds.twin_target >= 0) & (ds.n_distractors >= min_count))
    if len(rows) == 0:
        raise ValueError(f"dataset of {ds.task} has no twins at distractor counts >= {min_count}")
    toks, twins, answer, twin_answer = [], [], [], []
    twin_colon = ds.twin_colon_index if ds.twin_colon_index is not None else ds.colon_index
    for i in rows:
        a, b = ds.token_ids[i], ds.twin_token_ids[i]
        c, tc = int(ds.colon_index[i]), int(twin_colon[i])
        n = min(len(a) - c, len(b) - tc)  # through a tokenizer the labels may differ in length
        after = np.flatnonzero(a[c + 1 : c + n] != b[tc + 1 : tc + n])
        if len(after) == 0:
            raise ValueError(f"row {i}: its twin has the same answer")
        answer.append(c + int(after[0]))
        twin_answer.append(tc + int(after[0]))
        toks.append(a[: answer[-1] + 1])
        twins.append(b[: twin_answer[-1] + 1])
    answer, twin_answer = np.array(answer), np.array(twin_answer)
    return Pairs(
        rows=rows,
        tokens=toks,
        twin_tokens=twins,
        answer=answer,
        twin_answer=twin_answer,
        label_pos=ds.twin_position[rows],
        colon=ds.colon_index[rows],
        target=ds.twin_target[rows],
        clean_id=np.array([ds.token_ids[i][a + 1] for i, a in zip(rows, answer, strict=True)]),
        twin_id=np.array(
            [ds.twin_token_ids[i][a + 1] for i, a in zip(rows, twin_answer, strict=True)]
        ),
        twin_label=np.array([ds.twin_labels[i][ds.twin_target[i]] for i in rows]),
        groups=ds.group[rows],
        labels=np.array([list(ds.labels[i]) for i in rows]),
    )


@dataclass
class PairBatch:
    idx: np.ndarray  # indices into Pairs
    tokens: torch.Tensor  # (b, T) right-padded
    twin_tokens: torch.Tensor
    answer: torch.Tensor  # (b,)
    twin_answer: torch.Tensor
    label_pos: torch.Tensor
    colon: torch.Tensor
    clean: Trace | None = None
    twin: Trace | None = None

    def positions(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1])[None, :]

    @property
    def aligned(self) -> bool:
        """Every twin lines up with its example position by position (batches never mix
        aligned and shifted twins)."""
        return bool((self.twin_answer == self.answer).all())


def batches(
    pairs: Pairs, batch_size: int, device, spread: float = 0.1, max_tokens: int | None = None
) -> list[PairBatch]:
    """Examples sorted by length, at most ``batch_size`` at a time (and at most ``max_tokens``
    tokens, padded to the longest), and a new batch wherever
    the length grows by more than ``spread`` (and 4 positions) over the batch's shortest: a
    patch at the colon then re-runs only a few positions of every example. Aligned and
    shifted twins go in batches of their own."""
    lens = pairs.answer + 1
    longest = np.maximum(pairs.answer, pairs.twin_answer) + 1
    shifted = pairs.shift != 0
    order = np.lexsort((lens, shifted))
    groups, cur = [], []
    for i in order:
        if cur and (
            len(cur) == batch_size
            or (max_tokens and (len(cur) + 1) * max(longest[cur + [i]]) > max_tokens)
            or shifted[i] != shifted[cur[0]]
            or lens[i] - lens[cur[0]] > max(4, spread * lens[cur[0]])
        ):
            groups.append(np.array(cur))
            cur = []
        cur.append(i)
    groups.append(np.array(cur))
    out = []
    for idx in groups:
        # up to the answer: a causal model's later positions change nothing read there
        a = padded([pairs.tokens[i][: pairs.answer[i] + 1] for i in idx])
        b = padded([pairs.twin_tokens[i][: pairs.twin_answer[i] + 1] for i in idx])
        at = [
            torch.as_tensor(x[idx], device=device)
            for x in (pairs.answer, pairs.twin_answer, pairs.label_pos, pairs.colon)
        ]
        out.append(PairBatch(idx, a.to(device), b.to(device), *at))
    return out


def padded(seqs: list[np.ndarray]) -> torch.Tensor:
    """(len(seqs), longest) ids, right-padded."""
    out = torch.full((len(seqs), max(len(x) for x in seqs)), vocab.PAD_ID, dtype=torch.long)
    for j, x in enumerate(seqs):
        out[j, : len(x)] = torch.from_numpy(x)
    return out


def window_mask(name: str, b: PairBatch) -> torch.Tensor:
    """(b, T) the fed-back states a window patches, relative to each example's answer."""
    t = b.positions().to(b.answer.device)
    a = b.answer[:, None]
    upto = (t <= a) & (t >= 1)  # position 0 is plain: it has no fed-back state
    if name == "all":
        return upto
    if name == "after_label":
        return upto & (t > b.label_pos[:, None])
    if name == "label_next":
        return upto & (t == b.label_pos[:, None] + 1)
    if name.startswith("last") and name[4:].isdigit():
        return upto & (t > a - int(name[4:]))
    raise ValueError(f"unknown window {name!r}; choose from {', '.join(WINDOWS)}")


def donors(pairs: Pairs, bs: list[PairBatch], seed: int) -> dict[int, tuple[int, int]]:
    """For resample_state: each example's donor, drawn at random from the examples of its
    batch (nearly the same length) in other groups; where a batch holds one group only, the
    next example in length order from another group: {pair index: (batch number, row)}."""
    rng = np.random.default_rng(seed)
    order = [(bi, j, int(i)) for bi, b in enumerate(bs) for j, i in enumerate(b.idx)]
    out = {}
    for k, (bi, _, i) in enumerate(order):
        others = np.flatnonzero(pairs.groups[bs[bi].idx] != pairs.groups[i])
        if len(others):
            out[i] = (bi, int(rng.choice(others)))
            continue
        for step in range(1, len(order)):
            bj, j, other = order[(k + step) % len(order)]
            if pairs.groups[other] != pairs.groups[i] or step == len(order) - 1:
                out[i] = (bj, j)
                break
    return out


def donor_states(b: PairBatch, fed: list[torch.Tensor], answers: list, donor: dict) -> torch.Tensor:
    """(b, T, d): each example's donor's fed-back states, aligned at the answer position
    (positions before the donor's start get its position 0, a zero state). ``fed``: every
    batch's clean fed-back states; ``answers``: every batch's answer positions."""
    T = b.tokens.shape[1]
    out = torch.zeros_like(b.clean.fed)
    for j, i in enumerate(b.idx):
        bj, r = donor[int(i)]
        src = (torch.arange(T) + (int(answers[bj][r]) - int(b.answer[j]))).clamp(
            0, fed[bj].shape[1] - 1
        )
        out[j] = fed[bj][r, src]
    return out


def answer_logits(out, b: PairBatch, start: int, twin: bool = False) -> torch.Tensor:
    """(b, vocab) at each example's (or each twin's) answer position, from a pass over the
    positions >= start; only those positions go through the head."""
    rows = torch.arange(len(b.idx), device=b.answer.device)
    return out.logits_at(rows, (b.twin_answer if twin else b.answer) - start)


def aligned_pairs(ds: Dataset, groups: int | None = None) -> Pairs:
    """The pairs of a twin dataset whose twin lines up with its example position by position
    (what a patch needs), of the first ``groups`` groups only when given."""
    pairs = pairs_of(ds)
    keep = np.flatnonzero(pairs.shift == 0)
    if not len(keep):
        raise ValueError(f"{ds.task}: no twin lines up with its example position by position")
    pairs = pairs.subset(keep)
    if groups is not None:
        first = np.unique(pairs.groups)[:groups]
        pairs = pairs.subset(np.flatnonzero(np.isin(pairs.groups, first)))
    return pairs

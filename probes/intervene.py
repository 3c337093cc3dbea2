"""The intervention battery behind ``fbt-probe intervene``: is decodable task state *used*?

Every example of a twin dataset (``generate --twins``) has a counterfactual twin: the same
words except the label-bearing one. Both are run once per prefill (``clean_run``); every
intervention is then a patched re-run of the last pass from its first patched position on
(``fbt_probe.interventions``), read at the answer position (the colon; for multi_register
the position that predicts the flipped register's value):

- ``interchange_state``: the fed-back state (``fusion.hook_state``) takes the twin's value in a
  window of positions before the answer (``last1`` = the answer position alone, ``last4``,
  ``last16``, ``last64``, ``after_label``: every position after the label-bearing token,
  ``all``; ``label_next``: only the position right after the label-bearing token, the first
  whose fed-back state differs). Under full recurrence a patch propagates to later steps; the
  site ``fusion.hook_state (patch only)`` forces every later fed-back state to its clean
  value (only for ``label_next``: a window that reaches the answer has no later position).
- ``zero_state``, ``mean_state`` (the mean fed-back state over the dataset), ``resample_state``
  (another example's, aligned at the answer): ablations in the same windows but
  ``label_next``.
- ``interchange_token``: the label-bearing token's embedding takes the twin's in the last pass
  only, every fed-back state kept clean: the other route, attention to the original token.
- ``erase_probe``: LEACE (EleutherAI's ``concept-erasure``) of the target at one depth of the
  colon, fitted on the other grouped folds (cross-fitted: no example is erased by an eraser
  fitted on it); ``erase_random``: a random subspace of the same rank.
- ``steer_probe``: the residual at one depth of the colon moved by alpha standard deviations of
  its projection on the linear probe's direction from the clean label to the twin's (alpha > 0
  moves towards the twin); ``steer_random``: a random direction, the same distance.
- ``self``: the fed-back states (standard prefill: the token embeddings) patched with their own
  clean values, which must change nothing.

Metrics, each with a 95 % bootstrap interval over groups: ``accuracy`` (the clean label is the
argmax over the vocabulary), ``flip_rate`` (the twin's label is) and ``logit_diff``, the
normalised logit difference (mean of l_clean - l_twin, rescaled so that 1 = the clean run and
0 = the twin run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.interventions import (
    STATE_HOOK,
    Trace,
    clean_run,
    first_true,
    patched_run,
    replace_where,
)
from fbt_probe.model import FeedbackModel
from probes.extract import DEFAULT_CACHE, depth_hooks, extract_cached, parse_prefill
from probes.fit import N_BOOT, grouped_splits
from tasks import target_names, vocab
from tasks.dataset import Dataset

INTERVENTIONS = (
    "self", "interchange_state", "zero_state", "mean_state", "resample_state",
    "interchange_token", "erase_probe", "erase_random", "steer_probe", "steer_random",
)  # fmt: skip
STATE_KINDS = ("interchange_state", "zero_state", "mean_state", "resample_state")
WINDOWS = ("label_next", "last1", "last4", "last16", "last64", "after_label", "all")
# windows that end before the answer: the only ones where "patch only" differs from a patch
# that propagates (a window reaching the answer already patches every later position)
EARLY_WINDOWS = ("label_next",)
ALPHAS = (-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0)
METRICS = ("accuracy", "flip_rate", "logit_diff")
COLUMNS = ["task", "prefill", "intervention", "site", "positions", "alpha", "metric", "value",
           "ci_low", "ci_high", "n_examples"]  # fmt: skip
PATCH_ONLY = f"{STATE_HOOK} (patch only)"
TOKEN_SITE = "hook_embed"
DIRECTION_C = 0.1
# below this clean accuracy a model does not do the task, and no route can be said to carry it
MIN_CLEAN_ACCURACY = 0.8  # regularisation of the per-fold probes steering uses when none is saved


# ---- the examples and their twins ------------------------------------------------------
@dataclass
class Pairs:
    """The rows of a twin dataset that have a twin, at distractor counts >= 1."""

    rows: np.ndarray  # indices into the dataset
    tokens: list[np.ndarray]  # clean ids up to and including the answer position
    twin_tokens: list[np.ndarray]
    answer: np.ndarray  # position whose next-token prediction is the flipped label
    label_pos: np.ndarray  # the label-bearing token
    colon: np.ndarray
    target: np.ndarray  # which label flips (index into the task's targets)
    clean_id: np.ndarray  # vocabulary id of the clean label there (its first token)
    twin_id: np.ndarray
    twin_label: np.ndarray  # the twin's label word of the flipped target
    groups: np.ndarray
    labels: np.ndarray  # (n, n_targets) label words

    def __len__(self) -> int:
        return len(self.rows)


def pairs_of(ds: Dataset, min_count: int = 1) -> Pairs:
    """The examples that have a twin; the answer position is where the two sequences first
    differ after the colon, minus one (the position that predicts that word)."""
    if not ds.has_twins:
        raise ValueError(
            f"dataset of {ds.task} has no twins: generate it with 'fbt-probe generate --twins'"
        )
    rows = np.flatnonzero((ds.twin_target >= 0) & (ds.n_distractors >= min_count))
    if len(rows) == 0:
        raise ValueError(f"dataset of {ds.task} has no twins at distractor counts >= {min_count}")
    toks, twins, answer = [], [], []
    for i in rows:
        a, b, c = ds.token_ids[i], ds.twin_token_ids[i], int(ds.colon_index[i])
        n = min(len(a), len(b))  # through a tokenizer the labels may differ in length
        after = np.flatnonzero(a[c + 1 : n] != b[c + 1 : n])
        if len(after) == 0:
            raise ValueError(f"row {i}: its twin has the same answer")
        pos = c + int(after[0])
        answer.append(pos)
        toks.append(a[: pos + 1])
        twins.append(b[: pos + 1])
    answer = np.array(answer)
    return Pairs(
        rows=rows,
        tokens=toks,
        twin_tokens=twins,
        answer=answer,
        label_pos=ds.twin_position[rows],
        colon=ds.colon_index[rows],
        target=ds.twin_target[rows],
        clean_id=np.array([ds.token_ids[i][a + 1] for i, a in zip(rows, answer, strict=True)]),
        twin_id=np.array([ds.twin_token_ids[i][a + 1] for i, a in zip(rows, answer, strict=True)]),
        twin_label=np.array([ds.twin_labels[i][ds.twin_target[i]] for i in rows]),
        groups=ds.group[rows],
        labels=np.array([list(ds.labels[i]) for i in rows]),
    )


@dataclass
class Batch:
    idx: np.ndarray  # indices into Pairs
    tokens: torch.Tensor  # (b, T) right-padded
    twin_tokens: torch.Tensor
    answer: torch.Tensor  # (b,)
    label_pos: torch.Tensor
    colon: torch.Tensor
    clean: Trace | None = None
    twin: Trace | None = None

    def positions(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1])[None, :]


def batches(pairs: Pairs, batch_size: int, device, spread: float = 0.1) -> list[Batch]:
    """Examples sorted by length, at most ``batch_size`` at a time, and a new batch wherever
    the length grows by more than ``spread`` (and 4 positions) over the batch's shortest: a
    patch at the colon then re-runs only a few positions of every example."""
    lens = pairs.answer + 1
    order = np.argsort(lens, kind="stable")
    groups, cur = [], []
    for i in order:
        if cur and (
            len(cur) == batch_size or lens[i] - lens[cur[0]] > max(4, spread * lens[cur[0]])
        ):
            groups.append(np.array(cur))
            cur = []
        cur.append(i)
    groups.append(np.array(cur))
    out = []
    for idx in groups:
        T = int(lens[idx].max())
        a = torch.full((len(idx), T), vocab.PAD_ID, dtype=torch.long)
        b = a.clone()
        for j, i in enumerate(idx):
            a[j, : lens[i]] = torch.from_numpy(pairs.tokens[i])
            b[j, : lens[i]] = torch.from_numpy(pairs.twin_tokens[i])
        at = [torch.as_tensor(x[idx], device=device)
              for x in (pairs.answer, pairs.label_pos, pairs.colon)]  # fmt: skip
        out.append(Batch(idx, a.to(device), b.to(device), *at))
    return out


def window_mask(name: str, b: Batch) -> torch.Tensor:
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


# ---- probe directions and erasers -----------------------------------------------------
@dataclass
class DepthTools:
    """Per example, at one depth: the LEACE eraser of its fold, the steering unit vector
    towards its twin's label and the standard deviation of that projection."""

    erase_left: torch.Tensor  # (n, d, k)
    erase_right: torch.Tensor  # (n, k, d)
    erase_bias: torch.Tensor  # (n, d)
    random_basis: torch.Tensor  # (n, d, k) orthonormal, for erase_random
    unit: torch.Tensor  # (n, d)
    sigma: torch.Tensor  # (n,)
    random_unit: torch.Tensor  # (n, d)


def class_vectors(coef: np.ndarray, classes) -> dict[str, np.ndarray]:
    """A linear probe's per-class weight vectors (a binary probe's one row split in two)."""
    coef = np.asarray(coef, dtype=np.float64)
    classes = [str(c) for c in classes]
    if coef.shape[0] == 1 and len(classes) == 2:
        return {classes[0]: -coef[0] / 2, classes[1]: coef[0] / 2}
    return {c: coef[i] for i, c in enumerate(classes)}


def fit_leace(X: np.ndarray, z: np.ndarray):
    """LEACE (``concept_erasure.LeaceEraser``) of one-hot concept ``z`` from features X, in
    float64: (proj_left (d, k), proj_right (k, d), bias (d,))."""
    from concept_erasure import LeaceEraser

    e = LeaceEraser.fit(torch.from_numpy(X).double(), torch.from_numpy(z).double())
    bias = e.bias if e.bias is not None else torch.zeros(X.shape[1], dtype=torch.float64)
    return e.proj_left, e.proj_right, bias


def erase(x: torch.Tensor, left, right, bias) -> torch.Tensor:
    """Apply per-example erasers: x (b, n, d); left (b, d, k), right (b, k, d), bias (b, d)."""
    delta = x - bias[:, None, :]
    return x - torch.einsum("bnk,bdk->bnd", torch.einsum("bnd,bkd->bnk", delta, right), left)


def depth_tools(
    feats: np.ndarray,
    pairs: Pairs,
    classes: dict[int, list[str]],
    folds: list[np.ndarray],
    saved: dict | None,
    seed: int,
    depth: int,
) -> DepthTools:
    """Erasers and steering directions at one depth, cross-fitted over grouped folds.

    ``feats`` (n, d): the clean features of every pair at this depth; ``classes``: per target
    its label words; ``folds``: per fold the indices it holds out; ``saved``: {target: (coef,
    classes)} of saved linear probes, or None to fit a logistic probe on each fold's rest."""
    from probes.probe import probe_class

    n, d = feats.shape
    k = max(len(c) for c in classes.values())
    L = torch.zeros(n, d, k, dtype=torch.float64)
    R = torch.zeros(n, k, d, dtype=torch.float64)
    bias = torch.zeros(n, d, dtype=torch.float64)
    unit = torch.zeros(n, d, dtype=torch.float64)
    sigma = torch.zeros(n, dtype=torch.float64)
    for target, names in classes.items():
        y = pairs.labels[:, target]
        onehot = (y[:, None] == np.array(names)[None, :]).astype(np.float64)
        for held in folds:
            train = np.setdiff1d(np.arange(n), held)
            apply = held[pairs.target[held] == target]
            if len(apply) == 0:
                continue
            left, right, b = fit_leace(feats[train], onehot[train])
            kk = left.shape[1]
            L[apply, :, :kk], R[apply, :kk, :], bias[apply] = left, right, b
            if saved is not None:
                coef, cls = saved[target]
            else:
                p = probe_class("logistic")(DIRECTION_C).fit(feats[train], y[train])
                coef, cls = p.direction(), p.clf.classes_
            vec = class_vectors(coef, cls)
            for i in apply:
                clean, twin = pairs.labels[i, target], pairs.twin_label[i]
                u = vec.get(twin, 0.0) - vec.get(clean, 0.0)
                u = np.asarray(u, dtype=np.float64)
                norm = np.linalg.norm(u)
                if norm == 0:
                    continue  # a label the probe never saw: no direction to steer along
                u = u / norm
                unit[i] = torch.from_numpy(u)
                sigma[i] = float(np.std(feats[train] @ u))
    g = torch.Generator().manual_seed(seed * 1000 + depth)
    rank = max(1, k - 1)
    basis = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64))[0]
    rnd = torch.randn(n, d, generator=g, dtype=torch.float64)
    rnd = rnd / rnd.norm(dim=1, keepdim=True)
    f = lambda t: t.float()  # noqa: E731
    return DepthTools(f(L), f(R), f(bias), f(basis).expand(n, d, rank), f(unit), f(sigma), f(rnd))


# ---- the battery ----------------------------------------------------------------------
@dataclass(frozen=True)
class Key:
    intervention: str
    site: str
    positions: str
    alpha: float = float("nan")


@dataclass
class Record:
    """Per intervention, per example: correct, flipped, logit difference."""

    n: int
    hits: dict = field(default_factory=dict)

    def put(self, key: Key, idx: np.ndarray, logits: torch.Tensor, pairs: Pairs) -> None:
        if key not in self.hits:
            self.hits[key] = (np.zeros(self.n, bool), np.zeros(self.n, bool), np.zeros(self.n))
        c, f, ld = self.hits[key]
        lg = logits.double().cpu().numpy()
        arg = lg.argmax(1)
        ci, ti = pairs.clean_id[idx], pairs.twin_id[idx]
        rows = np.arange(len(idx))
        c[idx], f[idx], ld[idx] = arg == ci, arg == ti, lg[rows, ci] - lg[rows, ti]


def _answer_logits(logits: torch.Tensor, b: Batch, start: int) -> torch.Tensor:
    """(b, vocab) at each example's answer position, from logits of positions >= start."""
    rows = torch.arange(len(b.idx), device=logits.device)
    return logits[rows, b.answer - start]


def specs(
    b: Batch,
    passes: int | None,
    mean_state: torch.Tensor | None,
    donor_fed: torch.Tensor | None,
    tools: dict[int, DepthTools] | None,
    hooks_by_depth: list[str],
    skips_layers: bool = True,
) -> Iterator[tuple[Key, int, list, torch.Tensor | None, int]]:
    """Every patched run of one batch: (key, start, hooks, embeddings or None, the block the
    run may start from; 0 unless ``skips_layers``, the model's ``stack`` can start higher)."""
    c, w = b.clean, b.twin
    t = b.positions().to(b.answer.device)
    feedback = c.fed is not None
    if feedback:
        upto = window_mask("all", b)
        yield Key("self", STATE_HOOK, "all"), 1, [(STATE_HOOK, replace_where(upto, c.fed))], None, 0
        for name in WINDOWS:
            m = window_mask(name, b)
            s = first_true(m)
            if s is None:
                continue
            values = {
                "interchange_state": w.fed,
                "zero_state": torch.zeros_like(c.fed),
                "mean_state": mean_state.expand_as(c.fed),
                "resample_state": donor_fed,
            }
            for kind in STATE_KINDS if name not in EARLY_WINDOWS else ("interchange_state",):
                yield (
                    Key(kind, STATE_HOOK, name),
                    s,
                    [(STATE_HOOK, replace_where(m, values[kind]))],
                    None,
                    0,
                )
            if passes is None and name in EARLY_WINDOWS:  # the recurrence, without propagation
                later = t >= s
                v = torch.where(m[..., None], w.fed, c.fed)
                yield (
                    Key("interchange_state", PATCH_ONLY, name),
                    s,
                    [(STATE_HOOK, replace_where(later, v))],
                    None,
                    0,
                )
    at_label = t == b.label_pos[:, None]
    s = int(b.label_pos.min())
    emb = torch.where(at_label[..., None], w.emb, c.emb)
    keep = [(STATE_HOOK, replace_where(t >= s, c.fed))] if passes is None else []
    yield Key("interchange_token", TOKEN_SITE, "label_token"), s, keep, emb, 0
    if not feedback:
        yield Key("self", TOKEN_SITE, "label_token"), s, [], c.emb, 0
    if tools is None:
        return
    colon = t == b.colon[:, None]
    s = int(b.colon.min())
    # a patch at depth d leaves the blocks below it as they were, in a Jacobi pass always, in
    # the recurrence when nothing after the colon is read (the answer is at the colon)
    skip = skips_layers and (passes is not None or bool((b.answer == b.colon).all()))
    n_layers = len(hooks_by_depth) - 1
    for d, hook in enumerate(hooks_by_depth):
        tl = tools[d]
        first = min(d, n_layers - 1) if skip else 0
        sel = lambda x: x[torch.as_tensor(b.idx)].to(b.answer.device)  # noqa: E731
        L, R, bias, Q = (
            sel(tl.erase_left),
            sel(tl.erase_right),
            sel(tl.erase_bias),
            sel(tl.random_basis),
        )
        unit, sigma, rnd = sel(tl.unit), sel(tl.sigma), sel(tl.random_unit)

        def leace(x, L=L, R=R, bias=bias):
            return erase(x, L, R, bias)

        def random_erase(x, Q=Q, bias=bias):
            delta = x - bias[:, None, :]
            return x - torch.einsum("bnk,bdk->bnd", torch.einsum("bnd,bdk->bnk", delta, Q), Q)

        yield (
            Key("erase_probe", hook, "colon"),
            s,
            [(hook, replace_where(colon, leace))],
            None,
            first,
        )
        yield (
            Key("erase_random", hook, "colon"),
            s,
            [(hook, replace_where(colon, random_erase))],
            None,
            first,
        )
        for alpha in ALPHAS:
            for name, u in (("steer_probe", unit), ("steer_random", rnd)):
                delta = (alpha * sigma)[:, None] * u

                def steer(x, delta=delta):
                    return x + delta[:, None, :]

                yield (
                    Key(name, hook, "colon", alpha),
                    s,
                    [(hook, replace_where(colon, steer))],
                    None,
                    first,
                )


def donors(pairs: Pairs, bs: list[Batch], seed: int) -> dict[int, tuple[int, int]]:
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


def donor_states(b: Batch, fed: list[torch.Tensor], answers: list, donor: dict) -> torch.Tensor:
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


@torch.inference_mode()
def run_battery(
    model: FeedbackModel,
    ds: Dataset,
    prefill: str,
    seed: int = 0,
    folds: int = 5,
    batch_size: int = 128,
    cache_dir=DEFAULT_CACHE,
    probes: list | None = None,
    progress: Callable | None = None,
    probe_interventions: bool = True,
) -> tuple[Record, Pairs, dict]:
    """Run every intervention of one (dataset, prefill); returns the per-example record, the
    pairs and what the run used (clean and twin accuracy, directions, timings)."""
    t0 = time.monotonic()
    passes = parse_prefill(prefill)
    model.eval()
    device = next(model.parameters()).device
    pairs = pairs_of(ds)
    n_groups = len(np.unique(pairs.groups))
    if probe_interventions and n_groups < folds:
        raise ValueError(
            f"{ds.task}: {n_groups} groups have twins, too few for {folds} grouped folds (the "
            "erasers and directions are cross-fitted); generate more groups"
        )
    bs = batches(pairs, batch_size, device)
    hooks_by_depth = depth_hooks(model)

    # 1. clean and twin runs, once per batch
    rec = Record(len(pairs))
    total_state = torch.zeros(model.cfg.d_model, dtype=torch.float64)
    count = 0
    for k, b in enumerate(bs):
        b.clean = clean_run(model, b.tokens, passes)
        b.twin = clean_run(model, b.twin_tokens, passes, keep_cache=False)
        rec.put(Key("clean", "", ""), b.idx, _answer_logits(b.clean.logits, b, 0), pairs)
        rec.put(Key("twin", "", ""), b.idx, _answer_logits(b.twin.logits, b, 0), pairs)
        if b.clean.fed is not None:
            m = window_mask("all", b)
            total_state += b.clean.fed[m].double().sum(0).cpu()
            count += int(m.sum())
        if progress is not None:
            progress(k + 1, len(bs), f"{ds.task} {prefill}: clean and twin runs")
    mean_state = (total_state / max(count, 1)).float().to(device)
    donor = donors(pairs, bs, seed) if bs[0].clean.fed is not None else {}
    fed = [b.clean.fed for b in bs] if donor else []
    answers = [b.answer for b in bs]
    t_clean = time.monotonic() - t0

    # 2. erasers and directions at each depth of the colon (cross-fitted over grouped folds)
    tools = None
    directions = "none"
    if probe_interventions:
        feats, _ = extract_cached(model, ds, prefill, cache_dir)
        feats = feats[pairs.rows]
        names = target_names(ds.task, ds.meta.get("params"))
        targets = sorted(set(pairs.target.tolist()))
        classes = {t: sorted(set(pairs.labels[:, t].tolist())) for t in targets}
        held = [
            te for _, te in grouped_splits(pairs.labels[:, targets[0]], pairs.groups, folds, seed)
        ]
        tools = {}
        for d in range(len(hooks_by_depth)):
            saved = None
            if probes is not None:
                saved = _saved_directions(probes, ds.task, names, targets, prefill, d)
            directions = (
                "saved probes" if saved is not None else f"logistic (C={DIRECTION_C}) per fold"
            )
            tools[d] = depth_tools(feats[:, d], pairs, classes, held, saved, seed, d)
    t_tools = time.monotonic() - t0 - t_clean

    # 3. the patched runs
    n_runs = 0
    by_kind: dict[str, float] = {}
    for k, b in enumerate(bs):
        dfed = donor_states(b, fed, answers, donor) if donor else None
        for key, start, hooks, emb, first in specs(
            b, passes, mean_state, dfed, tools, hooks_by_depth, model.skips_layers
        ):
            t1 = time.monotonic()
            logits = patched_run(model, b.clean, start, hooks, emb, from_layer=first)
            rec.put(key, b.idx, _answer_logits(logits, b, start), pairs)
            by_kind[key.intervention] = by_kind.get(key.intervention, 0.0) + time.monotonic() - t1
            n_runs += 1
        b.clean = b.twin = None  # free the keys and values
        if progress is not None:
            progress(k + 1, len(bs), f"{ds.task} {prefill}: interventions")
    info = {
        "prefill": prefill,
        "n_pairs": len(pairs),
        "n_batches": len(bs),
        "patched_runs": n_runs,
        "directions": directions,
        "seconds": {"clean_and_twin": t_clean, "erasers": t_tools,
                    "patched": time.monotonic() - t0 - t_clean - t_tools, "by_intervention": by_kind},
    }  # fmt: skip
    return rec, pairs, info


def _saved_directions(probes, task, names, targets, prefill, depth):
    """{target: (coef, classes)} from saved linear probes of this cell, or None."""
    out = {}
    for t in targets:
        hits = [p for p in probes if p.meta.get("task") == task and p.meta.get("target") == names[t]
                and p.meta.get("prefill") == prefill and p.meta.get("depth") == depth
                and p.meta.get("site", "resid") == "resid"]  # fmt: skip
        if len(hits) != 1 or hits[0].direction() is None:
            return None
        out[t] = (hits[0].direction(), hits[0].meta["classes"])
    return out


# ---- metrics --------------------------------------------------------------------------
def summarise(rec: Record, pairs: Pairs, task: str, prefill: str, seed: int,
              n_boot: int = N_BOOT) -> pd.DataFrame:  # fmt: skip
    """One row per (intervention, metric) with its bootstrap interval over groups."""
    ug, inv = np.unique(pairs.groups, return_inverse=True)
    G = len(ug)
    size = np.bincount(inv, minlength=G).astype(float)
    draw = np.random.default_rng(seed).integers(0, G, size=(n_boot, G))
    per_group = lambda v: np.bincount(inv, weights=v.astype(float), minlength=G)  # noqa: E731
    _, _, ld_clean = rec.hits[Key("clean", "", "")]
    _, _, ld_twin = rec.hits[Key("twin", "", "")]
    g_clean, g_twin = per_group(ld_clean), per_group(ld_twin)
    rows = []
    for key, (c, f, ld) in rec.hits.items():
        if key.intervention not in INTERVENTIONS:
            continue
        g_ld = per_group(ld)
        for metric, full, boot in (
            ("accuracy", c.mean(), per_group(c)[draw].sum(1) / size[draw].sum(1)),
            ("flip_rate", f.mean(), per_group(f)[draw].sum(1) / size[draw].sum(1)),
            ("logit_diff", _norm(ld.sum(), ld_clean.sum(), ld_twin.sum()),
             _norm(g_ld[draw].sum(1), g_clean[draw].sum(1), g_twin[draw].sum(1))),
        ):  # fmt: skip
            lo, hi = (
                np.nanpercentile(boot, [2.5, 97.5]) if np.isfinite(boot).any() else (np.nan,) * 2
            )
            rows.append({"task": task, "prefill": prefill, "intervention": key.intervention,
                         "site": key.site, "positions": key.positions, "alpha": key.alpha,
                         "metric": metric, "value": float(full), "ci_low": float(lo),
                         "ci_high": float(hi), "n_examples": len(pairs)})  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS)


def _norm(ld, clean, twin):
    """(ld - twin) / (clean - twin): 1 = the clean run, 0 = the twin run."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.asarray(ld) - twin) / (np.asarray(clean) - twin)


def reference(rec: Record, pairs: Pairs) -> dict:
    """Answer accuracy of the clean and the twin runs (the twin scored on its own label)."""
    c, _, _ = rec.hits[Key("clean", "", "")]
    _, tw, _ = rec.hits[Key("twin", "", "")]
    return {"clean_accuracy": float(c.mean()), "twin_accuracy": float(tw.mean())}


# what ``fbt-probe reproduce`` runs (about 100 s on 2 cores): the paper's one-step probe
# setting on delayed_memory and the exact recurrence, what inference computes, on done_tracking
REPRODUCE_BATTERY = (("delayed_memory", "recurrent"), ("done_tracking", "full"))


# ---- the command ------------------------------------------------------------------------
def run_intervene(
    model: FeedbackModel,
    model_name: str,
    plan: list[tuple[str, str]],
    out_dir: str | Path,
    data: dict | None = None,
    probes_dir: str | Path | None = None,
    seed: int = 0,
    batch_size: int = 128,
    cache_dir=DEFAULT_CACHE,
    progress: Callable | None = None,
) -> pd.DataFrame:
    """The battery for every (task, prefill) of ``plan``; writes ``interventions.csv`` and
    ``interventions.json`` (what was run, on what, and how long it took)."""
    from probes.artifacts import load_probes
    from probes.run import load_or_generate, versions
    from tasks.dataset import atomic_write

    for _, p in plan:
        parse_prefill(p)
    out = Path(out_dir)
    mhash = model_hash(model)
    probes = None
    if probes_dir is not None:
        probes = [p for p in load_probes(probes_dir) if p.meta.get("model_hash") == mhash]
        if not probes:
            raise ValueError(f"the probes in {probes_dir} were fitted on another model")
    frames, meta_runs = [], []
    loaded = {}
    for task, prefill in plan:
        if task not in loaded:
            loaded[task] = load_or_generate(task, (data or {}).get(task), model, twins=True)
        ds = loaded[task]
        rec, pairs, info = run_battery(model, ds, prefill, seed=seed, batch_size=batch_size,
                                       cache_dir=cache_dir, probes=probes, progress=progress)  # fmt: skip
        frames.append(summarise(rec, pairs, task, prefill, seed))
        meta_runs.append({"task": task, "dataset_hash": ds.content_hash,
                          "twins_hash": ds.meta.get("twins", {}).get("hash"),
                          **info, **reference(rec, pairs)})  # fmt: skip
    df = pd.concat(frames, ignore_index=True)
    meta = {"model": model_name, "model_hash": mhash, "seed": seed, "bootstrap": N_BOOT,
            "alphas": list(ALPHAS), "windows": list(WINDOWS), "runs": meta_runs,
            "probes": str(probes_dir) if probes is not None else None, "versions": versions()}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "interventions.csv",
                 lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))  # fmt: skip
    atomic_write(out / "interventions.json",
                 lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))  # fmt: skip
    return df


def headline(df: pd.DataFrame, task: str, prefill: str) -> str:
    """The answer, in words, to: does the answer rely on the fed-back state, on attention to
    the original token, or on both? From the flip rates of the two interchanges."""
    g = df[(df.task == task) & (df.prefill == prefill) & (df.metric == "flip_rate")]

    def pick(intervention, site, positions):
        r = g[(g.intervention == intervention) & (g.site == site) & (g.positions == positions)]
        return None if r.empty else r.iloc[0]

    st = pick("interchange_state", STATE_HOOK, "all")
    tok = pick("interchange_token", TOKEN_SITE, "label_token")
    if tok is None:
        return ""
    fmt = lambda r: f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"  # noqa: E731
    acc = df[(df.task == task) & (df.prefill == prefill) & (df.intervention == "self")
             & (df.metric == "accuracy")]  # fmt: skip
    if len(acc) and acc.iloc[0].value < MIN_CLEAN_ACCURACY:
        return (
            f"{task}, {prefill} prefill: the clean run answers only {acc.iloc[0].value:.3f} of "
            f"these prompts, so the interchanges (state {st.value if st is not None else float('nan'):.3f}, "
            f"token {tok.value:.3f}) say nothing about what it uses."
        )
    if st is None:
        return f"{task}, {prefill} prefill: the twin's label token flips {fmt(tok)} of answers."
    state_used, token_used = st.value >= 0.5, tok.value >= 0.5
    verdict = (
        "both: each interchange alone flips most answers"
        if state_used and token_used
        else "the fed-back state: when the state and the token disagree, the answer follows the state"
        if state_used
        else "attention to the original token: when the two disagree, the answer follows the token"
        if token_used
        else "both, redundantly: with either route left clean, most answers survive"
    )
    return (
        f"{task}, {prefill} prefill: interchanging every fed-back state flips {fmt(st)} of answers, "
        f"the label token's embedding {fmt(tok)}: the answer relies on {verdict}."
    )

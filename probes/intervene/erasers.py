"""Erasers and steering directions at one depth of the colon, cross-fitted over grouped folds:
LEACE (EleutherAI's ``concept-erasure``) of the target, a random subspace of the same rank,
the linear probe's direction from each example's label to its twin's, and a random one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from concept_erasure import LeaceEraser

from probes.common.probe import probe_class
from probes.common.twins import Pairs

DIRECTION_C = 0.1  # regularisation of the per-fold probes steering uses when none is saved


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

    e = LeaceEraser.fit(torch.from_numpy(X).double(), torch.from_numpy(z).double())
    bias = e.bias if e.bias is not None else torch.zeros(X.shape[1], dtype=torch.float64)
    return e.proj_left, e.proj_right, bias


def erase(x: torch.Tensor, left, right, bias) -> torch.Tensor:
    """Apply per-example erasers: x (b, n, d); left (b, d, k), right (b, k, d), bias (b, d)."""
    delta = x - bias[:, None, :]
    return x - torch.einsum("bnk,bdk->bnd", torch.einsum("bnd,bkd->bnk", delta, right), left)


def erase_subspace(x: torch.Tensor, basis, bias) -> torch.Tensor:
    """Remove per-example orthonormal subspaces: x (b, n, d); basis (b, d, k), bias (b, d)."""
    delta = x - bias[:, None, :]
    return x - torch.einsum("bnk,bdk->bnd", torch.einsum("bnd,bdk->bnk", delta, basis), basis)


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
            steer_towards_twins(
                class_vectors(coef, cls), feats[train], pairs, target, apply, unit, sigma
            )
    g = torch.Generator().manual_seed(seed * 1000 + depth)
    rank = max(1, k - 1)
    basis = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64))[0]
    rnd = torch.randn(n, d, generator=g, dtype=torch.float64)
    rnd = rnd / rnd.norm(dim=1, keepdim=True)
    f = lambda t: t.float()  # noqa: E731
    return DepthTools(f(L), f(R), f(bias), f(basis).expand(n, d, rank), f(unit), f(sigma), f(rnd))


def steer_towards_twins(vec: dict, train_feats, pairs: Pairs, target: int, apply, unit, sigma):
    """Into ``unit`` and ``sigma`` (rows ``apply``): the unit direction from each pair's clean
    label to its twin's among the probe's class vectors ``vec``, and the spread of the
    training features along it."""
    for i in apply:
        clean, twin = pairs.labels[i, target], pairs.twin_label[i]
        u = np.asarray(vec.get(twin, 0.0) - vec.get(clean, 0.0), dtype=np.float64)
        norm = np.linalg.norm(u)
        if norm == 0:
            continue  # a label the probe never saw: no direction to steer along
        u = u / norm
        unit[i] = torch.from_numpy(u)
        sigma[i] = float(np.std(train_feats @ u))


def saved_directions(probes, task, names, targets, prefill, depth):
    """{target: (coef, classes)} from saved linear probes of this cell, or None."""
    out = {}
    for t in targets:
        hits = [
            p
            for p in probes
            if p.meta.get("task") == task
            and p.meta.get("target") == names[t]
            and p.meta.get("prefill") == prefill
            and p.meta.get("depth") == depth
            and p.meta.get("site", "resid") == "resid"
        ]
        if len(hits) != 1 or hits[0].direction() is None:
            return None
        out[t] = (hits[0].direction(), hits[0].meta["classes"])
    return out

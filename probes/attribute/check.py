"""The exact check of an attribution sweep: which sites to patch exactly, the patched runs
(``fbt-probe patch``'s machinery: ``clean_run``'s trace from the first patched position and
depth on in the last pass, every later pass run whole from an earlier one), and how well the
estimates agree with them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from fbt_probe.kernels.attribution import Site, attribute
from fbt_probe.kernels.patching import clean_run, replace_where
from probes.common.patching import Runner, first_patched, head_hook, layer_from, resid_columns
from probes.common.twins import PairBatch, answer_logits

TOP_K = 10
LOW_RANK, LOW_RECALL = 0.8, 0.7  # below these the summary warns


def after_label(b: PairBatch) -> torch.Tensor:
    """(batch, pos): the positions a head or path patch covers, the label through the answer."""
    t = torch.arange(b.tokens.shape[1], device=b.answer.device)[None]
    return (t <= b.answer[:, None]) & (t >= b.label_pos[:, None])


def batch_inputs(b: PairBatch, pairs) -> dict:
    """What ``attribute`` takes of one batch besides the model, the prefill and the kinds."""
    dev = b.answer.device
    return {
        "tokens": b.tokens,
        "twin_tokens": b.twin_tokens,
        "answer": b.answer,
        "clean_id": torch.as_tensor(pairs.clean_id[b.idx], device=dev),
        "twin_id": torch.as_tensor(pairs.twin_id[b.idx], device=dev),
        "columns": resid_columns(b),
        "after": after_label(b),
    }


def check_sites(est: dict, check: str, seed: int) -> list[Site]:
    """``check`` sites ('all', or a number: the top-ranked half by the size of the estimated
    effect, the rest drawn at random from the others)."""
    sites = list(est)
    if check == "all":
        return sites
    n = min(int(check), len(sites))
    ranked = sorted(sites, key=lambda s: -abs(1 - est[s][0]))
    top = ranked[: (n + 1) // 2]
    rest = ranked[len(top) :]
    rng = np.random.default_rng(seed)
    drawn = rng.choice(len(rest), size=min(n - len(top), len(rest)), replace=False)
    return top + [rest[i] for i in sorted(drawn)]


def exact_sweep(
    m, pairs, bs, pf, sites: list[Site], kinds, progress=None, label: str = ""
) -> dict[Site, np.ndarray]:
    """Per site, per pair: the exact patch's change of the clean logit difference."""
    if not sites:
        return {}
    n = len(pairs)
    out = {s: np.zeros(n) for s in sites}
    for k, b in enumerate(bs):
        inputs = batch_inputs(b, pairs)
        # the twin's activations and the swapped q, k, v, as the sweep saw them
        ref = attribute(m, prefill=pf, kinds=kinds, edges=False, **inputs)
        with torch.inference_mode():
            b.clean = clean_run(m, b.tokens, pf)
            for i, s in enumerate(sites):
                ld = _patched_ld(m, b, pf, s, ref, inputs) - ref.ld_clean
                out[s][b.idx] = ld.double().cpu().numpy()
                if progress is not None:  # one patched run a step: a deep model's are slow
                    progress(
                        k * len(sites) + i + 1,
                        len(bs) * len(sites),
                        f"{label}: exact check of {len(sites)} sites, batch {k + 1}/{len(bs)}",
                    )
            b.clean = None
    return out


def _patched_ld(m, b, pf, s: Site, ref, inputs) -> torch.Tensor:
    """(batch,) the logit difference with site ``s`` patched exactly."""
    last = pf.passes is None or s.pass_number == pf.passes
    runner = Runner(m, b, pf, None if last else s.pass_number - 1)
    key = (s.name, s.pass_number)
    if s.kind in ("resid", "state"):
        mask = inputs["columns"][s.where]
        hooks = [(s.name, replace_where(mask, ref.twin[key]))]
        depth = m.depth_hooks().index(s.name) if s.kind == "resid" else 0
    else:
        after, h = inputs["after"], int(s.where.split()[1])
        mask = after
        values = ref.twin[key] if s.kind == "head" else ref.swapped[key]
        hooks = [(s.name, head_hook(h, after, values))]
        depth = int(s.name.split(".")[1]) if s.kind == "head" else 0
    # in the recurrence every later step reads the patched one: run the stack whole
    layer = layer_from(m, depth) if last and pf.passes is not None else 0
    out, first = runner(hooks, first_patched(mask), layer)
    lg = answer_logits(out, b, first)
    rows = torch.arange(len(b.idx), device=lg.device)
    return lg[rows, inputs["clean_id"]] - lg[rows, inputs["twin_id"]]


def agreement(df: pd.DataFrame) -> dict:
    """Over the checked sites (all kinds, and resid and head only): Spearman's rank correlation
    of the estimated and exact effects, the top-k recall (the share of the estimate's top k
    whose exact effect is among the k largest, ties included), the three largest misses, and
    how many sites with an exact effect the estimate hides entirely."""
    out = {}
    for scope, kinds in (("all", None), ("resid_head", ("patch_resid", "patch_head"))):
        g = df[np.isfinite(df.exact.astype(float))]
        if kinds is not None:
            g = g[g.intervention.isin(kinds)]
        out[scope] = _agree(g)
    return out


def _agree(g: pd.DataFrame) -> dict:
    n = len(g)
    if n < 3:
        return {
            "checked": n,
            "rank_correlation": None,
            "top_k": None,
            "top_k_recall": None,
            "misses": [],
            "hidden": 0,
        }
    est, ex = 1 - g.value.to_numpy(float), 1 - g.exact.to_numpy(float)
    rho = spearmanr(est, ex).statistic
    k = min(TOP_K, n // 2)
    top_est = np.argsort(-np.abs(est), kind="stable")[:k]
    # a hit: a site of the estimate's top k whose exact effect is at least the k-th largest.
    # Sites tie exactly (patching the whole residual of a pass at any depth is the same patch),
    # and an exact top k picked among ties by position would count chance, not agreement.
    kth = np.sort(np.abs(ex))[::-1][k - 1]
    hits = int((np.abs(ex[top_est]) >= kth - 1e-9).sum())
    miss = np.argsort(-np.abs(est - ex))[:3]
    misses = [
        {
            "pass": str(g["pass"].iloc[i]),
            "intervention": g.intervention.iloc[i],
            "site": g.site.iloc[i],
            "positions": g.positions.iloc[i],
            "estimate": float(g.value.iloc[i]),
            "exact": float(g.exact.iloc[i]),
        }
        for i in miss
    ]
    # what GradDrop is for: a site the exact patch finds (|effect| >= 0.1) that the estimate
    # sees as nothing (|effect| < 0.02), its paths cancelling to first order
    hidden = int(((np.abs(ex) >= 0.1) & (np.abs(est) < 0.02)).sum())
    return {
        "checked": n,
        "rank_correlation": None if np.isnan(rho) else float(rho),
        "top_k": k,
        "top_k_recall": hits / k,
        "misses": misses,
        "hidden": hidden,
    }

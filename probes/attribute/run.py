"""``fbt-probe attribute``: attribution patching (``fbt_probe.kernels.attribution``) between each example
and its counterfactual twin, over every site ``fbt-probe patch`` covers, in every pass at once,
plus the fed-back state entering the fusion, and the edges between components.

Each site's estimate is the normalised logit difference the patch would leave (1: the clean
run's, 0: the twin's), from one clean run with its backward pass and one twin run per batch,
with 95 % intervals over groups. A sample of the sites (``--check``: the top-ranked half and a
random half) is then patched exactly with ``patch``'s machinery, and the agreement (rank
correlation, top-k recall, the largest misses) goes into the JSON and the summary; a low one is
warned about in one line. Writes ``attribution.csv`` (``patch.csv``'s columns, the estimate in
``value``, plus the plain first-order estimate and the exact patch where checked),
``edges.csv``, ``attribution.json`` and the figures.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from fbt_probe.kernels.attribution import attribute, edge_layout
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.budget import check_work
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.attribute.check import agreement, batch_inputs, check_sites, exact_sweep
from probes.attribute.options import AttributeOptions
from probes.attribute.plot import findings, plot_attribution
from probes.common.bootstrap import N_BOOT, GroupBootstrap
from probes.common.data import load_or_generate
from probes.common.extract import max_batch_tokens
from probes.common.metrics import COLUMNS as IV_TABLE
from probes.common.patching import count_sites
from probes.common.tables import write_json, write_table
from probes.common.twins import PairBatch, aligned_pairs, batches

# the columns of interventions.csv (and patch.csv: with the pass), then the estimates
COLUMNS = [
    *IV_TABLE[:2],
    "pass",
    *IV_TABLE[2:],
    "linear",
    "exact",
    "exact_ci_low",
    "exact_ci_high",
]
EDGE_COLUMNS = [
    "task",
    "prefill",
    "pass",
    "source",
    "target",
    "feedback",
    "value",
    "ci_low",
    "ci_high",
    "n",
]


# what one attribution batch may hold at its peak, beyond the model
BATCH_BYTES = 1 << 30


def batch_tokens(m, pf, edges: bool, longest: int) -> int:
    """The most tokens (examples x padded length) one batch may hold: every position keeps,
    per pass, about 2 L + 8 activations of d_model floats (the residual at each depth, each
    layer's heads, the fusion's and block 0's), their gradients and the twin's, and with edges
    each branch's input gradient too (measured on SmolLM2-135M: 1.6 MB a token with edges, 0.9
    without). The exact recurrence's backward pass also keeps every step's keys and values,
    as long as the prompt so far: about 4 L d_model bytes per token for every position."""
    L, d = m.cfg.n_layers, m.cfg.d_model
    per_token = 4 * d * (2 * L + 8) * (pf.passes or 1) * (6 if edges else 4)
    if pf.passes is None:
        per_token += 4 * L * d * longest
    return max(1, BATCH_BYTES // per_token)


def check_attribution_work(m, bs, pf, kinds, check: str, ig_steps: int, prefill: str) -> None:
    """Refuse a run past the machine's budget (``fbt_probe.runtime.budget``): the sweep is a clean and
    a twin forward and a backward pass (about four forwards) per integration point, and each
    checked site one patched run of every pass."""
    passes = pf.passes or 1
    sites = passes * count_sites(m, kinds, len(m.depth_hooks()))
    checked = sites if check == "all" else min(int(check), sites)
    tokens = sum(int(b.tokens.numel()) for b in bs)
    check_work(
        m,
        tokens * passes * (4 * (1 + ig_steps) + checked),
        f"--prefill {prefill} --check {check} --ig-steps {ig_steps}",
        f"{checked:,} exact patches and {1 + ig_steps} backward pass(es) on {tokens:,} tokens",
    )


def sweep(
    m,
    pairs,
    bs: list[PairBatch],
    pf,
    kinds,
    edges: bool,
    qk_fix: bool,
    ig_steps: int,
    progress=None,
    label: str = "",
) -> dict:
    """Every batch's attribution, gathered per pair: the clean and twin logit differences and
    each site's (edge's) estimated change."""
    n = len(pairs)
    acc = {
        "ld_clean": np.zeros(n),
        "ld_twin": np.zeros(n),
        "estimate": {},
        "linear": {},
        "edges": {},
    }
    for k, b in enumerate(bs):
        r = attribute(
            m,
            prefill=pf,
            kinds=kinds,
            edges=edges,
            qk_fix=qk_fix,
            ig_steps=ig_steps,
            **batch_inputs(b, pairs),
        )
        acc["ld_clean"][b.idx] = r.ld_clean.double().cpu().numpy()
        acc["ld_twin"][b.idx] = r.ld_twin.double().cpu().numpy()
        for part in ("estimate", "linear", "edges"):
            for key, v in getattr(r, part).items():
                acc[part].setdefault(key, np.zeros(n))[b.idx] = v.double().cpu().numpy()
        if progress is not None:
            progress(k + 1, len(bs), f"{label}: attribution")
    return acc


def normalised(changes: dict, acc: dict, groups: np.ndarray, seed: int, shift: bool = True):
    """{key: (value, ci_low, ci_high)}: the normalised logit difference after each change (1:
    clean, 0: twin) with its interval over groups; ``shift=False`` gives the change itself on
    that scale (an edge's share, 0: none, -1: the whole difference)."""
    boot = GroupBootstrap(groups, seed, N_BOOT)
    clean, twin = acc["ld_clean"], acc["ld_twin"]
    full = clean.sum() - twin.sum()
    span = boot.sums(clean) - boot.sums(twin)
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for key, d in changes.items():
            value = float(shift) + d.sum() / full
            draws = float(shift) + boot.sums(d) / span
            lo, hi = (
                np.nanpercentile(draws, [2.5, 97.5])
                if np.isfinite(draws).any()
                else (np.nan, np.nan)
            )
            out[key] = (float(value), float(lo), float(hi))
    return out


def site_table(acc, exact, task, pf, seed, groups) -> pd.DataFrame:
    """``attribution.csv``: one row per site."""
    est = normalised(acc["estimate"], acc, groups, seed)
    lin = normalised(acc["linear"], acc, groups, seed)
    rows = []
    for s, (v, lo, hi) in est.items():
        ex = exact.get(s, (np.nan,) * 3)
        rows.append(
            {
                "task": task,
                "prefill": pf.name,
                "pass": s.pass_number or "",
                "intervention": f"patch_{s.kind}",
                "site": s.name,
                "positions": s.where,
                "alpha": np.nan,
                "metric": "logit_diff",
                "value": v,
                "ci_low": lo,
                "ci_high": hi,
                "n": len(groups),
                "linear": lin[s][0],
                "exact": ex[0],
                "exact_ci_low": ex[1],
                "exact_ci_high": ex[2],
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def edge_table(acc, task, pf, seed, groups) -> pd.DataFrame:
    """``edges.csv``: one row per edge, its share of the logit difference (0: none)."""
    rows = [
        {
            "task": task,
            "prefill": pf.name,
            "pass": e.pass_number or "",
            "source": e.source,
            "target": e.target,
            "feedback": e.feedback,
            "value": v,
            "ci_low": lo,
            "ci_high": hi,
            "n": len(groups),
        }
        for e, (v, lo, hi) in normalised(acc["edges"], acc, groups, seed, shift=False).items()
    ]
    return pd.DataFrame(rows, columns=EDGE_COLUMNS)


def run(options: AttributeOptions, progress=None) -> Result:
    """``fbt-probe attribute`` (see the module docstring), on options checked before any
    work; its tables and the lines it reports."""
    o = options
    pf, chosen, want_edges, check = o.parsed
    m, name = resolve_model(o.model, resolve_device(o.device))
    m.eval()
    has_layout = edge_layout(m) is not None
    if want_edges and not has_layout:
        raise ValueError(
            f"--edges on: {name} lacks the layout edges need (a sequential pre-norm "
            "stack with per-head hooks, feedback into block 0); use --edges off"
        )
    if set(chosen) & {"head", "path"} and not m.n_heads:
        raise ValueError(
            f"{name}: its attention layout has no per-head hooks here; use --kinds resid,state"
        )
    want_edges = has_layout if want_edges is None else want_edges
    pairs = aligned_pairs(load_or_generate(o.task, o.data, m, twins=True), o.groups)
    longest = int(max(len(t) for t in pairs.tokens))
    budget = min(max_batch_tokens(m), batch_tokens(m, pf, want_edges, longest))
    bs = batches(pairs, o.batch_size, next(m.parameters()).device, max_tokens=budget)
    check_attribution_work(m, bs, pf, chosen, check, o.ig_steps, o.prefill)
    label = f"{o.task} {pf.name}"
    t0 = time.monotonic()
    acc = sweep(m, pairs, bs, pf, chosen, want_edges, o.qk_fix, o.ig_steps, progress, label)
    seconds = time.monotonic() - t0
    est = normalised(acc["estimate"], acc, pairs.groups, o.seed)
    picked = check_sites(est, check, o.seed)
    exact = exact_sweep(m, pairs, bs, pf, picked, chosen, progress, label)
    exact = normalised(exact, acc, pairs.groups, o.seed) if picked else {}
    df = site_table(acc, exact, o.task, pf, o.seed, pairs.groups)
    edf = edge_table(acc, o.task, pf, o.seed, pairs.groups) if want_edges else None
    meta = {
        "model": name,
        "task": o.task,
        "prefill": pf.name,
        "kinds": list(chosen),
        "edges": bool(want_edges),
        "qk_fix": o.qk_fix,
        "ig_steps": o.ig_steps,
        "groups": o.groups,
        "n_pairs": len(pairs),
        "n_batches": len(bs),
        "sites": len(df),
        "seconds": seconds,
        "agreement": agreement(df),
    }
    tables = {"attribution": df} if edf is None else {"attribution": df, "edges": edf}
    return Result(tables, write_attribution(df, edf, meta, Path(o.out)))


def write_attribution(df: pd.DataFrame, edf, meta: dict, out: Path) -> list[str]:
    """The tables, the JSON and the figures; returns the summary lines."""
    out.mkdir(parents=True, exist_ok=True)
    write_table(df, out / "attribution.csv")
    if edf is not None:
        write_table(edf, out / "edges.csv")
    write_json(meta, out / "attribution.json")
    plot_attribution(df, edf, meta, out / "figures")
    lines = findings(df, edf, meta)
    wrote = "attribution.csv" + (", edges.csv" if edf is not None else "")
    lines.append(
        f"wrote {wrote} in {out} ({len(df)} sites"
        + (f", {len(edf)} edges" if edf is not None else "")
        + f") and figures in {out / 'figures'}"
    )
    return lines

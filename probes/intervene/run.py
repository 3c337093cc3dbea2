"""The intervention battery behind ``fbt-probe intervene``: is decodable task state *used*?

Every example of a twin dataset (``generate --twins``) has a counterfactual twin
(``probes.common.twins``). Both are run once per prefill (``clean_run``); every intervention of the
registry (``probes.intervene.registry``) is then a patched re-run of the last pass from its first
patched position on (``fbt_probe.kernels.patching``), read at the answer position (the colon; for
multi_register the position that predicts the flipped register's value).

Metrics, each with a 95 % bootstrap interval over groups (``probes.common.cv.GroupBootstrap``):
``accuracy`` (the clean label is the argmax over the vocabulary), ``flip_rate`` (the twin's
label is) and ``logit_diff``, the normalised logit difference (mean of l_clean - l_twin,
rescaled so that 1 = the clean run and 0 = the twin run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.feedback import FeedbackModel
from fbt_probe.kernels.patching import clean_run, patched_output
from fbt_probe.loading import random_init_like, resolve_model
from fbt_probe.prefill import Prefill, parse_prefill
from fbt_probe.train.distributed import place
from fbt_probe.util.files import claims
from probes.analysis import Result
from probes.common.artifacts import check_use, load_probes
from probes.common.bootstrap import N_BOOT
from probes.common.cv import grouped_splits
from probes.common.data import load_or_generate
from probes.common.extract import (
    DEFAULT_CACHE,
    depth_hooks,
    extract_cached,
    max_batch_tokens,
    pick_depths,
)
from probes.common.metrics import CLEAN, TWIN, Key, Record, reference, summarise
from probes.common.tables import versions, write_json, write_table
from probes.common.twins import (
    WINDOWS,
    PairBatch,
    Pairs,
    answer_logits,
    batches,
    donor_states,
    donors,
    pairs_of,
    window_mask,
)
from probes.common.work import check_data_work, prefill_passes
from probes.intervene.erasers import DIRECTION_C, depth_tools, saved_directions
from probes.intervene.options import InterveneOptions
from probes.intervene.plot import plot_interventions
from probes.intervene.registry import ALPHAS, REGISTRY, Context, parse_interventions, specs
from probes.intervene.report import headline, headlines
from tasks import target_names
from tasks.dataset import Dataset

# The clean runs of every batch are kept for the patched runs (each batch then runs once)
# while they fit in this many bytes; beyond it, a batch's clean and twin runs are done again
# just before its patched runs, and only the fed-back states stay between the two phases.
KEEP_BYTES = 2 << 30


def kept_bytes_per_token(model) -> int:
    """What a batch's clean and twin traces hold per token, about: the keys and values with
    their pristine copy and each block's input (5 x layers x d_model floats at most), a few
    (pos, d_model) tensors, and the logits where the model's head is not lazy."""
    d, n, v = model.cfg.d_model, model.cfg.n_layers, model.cfg.d_vocab
    return 4 * (5 * n * d + 6 * d + (0 if model.lazy_logits else 2 * v))


def run_pair(model, b: PairBatch, pf: Prefill, keep_cache: bool = True) -> None:
    """The clean run of a batch (with what patched runs reuse) and its twins' run."""
    b.clean = clean_run(model, b.tokens, pf, keep_cache=keep_cache)
    b.twin = clean_run(model, b.twin_tokens, pf, keep_cache=False)


def clean_and_twin_runs(
    model,
    bs: list[PairBatch],
    pf: Prefill,
    rec: Record,
    pairs: Pairs,
    progress=None,
    label: str = "",
    keep: bool = True,
):
    """Run every batch and its twins once, recording their answers; ``keep`` keeps the runs
    on the batches, else only the fed-back states. Returns the mean fed-back state over the
    dataset (zero under standard prefill) and every batch's fed-back states (None each under
    standard prefill)."""
    total, count, fed = torch.zeros(model.cfg.d_model, dtype=torch.float64), 0, []
    for k, b in enumerate(bs):
        run_pair(model, b, pf, keep_cache=keep)
        rec.put(CLEAN, b.idx, answer_logits(b.clean.out, b, 0), pairs)
        rec.put(TWIN, b.idx, answer_logits(b.twin.out, b, 0, twin=True), pairs)
        fed.append(b.clean.fed)
        if b.clean.fed is not None:
            m = window_mask("all", b)
            total += b.clean.fed[m].double().sum(0).cpu()
            count += int(m.sum())
        if not keep:
            b.clean = b.twin = None
        if progress is not None:
            progress(k + 1, len(bs), f"{label}: clean and twin runs")
    return (total / max(count, 1)).float().to(next(model.parameters()).device), fed


def fit_tools(
    model,
    ds: Dataset,
    pf: Prefill,
    pairs: Pairs,
    probes,
    seed: int,
    folds: int,
    cache_dir,
    progress=None,
    label: str = "",
    depths: tuple[int, ...] | None = None,
) -> tuple[dict, str]:
    """Erasers and directions at ``depths`` of the colon (default: every depth),
    cross-fitted over grouped folds, and what the directions came from."""
    report = (
        None
        if progress is None
        else (lambda i, n, _: progress(i, n, f"{label}: features for the erasers"))
    )
    feats, _ = extract_cached(model, ds, pf, cache_dir, progress=report)
    feats = feats[pairs.rows]
    names = target_names(ds.task, ds.meta.get("params"))
    targets = sorted(set(pairs.target.tolist()))
    classes = {t: sorted(set(pairs.labels[:, t].tolist())) for t in targets}
    held = [te for _, te in grouped_splits(pairs.labels[:, targets[0]], pairs.groups, folds, seed)]
    tools, directions = {}, "none"
    depths = tuple(range(feats.shape[1])) if depths is None else depths
    for k, d in enumerate(depths):
        saved = None
        if probes is not None:
            saved = saved_directions(probes, ds.task, names, targets, pf.name, d)
            if saved is None:  # never fitted here behind the user's back
                raise ValueError(
                    f"the saved probes hold no linear probe of every target of "
                    f"{ds.task} ({', '.join(names[t] for t in targets)}) under "
                    f"{pf.name} at depth {d}"
                )
        directions = "saved probes" if saved is not None else f"logistic (C={DIRECTION_C}) per fold"
        tools[d] = depth_tools(feats[:, d], pairs, classes, held, saved, seed, d)
        if progress is not None:
            progress(k + 1, len(depths), f"{label}: erasers and directions by depth")
    return tools, directions


def aligned_if_fed(pairs: Pairs, pf: Prefill, task: str) -> Pairs:
    """Under a prefill with feedback, the pairs whose twins line up with them position by
    position: a shifted twin (a label word of another number of tokens) has no fed-back state
    or token at the example's positions to swap in. Refused in one line where none is left."""
    if not pf.feedback or not (pairs.shift != 0).any():
        return pairs
    keep = np.flatnonzero(pairs.shift == 0)
    if len(keep) == 0:
        raise ValueError(
            f"{task}: through this tokenizer every twin's label word takes another number of "
            f"tokens than its example's, so no twin lines up with its example position by "
            f"position and --prefill {pf.name} has nothing to patch; --prefill standard runs "
            "them (its token interchange is the twin's own run)"
        )
    return pairs.subset(keep)


def patched_runs(
    model,
    bs,
    pairs,
    pf,
    rec,
    kinds,
    keep,
    mean_state,
    donated,
    tools,
    hooks_by_depth,
    progress,
    label,
) -> tuple[int, dict]:
    """Every batch's patched runs, into ``rec``; where the clean and twin runs were not kept,
    each batch's are done again first. Returns the number of runs and seconds by kind."""
    fed, answers, donor = donated
    n_runs, by_kind = 0, dict.fromkeys(kinds, 0.0)
    for k, b in enumerate(bs):
        if not keep:
            run_pair(model, b, pf)
        dfed = donor_states(b, fed, answers, donor) if donor else None
        ctx = Context(b, pf.passes, mean_state, dfed, tools, hooks_by_depth, model.skips_layers)
        for sp in specs(ctx, kinds):
            t1 = time.monotonic()
            key = Key(sp.intervention, sp.site, sp.positions)
            key = key if sp.alpha is None else Key(*astuple(key)[:3], sp.alpha)
            if sp.twin_run:
                rec.copy(TWIN, key, b.idx)
            else:
                out = patched_output(model, b.clean, sp.start, sp.hooks, sp.emb, sp.from_layer)
                rec.put(key, b.idx, answer_logits(out, b, sp.start), pairs)
            by_kind[sp.intervention] += time.monotonic() - t1
            n_runs += 1
        b.clean = b.twin = None  # free the keys and values
        if progress is not None:
            progress(k + 1, len(bs), f"{label}: interventions")
    return n_runs, by_kind


@torch.inference_mode()
def run_battery(
    model: FeedbackModel,
    ds: Dataset,
    prefill: str | Prefill,
    seed: int = 0,
    folds: int = 5,
    batch_size: int = 128,
    cache_dir=DEFAULT_CACHE,
    probes: list | None = None,
    progress: Callable | None = None,
    kinds: tuple[str, ...] | None = None,
    depths: str | None = None,
) -> tuple[Record, Pairs, dict]:
    """Run the interventions ``kinds`` (default: every registered one) of one (dataset,
    prefill), those at a depth at ``depths`` (``pick_depths``); returns the per-example
    record, the pairs and what the run used."""
    t0, pf, kinds = time.monotonic(), parse_prefill(prefill), kinds or tuple(REGISTRY)
    model.eval()
    pairs = aligned_if_fed(pairs_of(ds), pf, ds.task)
    directed = any(REGISTRY[k].directions for k in kinds)
    n_groups = len(np.unique(pairs.groups))
    if directed and n_groups < folds:
        raise ValueError(
            f"{ds.task}: {n_groups} groups have twins, too few for {folds} grouped folds (the "
            "erasers and directions are cross-fitted); generate more groups"
        )
    bs = batches(
        pairs, batch_size, next(model.parameters()).device, max_tokens=max_batch_tokens(model)
    )
    rec, label = Record(len(pairs)), f"{ds.task} {pf.name}"
    keep = sum(b.tokens.numel() for b in bs) * kept_bytes_per_token(model) <= KEEP_BYTES
    mean_state, fed = clean_and_twin_runs(model, bs, pf, rec, pairs, progress, label, keep)
    donor = donors(pairs, bs, seed) if pf.feedback else {}
    fed, answers = (fed if donor else []), [b.answer for b in bs]
    t_clean = time.monotonic() - t0
    tools, directions = None, "none"
    hooks_by_depth = depth_hooks(model)
    at = pick_depths(depths, len(hooks_by_depth))
    if directed:
        tools, directions = fit_tools(
            model, ds, pf, pairs, probes, seed, folds, cache_dir, progress, label, at
        )
    t_tools = time.monotonic() - t0 - t_clean
    n_runs, by_kind = patched_runs(
        model,
        bs,
        pairs,
        pf,
        rec,
        kinds,
        keep,
        mean_state,
        (fed, answers, donor),
        tools,
        hooks_by_depth,
        progress,
        label,
    )
    seconds = {
        "clean_and_twin": t_clean,
        "erasers": t_tools,
        "patched": time.monotonic() - t0 - t_clean - t_tools,
        "by_intervention": by_kind,
    }
    info = {
        "prefill": pf.name,
        "n_pairs": len(pairs),
        "n_batches": len(bs),
        "n_shifted": int((pairs.shift != 0).sum()),
        "runs_kept": keep,
        "depths": list(at) if directed else [],
        "patched_runs": n_runs,
        "directions": directions,
        "seconds": seconds,
    }
    return rec, pairs, info


# ---- the command ------------------------------------------------------------------------
@claims("out_dir")
def intervene_battery(
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
    kinds: tuple[str, ...] | None = None,
    depths: str | None = None,
) -> pd.DataFrame:
    """The battery (the interventions ``kinds``, default all; ``depths``, ``pick_depths``)
    for every (task, prefill) of
    ``plan``; writes ``interventions.csv`` and ``interventions.json`` (what was run, on what,
    and how long it took)."""

    plan = [(t, parse_prefill(p).name) for t, p in plan]
    kinds = parse_interventions(",".join(kinds) if kinds else None)
    out = Path(out_dir)
    mhash = model_hash(model)
    probes = None
    if probes_dir is not None:
        probes = [p for p in load_probes(probes_dir) if p.meta.get("model_hash") == mhash]
        if not probes:
            raise ValueError(f"the probes in {probes_dir} were fitted on another model")
    frames, meta_runs = [], []
    loaded = {
        t: load_or_generate(t, (data or {}).get(t), model, twins=True)
        for t in dict.fromkeys(t for t, _ in plan)
    }
    # per (task, prefill): the clean and twin runs, and at least one patched run per kind
    for task, prefill in plan:
        check_data_work(
            model,
            [loaded[task]],
            prefill_passes(parse_prefill(prefill)),
            2 + len(kinds),
            "--prefill, -i",
        )
    for task, prefill in plan:
        ds = loaded[task]
        rec, pairs, info = run_battery(
            model,
            ds,
            prefill,
            seed=seed,
            batch_size=batch_size,
            cache_dir=cache_dir,
            probes=probes,
            progress=progress,
            kinds=kinds,
            depths=depths,
        )
        frames.append(summarise(rec, pairs, task, prefill, seed))
        meta_runs.append(
            {
                "task": task,
                "dataset_hash": ds.content_hash,
                "twins_hash": ds.meta.get("twins", {}).get("hash"),
                **info,
                **reference(rec, pairs),
            }
        )
    df = pd.concat(frames, ignore_index=True)
    meta = {
        "model": model_name,
        "model_hash": mhash,
        "seed": seed,
        "bootstrap": N_BOOT,
        "interventions": list(kinds),
        "alphas": list(ALPHAS),
        "windows": list(WINDOWS),
        "runs": meta_runs,
        "probes": str(probes_dir) if probes is not None else None,
        "versions": versions(),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_table(df, out / "interventions.csv")
    write_json(meta, out / "interventions.json", indent=2)
    return df


def run(options: InterveneOptions, progress=None) -> Result:
    """``fbt-probe intervene``: the battery (``--intervention``: comma-separated names,
    default all) on each task x prefill, on options checked before any work; writes
    ``interventions.csv`` and ``.json`` and the figures. Under torchrun the ranks share the
    probe features' extraction and rank 0 runs the battery (the others return no tables)."""
    o = options
    task_list, data_map = o.tasks_and_data
    dev, world = place(o.device)
    m, name = resolve_model(o.model, dev)
    used = pick_depths(o.depths, len(depth_hooks(m)))  # a bad --depths fails now, not after work
    if o.probes is not None:  # the probes must be the ones this battery reads, or it refuses
        check_use(
            o.saved_probes,
            o.probes,
            model_hash(m),
            [(t, p.name) for t in task_list for p in o.prefills],
            used,
            m.cfg.d_model,
        )
    if o.random_init:
        m, name = random_init_like(m, seed=o.seed), f"random-init control of {name} (seed {o.seed})"
    if world.size > 1:  # torchrun: the ranks share the probe features' extraction
        for t in task_list:
            ds = load_or_generate(t, (data_map or {}).get(t), m, twins=True)
            for p in o.prefills:
                extract_cached(m, ds, p)
        world.barrier()
        if not world.main:
            return Result()  # rank 0 runs the battery, finding the features in the cache
    plan = [(t, p.name) for t in task_list for p in o.prefills]
    out = Path(o.out)
    df = intervene_battery(
        m,
        name,
        plan,
        out,
        data=data_map,
        probes_dir=o.probes,
        seed=o.seed,
        batch_size=o.batch_size,
        progress=progress,
        kinds=o.interventions,
        depths=o.depths,
    )
    plot_interventions(df, out / "figures")
    lines = [f"wrote {out / 'interventions.csv'} ({len(df)} rows) and figures in {out / 'figures'}"]
    return Result({"interventions": df}, lines + headlines(df, plan, out))


# the paper's one-step probe setting on delayed_memory, and the exact recurrence, what
# inference computes, on done_tracking: the battery ``fbt-probe reproduce`` runs
BATTERY = (("delayed_memory", "recurrent"), ("done_tracking", "full"))


def reproduce(model, name: str, results: Path, out: Path, progress=None) -> list[str]:
    """``fbt-probe reproduce``'s battery (``BATTERY``, not a product of tasks and prefills)
    into ``out`` (what becomes ``results/interventions``), with the steering directions of
    the probes fitted into ``results``."""

    out = Path(out)
    iv = intervene_battery(model, name, list(BATTERY), out, probes_dir=results, progress=progress)
    plot_interventions(iv, out / "figures")
    return [f"  {headline(iv, t, p)}" for t, p in BATTERY]

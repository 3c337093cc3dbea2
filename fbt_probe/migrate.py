"""Read training configs written in the flat format (fbt-probe 0.1: ~50 top-level fields).

Run folders and config files from before the grouped format store every schedule knob as a
field of its own (``pass_mix``, ``single_pass_frac``, ``mixture_first`` ...). ``to_grouped``
turns such a dict into today's format, with a schedule of phases that draws exactly the same
training stream (a test replays every shipped recipe both ways). Keys the flat file lacks get
the values the flat reader filled in, so an old file means what it meant when it was written.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from fbt_probe.schedule import UNSET

log = logging.getLogger(__name__)

# The flat reader's defaults (the flat format's own TrainConfig()), except three mechanisms
# it switched off when a file predated them (see LEGACY_ABSENT).
FLAT_DEFAULTS = {
    "name": "default",
    "steps": 2300,
    "batch_size": 32,
    "lr": 0.002,
    "min_lr_frac": 0.1,
    "warmup_steps": 100,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "pass_mix": [0.15, 0.5, 0.25, 0.05, 0.0, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0, 0.02],
    "single_pass_frac": 0.04,
    "mix_ramp_frac": 0.4,
    "pass_mix_late": [],
    "pass_mix_late_ramp": [1.0, 1.0],
    "deep_batch_passes": 4,
    "deep_batch_size": 16,
    "deep_batch_n_min": 64,
    "prefix_mixin": False,
    "prefix_prob": 0.5,
    "fp_prob": 0.3,
    "fp_start": 0.55,
    "fp_warm": [8, 24],
    "fp_passes": 2,
    "fp_batch_size": 16,
    "fp_n_min": 0,
    "fp_exact": True,
    "answer_weight": [10.0, 20.0],
    "mixture": {"delayed_memory": 0.5, "done_tracking": 3.0, "multi_register": 1.0},
    "mixture_start": {"multi_register": 1.0, "delayed_memory": 0.4, "done_tracking": 0.1},
    "mixture_ramp_frac": 0.14,
    "mixture_hold_frac": 0.42,
    "mixture_first": {"done_tracking": 3.0, "delayed_memory": 0.5},
    "mixture_first_frac": 0.11,
    "mixture_late": {"delayed_memory": 0.5, "done_tracking": 3.0, "multi_register": 0.35},
    "mixture_late_ramp": [0.72, 0.85],
    "task_params": {"done_tracking": {"need_weights": [1, 1, 2, 3]}},
    "curriculum_start": 8,
    "curriculum_end": 256,
    "curriculum_ramp_frac": 0.2,
    "curriculum_hold_frac": 0.5,
    "curriculum_dist": "mixed",
    "curriculum_log_share": 0.75,
    "overwrite_ramp": [0.2, 0.4],
    "seed": 0,
    "eval_every": 250,
    "eval_examples": 96,
    "checkpoint_every": 250,
    "max_minutes": 19.5,
    "init_from": "",
    "freeze": {p: [0.0, 0.11] for p in ("blocks.1.", "blocks.2.", "blocks.3.", "W_E")},
}
LEGACY_ABSENT = {"pass_mix_late": [], "deep_batch_passes": 0, "fp_prob": 0.0}
FLAT_MODEL_DEFAULTS = {"n_heads": 16, "jitter": 0.5}  # the flat default's model departures
# keys only the flat format has: one of them marks a dict as flat
FLAT_ONLY = set(FLAT_DEFAULTS) - {"name", "steps", "init_from"}


def is_flat(d: dict) -> bool:
    return isinstance(d, dict) and bool(FLAT_ONLY & set(d)) and "schedule" not in d


def _num(d: dict, k: str) -> float:
    v = d[k]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"flat config: {k} must be a number, got {v!r}")
    return v


def _segments_passes(d):
    spf, mrf = _num(d, "single_pass_frac"), _num(d, "mix_ramp_frac")
    one, final = [1.0], list(d["pass_mix"])
    segs = []
    if spf > 0:
        segs.append((0.0, spf, one, one, False))
    if mrf > 0:
        segs.append((spf, spf + mrf, one, final, True))
    end = spf + mrf if mrf > 0 else spf
    late = list(d.get("pass_mix_late") or [])
    if late:
        a, b = d["pass_mix_late_ramp"]
        if a < end:
            raise ValueError(
                "flat config: pass_mix_late_ramp starts before the pass mix has ramped in; "
                "such a config has no phase form"
            )
        segs.append((end, a, final, final, False))
        segs.append((a, b, final, late, True) if b > a else (a, 1.0, late, late, False))
        if b > a:
            segs.append((b, 1.0, late, late, False))
    else:
        segs.append((end, 1.0, final, final, False))
    return segs


def _segments_tasks(d):
    mix = dict(d["mixture"])
    first, start, late = (
        d.get(k) or None for k in ("mixture_first", "mixture_start", "mixture_late")
    )
    ff = _num(d, "mixture_first_frac") if first else 0.0
    segs, t = [], 0.0
    if first:
        segs.append((0.0, ff, dict(first), dict(first), False))
        t = ff
    if start:
        hold, rf = _num(d, "mixture_hold_frac"), _num(d, "mixture_ramp_frac")
        if hold > 0:
            segs.append((t, t + hold, dict(start), dict(start), False))
            t = t + hold
        if rf > 0:
            segs.append((t, t + rf, dict(start), mix, True))
            t = t + rf
    if late:
        a, b = d["mixture_late_ramp"]
        segs.append((t, a, mix, mix, False))
        segs.append(
            (a, b, mix, dict(late), True) if b > a else (a, 1.0, dict(late), dict(late), False)
        )
        if b > a:
            segs.append((b, 1.0, dict(late), dict(late), False))
    else:
        segs.append((t, 1.0, mix, mix, False))
    return segs


def _segments_n_max(d):
    lo, hi = int(d["curriculum_start"]), int(d["curriculum_end"])
    hold, rf = _num(d, "curriculum_hold_frac"), _num(d, "curriculum_ramp_frac")
    if rf == 0:  # the flat ramp() was 1 throughout when its length was 0
        return [(0.0, 1.0, hi, hi, False)]
    segs = [(0.0, hold, lo, lo, False)] if hold > 0 else []
    segs.append((hold, hold + rf, lo, hi, True))
    segs.append((hold + rf, 1.0, hi, hi, False))
    return segs


def _segments_overwrites(d):
    a, b = d["overwrite_ramp"]
    if b == 0:
        return []
    from tasks import get_task

    full = get_task("multi_register").Params(**d["task_params"].get("multi_register", {}))
    full = full.max_overwrites
    segs = [(0.0, a, 0, 0, False)] if a > 0 else []
    segs.append((a, b, 0, full, True) if b > a else (a, 1.0, full, full, False))
    if b > a:
        segs.append((b, 1.0, full, full, False))
    return segs


def _segments_frozen(d):
    windows = d["freeze"]
    if not isinstance(windows, dict):
        raise ValueError(f"flat config: freeze maps prefixes to windows, got {windows!r}")
    cuts = sorted({0.0, 1.0} | {float(x) for w in windows.values() for x in w})
    segs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b > a:
            on = [p for p, (s, e) in windows.items() if s <= a < e]
            segs.append((a, b, on, on, False))
    return segs


def _segments_fixed_point(d):
    p, s = _num(d, "fp_prob"), _num(d, "fp_start")
    if p <= 0:
        return []
    return ([(0.0, s, 0.0, 0.0, False)] if s > 0 else []) + [(s, 1.0, p, p, False)]


def _as_data(v):
    return list(v) if isinstance(v, tuple) else v


def phases_from_segments(segments: dict) -> list[dict]:
    """Phases (as dicts) from each quantity's segments ``(start, end, v0, v1, ramps)``."""
    cuts = sorted({s for segs in segments.values() for seg in segs for s in seg[:2]} | {1.0})
    cuts = [c for c in cuts if c > 0]
    ends = {c: i for i, c in enumerate(cuts)}  # phase i ends at cuts[i]
    starts = {0.0: 0, **{c: i + 1 for i, c in enumerate(cuts[:-1])}}
    sets: dict[int, dict] = defaultdict(dict)
    ramps: dict[int, list] = defaultdict(list)
    origins: dict[float, dict] = defaultdict(dict)  # zero-length phases before a ramp
    for q, segs in segments.items():
        merged = []
        for seg in segs:
            if seg[1] <= seg[0] and not seg[4]:
                continue
            if merged and not seg[4] and not merged[-1][4] and merged[-1][3] == seg[2]:
                merged[-1] = (merged[-1][0], seg[1], *merged[-1][2:])
            else:
                merged.append(seg)
        value = _as_data(UNSET.get(q))  # where the quantity stands before any phase
        for k, (a, b, v0, v1, ramp) in enumerate(merged):
            nxt_ramps = k + 1 < len(merged) and merged[k + 1][4]
            if ramp:
                if value != v0:
                    origins[a][q] = v0
                sets[ends[b]][q] = v1
                ramps[ends[b]].append(q)
            else:
                if value != v0:
                    sets[starts[a]][q] = v0
                if nxt_ramps and ends[b] != starts[a]:
                    sets[ends[b]][q] = v0  # marks where the next ramp starts
            value = v1
    phases, prev = [], 0.0
    for i, c in enumerate(cuts):
        if prev in origins:
            phases.append({"until": prev, **origins.pop(prev)})
        p = {"until": c, **sets.get(i, {})}
        if ramps.get(i):
            p["ramp"] = ramps[i]
        phases.append(p)
        prev = c
    return phases


def to_grouped(flat: dict) -> dict:
    """A flat config dict as a grouped one (``TrainConfig.from_dict`` reads the result)."""
    unknown = sorted(set(flat) - set(FLAT_DEFAULTS) - {"model"})
    if unknown:
        raise ValueError(f"flat config: unknown key {unknown[0]!r}")
    d = {**FLAT_DEFAULTS, **LEGACY_ABSENT, **flat}
    model = dict(flat.get("model", FLAT_MODEL_DEFAULTS))
    segments = {
        "tasks": _segments_tasks(d),
        "passes": _segments_passes(d),
        "n_max": _segments_n_max(d),
        "frozen": _segments_frozen(d),
        "overwrites": _segments_overwrites(d),
        "fixed_point": _segments_fixed_point(d),
    }
    for segs in segments.values():
        for _, b, *_ in segs:
            if b > 1.0:
                raise ValueError(
                    "flat config: a ramp ends after training does (fraction > 1); "
                    "such a config has no phase form"
                )
    log.info("read a flat (fbt-probe 0.1) training config; migrated it to phases")
    return {
        "name": d["name"],
        "model": model,
        "steps": d["steps"],
        "optim": {
            k: d[k] for k in ("lr", "min_lr_frac", "warmup_steps", "weight_decay", "grad_clip")
        },
        "objective": {
            "answer_weight": d["answer_weight"],
            "prefix_mixin": d["prefix_mixin"],
            "prefix_prob": d["prefix_prob"],
        },
        "data": {
            "batch_size": d["batch_size"],
            "count_dist": d["curriculum_dist"],
            "log_share": d["curriculum_log_share"],
            "task_params": d["task_params"],
        },
        "schedule": phases_from_segments(segments),
        "deep_batches": {
            "passes": d["deep_batch_passes"],
            "batch_size": d["deep_batch_size"],
            "n_min": d["deep_batch_n_min"],
        },
        "fixed_point": {
            "warm": d["fp_warm"],
            "passes": d["fp_passes"],
            "batch_size": d["fp_batch_size"],
            "n_min": d["fp_n_min"],
            "exact": d["fp_exact"],
        },
        "run": {k: d[k] for k in ("seed", "eval_every", "eval_examples", "checkpoint_every")},
        "init_from": d["init_from"],
    }

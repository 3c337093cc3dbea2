"""``fbt-probe patch``: activation patching between each example and its counterfactual twin,
in one pass of a Jacobi prefill: by default the last (the pass whose answer is read), or an
earlier one (``--pass``), whose patch then reaches the answer through the states it feeds
back into every later pass.

Each patch runs the clean example with one activation taken from its twin's run, and scores
the answer with the normalised logit difference of ``fbt-probe intervene`` (1: the clean
run's, 0: the twin's own run's), with 95 % intervals over groups. Three kinds:

- ``resid``: the residual at one depth (0: block 0's input, the fused feedback from pass 2
  on) and one position: the label-bearing token (``label``), a position counted back from
  the answer (``answer-K``), or every position (``all``);
- ``head``: one attention head's output (``hook_z``) at every position, layer by layer;
- ``path``: the fed-back state into one block-0 head's queries, keys or values only: that
  head's q (k, v) as they are when the twin's fed-back states enter the fusion, everything
  else clean. It says which heads read the feedback; with no feedback (standard prefill, or
  a model whose fusion is ``none``) it changes nothing.

In the last pass, a patch at depth d re-runs only the blocks from d up (on a model that can skip
layers) and the positions from the first patched one on; in an earlier pass, the patched pass
and every later one are run whole. Only twins that line up with their example position
by position are patched. Writes ``patch.csv`` (the columns of ``interventions.csv``),
``patch.json`` and one heatmap per kind and task.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from fbt_probe.feedback import FeedbackModel
from fbt_probe.kernels.patching import STATE_HOOK, clean_run, replace_where
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import Prefill
from fbt_probe.runtime.budget import check_work
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.common.data import load_or_generate
from probes.common.extract import max_batch_tokens, pick_depths
from probes.common.metrics import CLEAN, TWIN, Key, Record, reference, summarise
from probes.common.patching import (
    Runner,
    count_sites,
    first_patched,
    head_hook,
    layer_from,
    resid_columns,
)
from probes.common.tables import write_json, write_table
from probes.common.twins import PairBatch, aligned_pairs, answer_logits, batches
from probes.patch.options import PatchOptions
from probes.patch.plot import findings, plot_patch


def twin_acts(
    model: FeedbackModel, b: PairBatch, pf: Prefill, names: list[str], at_pass: int | None = None
):
    """The twins' run: their last pass's output and the activations ``names`` (every
    position) of pass ``at_pass`` (0 = pass 1; None: the last)."""
    last = at_pass is None or at_pass == pf.passes - 1
    out, caches = model.run_with_pass_caches(
        b.twin_tokens, passes=pf.passes, names_filter=names, last_only=last
    )
    return out.passes[-1], caches.last if last else caches.of_pass(at_pass + 1)


def patch_batch(
    model, b: PairBatch, pf: Prefill, kinds, rec: Record, pairs, at, at_pass: int | None = None
) -> int:
    """Every patch of ``kinds`` on one batch (residuals at the depths ``at``) in pass
    ``at_pass`` (0 = pass 1; None: the last), into ``rec``; returns the number of runs."""
    z = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    names = (
        model.depth_hooks()
        + (z if "head" in kinds else [])
        + ([STATE_HOOK] if "path" in kinds else [])
    )
    runner = Runner(model, b, pf, at_pass)
    # an earlier pass runs every pass again whole: it needs no kept keys and values
    b.clean = clean_run(model, b.tokens, pf, keep_cache=not runner.early)
    twin_out, acts = twin_acts(model, b, pf, names, at_pass)
    rec.put(CLEAN, b.idx, answer_logits(b.clean.out, b, 0), pairs)
    rec.put(TWIN, b.idx, answer_logits(twin_out, b, 0, twin=True), pairs)
    runs = plan_runs(model, b, kinds, acts, at, runner)
    for key, start, hooks, layer in runs:
        out, first = runner(hooks, start, layer)
        rec.put(key, b.idx, answer_logits(out, b, first), pairs)
    b.clean = None
    return len(runs)


def check_patch_work(m, bs, pf, kinds, at, at_pass: int, prefill: str, pass_) -> None:
    """Refuse a sweep past the machine's budget (``fbt_probe.runtime.budget``): every patch re-runs
    the passes from the patched one on, over every batch."""
    sites = count_sites(m, kinds, len(at))
    tokens = sum(int(b.tokens.numel()) for b in bs)
    options = f"--prefill {prefill}" + (f" --pass {pass_}" if pass_ is not None else "")
    check_work(
        m,
        sites * tokens * (pf.passes - at_pass),
        options,
        f"{sites:,} patches of {pf.passes - at_pass} passes each on {tokens:,} tokens",
    )


def plan_runs(model, b: PairBatch, kinds, acts, at, runner: Runner) -> list[tuple]:
    """(key, first patched position, hooks, first block to re-run) of every patch."""
    L, H = model.cfg.n_layers, model.n_heads
    depth, z = model.depth_hooks(), [f"blocks.{i}.attn.hook_z" for i in range(L)]
    runs = []
    cols = resid_columns(b)
    if "resid" in kinds:
        for d in at:
            name = depth[d]
            for col, mask in cols.items():
                runs.append(
                    (
                        Key("patch_resid", name, col),
                        first_patched(mask),
                        [(name, replace_where(mask, acts[name]))],
                        layer_from(model, d),
                    )
                )
    t = torch.arange(b.tokens.shape[1], device=b.answer.device)[None]
    after = cols["all"] & (t >= b.label_pos[:, None])
    if "head" in kinds:
        for layer, name in enumerate(z):
            for h in range(H):
                runs.append(
                    (
                        Key("patch_head", name, f"head {h}"),
                        first_patched(after),
                        [(name, head_hook(h, after, acts[name]))],
                        layer_from(model, layer),
                    )
                )
    if "path" in kinds:
        fed = acts[STATE_HOOK] if STATE_HOOK in acts else None  # none in a plain pass
        qkv = [f"blocks.0.attn.hook_{w}" for w in "qkv"]
        swapped = state_swapped_qkv(runner, b, fed, qkv, after)
        for name in qkv:
            for h in range(swapped[name].shape[2]):  # keys and values: the key-value heads
                runs.append(
                    (
                        Key("patch_path", name, f"head {h}"),
                        first_patched(after),
                        [(name, head_hook(h, after, swapped[name]))],
                        0,
                    )
                )
    return runs


def state_swapped_qkv(
    runner: Runner, b: PairBatch, twin_fed, names, after
) -> dict[str, torch.Tensor]:
    """Block 0's q, k and v (batch, pos, head, d_head) in the patched pass when the twin's
    fed-back states enter the fusion of the clean example (its own where there is no
    fed-back state)."""
    got: dict[str, torch.Tensor] = {}

    def keep(x, hook):
        got[hook.name] = x

    hooks = [(n, keep) for n in names]
    start = first_patched(after)
    if twin_fed is not None:
        hooks.append((STATE_HOOK, replace_where(after, twin_fed)))
    runner(hooks, start, 0)
    T = b.tokens.shape[1]
    full = {}
    for n in names:  # positions before ``start`` are the clean run's: never patched
        x = got[n]
        full[n] = torch.cat([x.new_zeros(x.shape[0], T - x.shape[1], *x.shape[2:]), x], 1)
    return full


def run(options: PatchOptions, progress=None) -> Result:
    """``fbt-probe patch`` (see the module docstring), on options checked before any work:
    the pass patched (``--pass``, counted from 1; default the prefill's last) and, with
    ``--groups``, only the examples of the first this many groups."""
    o, (pf, chosen, at_pass) = options, options.parsed
    m, name = resolve_model(o.model, resolve_device(o.device))
    m.eval()
    at = pick_depths(o.depths, len(m.depth_hooks()))
    if set(chosen) & {"head", "path"} and not m.n_heads:
        raise ValueError(
            f"{name}: its attention layout has no per-head hooks here; patch it with --kinds resid"
        )
    t0 = time.monotonic()
    pairs = aligned_pairs(load_or_generate(o.task, o.data, m, twins=True), o.groups)
    bs = batches(pairs, o.batch_size, next(m.parameters()).device, max_tokens=max_batch_tokens(m))
    check_patch_work(m, bs, pf, chosen, at, at_pass, o.prefill, o.pass_number)
    rec, n_runs = Record(len(pairs)), 0
    with torch.inference_mode():
        for k, b in enumerate(bs):
            n_runs += patch_batch(m, b, pf, chosen, rec, pairs, at, at_pass)
            if progress is not None:
                progress(k + 1, len(bs), f"{o.task} {pf.name}, pass {at_pass + 1}: patches")
    df = summarise(rec, pairs, o.task, pf.name, o.seed)
    df.insert(df.columns.get_loc("prefill") + 1, "pass", at_pass + 1)
    meta = {
        "model": name,
        "task": o.task,
        "prefill": pf.name,
        "pass": at_pass + 1,
        "kinds": list(chosen),
        "groups": o.groups,
        "n_pairs": len(pairs),
        "n_batches": len(bs),
        "patched_runs": n_runs,
        "depths": list(at),
        "seconds": time.monotonic() - t0,
        **reference(rec, pairs),
    }
    return Result({"patch": df}, write_patch(df, meta, Path(o.out)))


def write_patch(df: pd.DataFrame, meta: dict, out: Path) -> list[str]:
    """``patch.csv``, ``patch.json`` and the figures; returns the summary lines."""

    out.mkdir(parents=True, exist_ok=True)
    write_table(df, out / "patch.csv")
    write_json(meta, out / "patch.json")
    where = f"{meta['prefill']} prefill, pass {meta['pass']}"
    plot_patch(df, meta["task"], where, out / "figures")
    lines = findings(df, meta["task"], where)
    lines.append(
        f"wrote {out / 'patch.csv'} ({len(df)} rows, {meta['patched_runs']} patched "
        f"runs) and figures in {out / 'figures'}"
    )
    return lines

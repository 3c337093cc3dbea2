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

import numpy as np
import pandas as pd
import torch

from fbt_probe.budget import check_work
from fbt_probe.device import resolve_device
from fbt_probe.feedback import FeedbackModel
from fbt_probe.hooks import at as only_in
from fbt_probe.loading import resolve_model
from fbt_probe.patching import STATE_HOOK, clean_run, patched_output, replace_where
from fbt_probe.prefill import Prefill, parse_prefill
from probes.analysis import Result
from probes.common.data import load_or_generate, one_task
from probes.common.extract import max_batch_tokens
from probes.common.options import as_kwargs
from probes.common.tables import write_json, write_table
from probes.common.twins import PairBatch, answer_logits, batches, pairs_of
from probes.intervene.metrics import CLEAN, TWIN, Key, Record, reference, summarise
from probes.intervene.run import pick_depths
from probes.patch.plot import findings, plot_patch
from tasks.lists import comma_items
from tasks.safe_files import check_output_dir

KINDS = ("resid", "head", "path")
BACK = 4  # answer-0 .. answer-3: the positions counted back from the answer


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


class Runner:
    """Patched runs of one batch in one pass. In the last pass, ``clean_run``'s trace is reused
    (from the first patched position and depth on); in an earlier pass the hooks act in that
    pass only and every later pass is run again, whole."""

    def __init__(self, model: FeedbackModel, b: PairBatch, pf: Prefill, at_pass: int | None):
        self.model, self.b, self.pf = model, b, pf
        self.early = at_pass is not None and at_pass < pf.passes - 1
        self.at_pass = at_pass

    def __call__(self, hooks, start: int, layer: int):
        """The last pass's output and the first position it covers."""
        if not self.early:
            return patched_output(self.model, self.b.clean, start, hooks, None, layer), start
        only = [(name, only_in(fn, on_pass=self.at_pass + 1)) for name, fn in hooks]
        with self.model.hooks(fwd_hooks=only):
            out = self.model(self.b.tokens, passes=self.pf.passes, keep_all=False)
        return out.passes[-1], 0


def head_hook(head: int, mask: torch.Tensor, values: torch.Tensor):
    """A hook on a (batch, pos, head, d_head) activation: ``head``'s slice replaced by
    ``values``' where ``mask`` (batch, pos) is true; every other head untouched."""

    def hook(x, hook):
        off, n = int(hook.ctx.get("first_position", 0)), x.shape[1]
        m = mask[:, off : off + n, None]
        y = x.clone()
        y[:, :, head] = torch.where(m, values[:, off : off + n, head].to(x.dtype), x[:, :, head])
        return y

    return hook


def resid_columns(b: PairBatch) -> dict[str, torch.Tensor]:
    """Per column of the (depth, position) map, the (batch, pos) positions it patches."""
    t = torch.arange(b.tokens.shape[1], device=b.answer.device)[None]
    cols = {"label": t == b.label_pos[:, None]}
    for k in range(BACK):
        cols[f"answer-{k}"] = t == (b.answer - k)[:, None]
    cols["all"] = t <= b.answer[:, None]
    return cols


def _start(mask: torch.Tensor) -> int:
    return int(mask.float().argmax(1).min())


def _layer_from(model, depth: int) -> int:
    """The first block a patch at ``depth`` must re-run (0 where the stack runs whole)."""
    if not model.skips_layers:
        return 0
    return min(depth, model.cfg.n_layers - 1)


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


def count_sites(m, kinds, n_depths: int) -> int:
    """Sites of one pass: each depth's residual at every column (the label token, the
    positions before the answer, all), each head, the fed-back state at every column, and
    each block-0 head's q, k and v path."""
    cols, L, H = BACK + 2, m.cfg.n_layers, m.n_heads
    return (
        n_depths * cols * ("resid" in kinds)
        + L * H * ("head" in kinds)
        + cols * ("state" in kinds)
        + 3 * H * ("path" in kinds)
    )


def check_patch_work(m, bs, pf, kinds, at, at_pass: int, prefill: str, pass_) -> None:
    """Refuse a sweep past the machine's budget (``fbt_probe.budget``): every patch re-runs
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
                        _start(mask),
                        [(name, replace_where(mask, acts[name]))],
                        _layer_from(model, d),
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
                        _start(after),
                        [(name, head_hook(h, after, acts[name]))],
                        _layer_from(model, layer),
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
                        _start(after),
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
    start = _start(after)
    if twin_fed is not None:
        hooks.append((STATE_HOOK, replace_where(after, twin_fed)))
    runner(hooks, start, 0)
    T = b.tokens.shape[1]
    full = {}
    for n in names:  # positions before ``start`` are the clean run's: never patched
        x = got[n]
        full[n] = torch.cat([x.new_zeros(x.shape[0], T - x.shape[1], *x.shape[2:]), x], 1)
    return full


def parse_args(prefill: str, kinds: str, pass_: int | None) -> tuple[Prefill, tuple, int]:
    """The prefill, the kinds and the patched pass (0 = pass 1) of ``fbt-probe patch``."""
    pf = parse_prefill(prefill)
    if pf.passes is None:
        raise ValueError(
            "--prefill full: patch acts on a Jacobi pass; use standard, recurrent or k<N>"
        )
    chosen = comma_items(kinds, "--kinds")
    bad = [k for k in chosen if k not in KINDS]
    if bad or not chosen:
        raise ValueError(f"--kinds {kinds!r}: choose from {', '.join(KINDS)}, comma-separated")
    if pass_ is not None and not 1 <= pass_ <= pf.passes:
        raise ValueError(f"--pass {pass_}: {pf.name} prefill has passes 1..{pf.passes}")
    return pf, chosen, pf.passes - 1 if pass_ is None else pass_ - 1


def patch(
    *,
    model: str = "default",
    task: str = "delayed_memory",
    prefill: str = "recurrent",
    kinds: str = "resid,head,path",
    pass_: int | None = None,
    depths: str | None = None,
    data: str | Path | None = None,
    out: str | Path = "results/patch",
    seed: int = 0,
    batch_size: int = 64,
    device: str = "cpu",
    groups: int | None = None,
    progress=None,
) -> tuple[pd.DataFrame, list[str]]:
    """``fbt-probe patch`` (see the module docstring); every argument is checked first.
    ``pass_``: the pass patched (1-based; None: the prefill's last); ``groups``: patch only
    the examples of the first this many groups."""

    (pf, chosen, at_pass), out = parse_args(prefill, kinds, pass_), Path(out)
    if groups is not None and groups < 1:
        raise ValueError(f"--groups must be at least 1, got {groups}")
    one_task(task)
    check_output_dir(out)
    m, name = resolve_model(model, resolve_device(device))
    m.eval()
    at = pick_depths(depths, len(m.depth_hooks()))
    if set(chosen) & {"head", "path"} and not m.n_heads:
        raise ValueError(
            f"{name}: its attention layout has no per-head hooks here; patch it with --kinds resid"
        )
    t0 = time.monotonic()
    pairs = pairs_of(load_or_generate(task, data, m, twins=True))
    keep = np.flatnonzero(pairs.shift == 0)
    if not len(keep):
        raise ValueError(f"{task}: no twin lines up with its example position by position")
    pairs = pairs.subset(keep)
    if groups is not None:
        first = np.unique(pairs.groups)[:groups]
        pairs = pairs.subset(np.flatnonzero(np.isin(pairs.groups, first)))
    bs = batches(pairs, batch_size, next(m.parameters()).device, max_tokens=max_batch_tokens(m))
    check_patch_work(m, bs, pf, chosen, at, at_pass, prefill, pass_)
    rec, n_runs = Record(len(pairs)), 0
    with torch.inference_mode():
        for k, b in enumerate(bs):
            n_runs += patch_batch(m, b, pf, chosen, rec, pairs, at, at_pass)
            if progress is not None:
                progress(k + 1, len(bs), f"{task} {pf.name}, pass {at_pass + 1}: patches")
    df = summarise(rec, pairs, task, pf.name, seed)
    df.insert(df.columns.get_loc("prefill") + 1, "pass", at_pass + 1)
    meta = {
        "model": name,
        "task": task,
        "prefill": pf.name,
        "pass": at_pass + 1,
        "kinds": list(chosen),
        "groups": groups,
        "n_pairs": len(pairs),
        "n_batches": len(bs),
        "patched_runs": n_runs,
        "depths": list(at),
        "seconds": time.monotonic() - t0,
        **reference(rec, pairs),
    }
    return df, write_patch(df, meta, out)


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


def run(options, progress=None) -> Result:
    """The ``patch`` analysis (``probes.patch.PatchOptions``)."""
    df, lines = patch(**as_kwargs(options, pass_number="pass_"), progress=progress)
    return Result({"patch": df}, lines)

"""Patched runs of twin pairs, shared by ``patch`` (every patch, exactly) and ``attribute``
(its exact check): the runner, the (depth, position) columns a residual patch covers, a head's
slice, where a patch starts re-running and how many sites one pass has."""

from __future__ import annotations

import torch

from fbt_probe.feedback import FeedbackModel
from fbt_probe.hooks import at as only_in
from fbt_probe.kernels.patching import patched_output
from fbt_probe.prefill import Prefill
from probes.common.twins import PairBatch

BACK = 4  # answer-0 .. answer-3: the positions counted back from the answer


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


def first_patched(mask: torch.Tensor) -> int:
    """The first position any row of ``mask`` (batch, pos) patches."""
    return int(mask.float().argmax(1).min())


def layer_from(model, depth: int) -> int:
    """The first block a patch at ``depth`` must re-run (0 where the stack runs whole)."""
    if not model.skips_layers:
        return 0
    return min(depth, model.cfg.n_layers - 1)


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

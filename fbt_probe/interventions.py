"""Causal interventions on a full-bandwidth model: patch the fed-back state, a token's
embedding or a residual, and read what the model answers.

A *prefill* is how the prompt is run: ``passes`` Jacobi passes (1 = standard, 2 = recurrent,
k = k-step) or ``None``, the exact sequential recurrence (full). Every intervention acts on
the *last* pass (Jacobi) or on the recurrence itself, the computation whose answer is read.

``clean_run`` runs a batch once and keeps what every patched run reuses: the embeddings, the
states the last pass is fused with, its keys and values. ``patched_run`` re-runs only what a
patch can change: the last pass (or the recurrence) from the first patched position on, with
the earlier positions' keys and values from the clean run. A patch is a list of
TransformerLens hooks (``replace_where``), and optionally other token embeddings. Under the
recurrence a patch at position t reaches every later step through the state it changes, as at
inference; forcing ``fusion.hook_state`` at every later position to the clean values is the
"patch only" variant. Nothing here knows about tasks or probes: any ``FeedbackModel``
(the built-in model or a Hugging Face one) with the hook names of ``FBTModel`` works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fbt_probe.model import FeedbackModel
from fbt_probe.recurrence import recurrence_steps, run_recurrence

STATE_HOOK = "fusion.hook_state"


def shift(states: torch.Tensor) -> torch.Tensor:
    """(batch, pos, d) top states h_t -> what position t is fused with, h_{t-1} (zeros at 0)."""
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)


@dataclass
class Trace:
    """One clean run of a batch under one prefill."""

    passes: int | None  # Jacobi passes, None = the exact recurrence
    emb: torch.Tensor  # (batch, pos, d_model) plain embeddings
    plain: torch.Tensor  # (batch, pos) positions that keep their plain embedding
    prev: torch.Tensor | None  # (batch, pos, d_model) states of the pass before the last (Jacobi)
    states: torch.Tensor  # (batch, pos, d_model) top states of the last pass / the recurrence
    logits: torch.Tensor  # (batch, pos, d_vocab)
    cache: object | None  # keys and values of the last pass (None: not kept)
    pristine: object | None = None  # model.snapshot_cache(cache), what patched runs restore
    resid: torch.Tensor | None = None  # (n_layers, batch, pos, d_model) each block's input

    @property
    def fed(self) -> torch.Tensor | None:
        """(batch, pos, d_model): the state each position of the last pass is fused with
        (``fusion.hook_state``'s value there); None under standard prefill."""
        if self.passes is None:
            return shift(self.states)
        return None if self.prev is None else shift(self.prev)


@torch.inference_mode()
def clean_run(
    model: FeedbackModel, tokens: torch.Tensor, passes: int | None, keep_cache: bool = True
) -> Trace:
    """Run ``tokens`` (batch, pos) once; ``keep_cache`` keeps what ``patched_run`` needs."""
    B, T = tokens.shape
    cache = model.new_cache(B, T, device=tokens.device) if keep_cache else None
    model.set_context(0, None, 0)
    emb = model.embed(tokens)
    plain = model.plain_mask(B, T, None, tokens.device)
    prev = None
    resid = None
    hooks = []
    # each block's input in the last pass, for patched runs from a depth
    if keep_cache and model.skips_layers:
        resid = emb.new_zeros(model.cfg.n_layers, B, T, emb.shape[-1])

        def keep(x, hook, layer):
            if hook.ctx.get("pass") in (None, (passes or 1) - 1):
                off = int(hook.ctx.get("offset", 0))
                resid[layer, :, off : off + x.shape[1]] = x

        hooks = [(f"blocks.{i}.hook_resid_pre", functools.partial(keep, layer=i))
                 for i in range(model.cfg.n_layers)]  # fmt: skip
    with model.hooks(fwd_hooks=hooks):
        if passes is None:
            out = run_recurrence(model, tokens, cache=cache)
        else:
            if passes < 1:
                raise ValueError(f"passes must be >= 1, got {passes}")
            for k in range(passes - 1):
                prev = model.feedback_pass(emb, prev, plain=plain, pass_index=k).states
            out = model.feedback_pass(emb, prev, plain=plain, cache=cache, pass_index=passes - 1)
    pristine = model.snapshot_cache(cache) if cache is not None else None
    return Trace(passes, emb, plain, prev, out.states, out.logits, cache, pristine, resid)


@torch.inference_mode()
def patched_run(
    model: FeedbackModel,
    trace: Trace,
    start: int,
    hooks: list[tuple[str, Callable]] = (),
    emb: torch.Tensor | None = None,
    from_layer: int = 0,
) -> torch.Tensor:
    """Re-run the last pass (or the recurrence) of ``trace`` from position ``start`` on, with
    ``hooks`` active and ``emb`` (default: the clean embeddings) as the token embeddings.
    Returns the logits of positions [start, pos): (batch, pos - start, d_vocab).

    Positions before ``start`` are not recomputed: a patch must not touch them (their keys
    and values come from the clean run). ``from_layer`` > 0 also skips the blocks below that
    one, starting from the clean run's input to it: right for a patch at that depth or
    above, in a Jacobi pass (a block only reads the blocks below it, at the same or earlier
    positions) and in the recurrence as long as no position after a patched one is read."""
    if trace.cache is None:
        raise ValueError("this trace kept no keys and values (clean_run(keep_cache=True))")
    T = trace.emb.shape[1]
    if not 0 <= start < T:
        raise ValueError(f"start {start} outside the sequence of {T} positions")
    emb = trace.emb if emb is None else emb
    cache = trace.cache
    try:
        with model.hooks(fwd_hooks=list(hooks)):
            if from_layer > 0:
                if trace.resid is None:
                    raise ValueError("this model runs its stack whole: from_layer must be 0")
                return _from_layer(model, trace, start, from_layer)
            if trace.passes is None:
                carry = trace.states[:, start - 1 : start] if start > 0 else None
                return recurrence_steps(model, emb, trace.plain, cache, start, carry).logits
            prev = trace.prev
            if prev is None:  # a plain pass (standard prefill)
                out = model.feedback_pass(
                    emb[:, start:], offset=start, cache=cache, pass_index=trace.passes - 1
                )
            else:
                out = model.feedback_pass(
                    emb[:, start:],
                    prev[:, start:],
                    carry=prev[:, start - 1 : start] if start > 0 else None,
                    plain=trace.plain[:, start:],
                    offset=start,
                    cache=cache,
                    pass_index=trace.passes - 1,
                )
            return out.logits
    finally:  # the next patched run reads the clean keys and values again
        model.restore_cache(cache, trace.pristine, start)


def _from_layer(model: FeedbackModel, trace: Trace, start: int, layer: int) -> torch.Tensor:
    """The blocks from ``layer`` up, on the clean inputs of that block, from ``start`` on."""
    x = trace.resid[layer]
    if trace.passes is not None:
        model.set_context(trace.passes - 1, None, start)
        return model.stack(x[:, start:], start, trace.cache, from_layer=layer).logits
    logits = []
    for t in range(start, x.shape[1]):
        model.set_context(None, t, t)
        logits.append(model.stack(x[:, t : t + 1], t, trace.cache, from_layer=layer).logits)
    return torch.cat(logits, dim=1)


def replace_where(
    mask: torch.Tensor, values: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
) -> Callable:
    """A hook that replaces its activation at the (batch, pos) positions of ``mask``:
    by ``values`` (batch, pos, ...) taken at the same positions, or by ``values(x)``, a
    function of the activation itself (erasure, steering). It reads ``hook.ctx["offset"]``,
    so it works on whole passes and on single recurrence steps alike."""

    def hook(x: torch.Tensor, hook):
        off = int(hook.ctx.get("offset", 0))
        n = x.shape[1]
        m = mask[:, off : off + n]
        if m.shape[1] != n or not bool(m.any()):
            return None
        v = values(x) if callable(values) else values[:, off : off + n].to(x.dtype)
        return torch.where(m.reshape(*m.shape, *([1] * (x.ndim - 2))), v, x)

    return hook


def first_true(mask: torch.Tensor) -> int | None:
    """The first position any example of the batch has True in ``mask`` (batch, pos)."""
    cols = mask.any(0).nonzero()
    return int(cols[0]) if len(cols) else None

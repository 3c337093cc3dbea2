"""Causal interventions on a full-bandwidth model: patch the fed-back state, a token's
embedding or a residual, and read what the model answers.

A *prefill* (``fbt_probe.prefill.Prefill``) is how the prompt is run: k Jacobi passes or the
exact sequential recurrence. Every intervention acts on the *last* pass (Jacobi) or on the
recurrence itself, the computation whose answer is read.

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

from fbt_probe.feedback import FeedbackModel, PassOutput, cat_positions
from fbt_probe.positions import pos_dim, put, select_positions, take
from fbt_probe.prefill import Prefill, parse_prefill
from fbt_probe.recurrence import recurrence_steps

STATE_HOOK = "fusion.hook_state"


def shift(states: torch.Tensor) -> torch.Tensor:
    """(batch, pos, d) top states h_t -> what position t is fused with, h_{t-1} (zeros at 0)."""
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)


@dataclass
class Trace:
    """One clean run of a batch under one prefill."""

    prefill: Prefill
    emb: torch.Tensor  # (batch, pos, d_model) plain embeddings
    plain: torch.Tensor  # (batch, pos) positions that keep their plain embedding
    prev: torch.Tensor | None  # (batch, pos, d_model) states of the pass before the last (Jacobi)
    out: PassOutput  # the last pass / the recurrence: its top states and (lazy) logits
    cache: object | None  # keys and values of the last pass (None: not kept)
    pristine: object | None = None  # model.snapshot_cache(cache), what patched runs restore
    resid: torch.Tensor | None = None  # (n_layers, batch, pos, d_model) each block's input

    @property
    def states(self) -> torch.Tensor:
        """(batch, pos, d_model) top states of the last pass / the recurrence."""
        return self.out.states

    @property
    def logits(self) -> torch.Tensor:
        """(batch, pos, d_vocab); ``out.logits_at`` reads a few positions without the rest."""
        return self.out.logits

    @property
    def passes(self) -> int | None:
        """Jacobi passes of the prefill; None for the exact recurrence."""
        return self.prefill.passes

    @property
    def fed(self) -> torch.Tensor | None:
        """(batch, pos, d_model): the state each position of the last pass is fused with
        (``fusion.hook_state``'s value there); None under standard prefill."""
        if self.passes is None:
            return shift(self.states)
        return None if self.prev is None else shift(self.prev)


@torch.inference_mode()
def clean_run(
    model: FeedbackModel, tokens: torch.Tensor, prefill: Prefill | str, keep_cache: bool = True
) -> Trace:
    """Run ``tokens`` (batch, pos) once; ``keep_cache`` keeps what ``patched_run`` needs."""
    prefill = parse_prefill(prefill)
    B, T = tokens.shape
    cache = model.new_cache(B, T, device=tokens.device) if keep_cache else None
    model.set_context(1, None, 0)
    emb = model.embed(tokens)
    plain = model.plain_mask(B, T, None, tokens.device)
    resid = None
    hooks = []
    # each block's input in the last pass, for patched runs from a depth
    if keep_cache and model.skips_layers:
        resid = emb.new_zeros(model.cfg.n_layers, B, T, emb.shape[-1])
        last = (prefill.passes or 1) - 1

        def keep(x, hook, layer):
            if hook.ctx.get("pass_number") in (None, last + 1):
                off = int(hook.ctx.get("first_position", 0))
                resid[layer, :, off : off + x.shape[1]] = x

        hooks = [
            (f"blocks.{i}.hook_resid_pre", functools.partial(keep, layer=i))
            for i in range(model.cfg.n_layers)
        ]
    with model.hooks(fwd_hooks=hooks):
        run = prefill.run(model, tokens, cache)
    pristine = model.snapshot_cache(cache) if cache is not None else None
    return Trace(prefill, emb, plain, run.prev, run.out, cache, pristine, resid)


@torch.inference_mode()
def patched_run(
    model: FeedbackModel,
    trace: Trace,
    start: int,
    hooks: list[tuple[str, Callable]] = (),
    emb: torch.Tensor | None = None,
    from_layer: int = 0,
) -> torch.Tensor:
    """``patched_output(...).logits``: (batch, pos - start, d_vocab)."""
    return patched_output(model, trace, start, hooks, emb, from_layer).logits


@torch.inference_mode()
def patched_output(
    model: FeedbackModel,
    trace: Trace,
    start: int,
    hooks: list[tuple[str, Callable]] = (),
    emb: torch.Tensor | None = None,
    from_layer: int = 0,
) -> PassOutput:
    """Re-run the last pass (or the recurrence) of ``trace`` from position ``start`` on, with
    ``hooks`` active and ``emb`` (default: the clean embeddings) as the token embeddings.
    Returns the pass over positions [start, pos): its states and logits (computed when read,
    on a model whose head is lazy; ``logits_at`` reads the answer positions alone).

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
                return recurrence_steps(model, emb, trace.plain, cache, start, carry)
            prev = trace.prev
            if prev is None:  # a plain pass (standard prefill)
                out = model.feedback_pass(
                    emb[:, start:], first_position=start, cache=cache, pass_number=trace.passes
                )
            else:
                out = model.feedback_pass(
                    emb[:, start:],
                    prev[:, start:],
                    carry=prev[:, start - 1 : start] if start > 0 else None,
                    plain=trace.plain[:, start:],
                    first_position=start,
                    cache=cache,
                    pass_number=trace.passes,
                )
            return out
    finally:  # the next patched run reads the clean keys and values again
        model.restore_cache(cache, trace.pristine, start)


def _from_layer(model: FeedbackModel, trace: Trace, start: int, layer: int) -> PassOutput:
    """The blocks from ``layer`` up, on the clean inputs of that block, from ``start`` on."""
    x = trace.resid[layer]
    if trace.passes is not None:
        model.set_context(trace.passes, None, start)
        return model.stack(x[:, start:], start, trace.cache, from_layer=layer)
    outs = []
    for t in range(start, x.shape[1]):
        model.set_context(None, t, t)
        outs.append(model.stack(x[:, t : t + 1], t, trace.cache, from_layer=layer))
    return cat_positions(outs)


def replace_where(
    mask: torch.Tensor, values: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
) -> Callable:
    """A hook that replaces its activation at the (batch, pos) positions of ``mask``:
    by ``values`` (batch, pos, ...) taken at the same positions, or by ``values(x)``, a
    function of the activation itself (erasure, steering). Positions are read through
    ``select_positions``, so it works on whole passes and on single recurrence steps alike."""

    def hook(x: torch.Tensor, hook):
        off, n = int(hook.ctx.get("first_position", 0)), x.shape[pos_dim(hook)]
        if mask.shape[1] < off + n:
            return None
        b, at, src = select_positions(x, hook, mask)
        if len(b) == 0:
            return None
        out = x.clone()
        if callable(values):
            put(out, hook, b, src, take(values(x), hook, b, src))
        else:
            put(out, hook, b, src, take(values, hook, b, at).to(x.dtype))
        return out

    return hook


def first_true(mask: torch.Tensor) -> int | None:
    """The first position any example of the batch has True in ``mask`` (batch, pos)."""
    cols = mask.any(0).nonzero()
    return int(cols[0]) if len(cols) else None

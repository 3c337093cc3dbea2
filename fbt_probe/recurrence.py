"""The exact sequential recurrence: every position fused with the previous position's top
state from the same computation, one position at a time through the KV cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformer_lens import ActivationCache

from fbt_probe.caches import PositionCapture
from fbt_probe.feedback import FeedbackModel, PassOutput, cat_positions


def run_recurrence(
    model: FeedbackModel,
    tokens: torch.Tensor,
    prefix_len=None,
    cache=None,
) -> PassOutput:
    """tokens (batch, pos) -> logits (batch, pos, d_vocab) and states (batch, pos, d_model).

    Position t < max(1, prefix_len) is plain; every later position's input is
    ``fuse(h_{t-1}, e_t)`` with h_{t-1} from this same recurrence. Batched over examples;
    right padding is harmless (causal). ``cache`` (optional) is filled for decoding.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (batch, pos), got shape {tuple(tokens.shape)}")
    B, T = tokens.shape
    cache = cache if cache is not None else model.new_cache(B, T, device=tokens.device)
    model.set_context(None, None, 0)
    emb = model.embed(tokens)
    plain = model.plain_mask(B, T, prefix_len, tokens.device)
    return recurrence_steps(model, emb, plain, cache)


def recurrence_steps(
    model: FeedbackModel,
    emb: torch.Tensor,
    plain: torch.Tensor,
    cache,
    start: int = 0,
    carry: torch.Tensor | None = None,
) -> PassOutput:
    """Steps ``start`` .. pos-1 of the recurrence on embeddings ``emb`` (batch, pos, d_model),
    ``carry`` (batch, 1, d_model) being h_{start-1} and ``cache`` holding the keys and values
    of the positions before ``start``: the whole recurrence from 0, or the rest of one (a
    patched re-run). Returns the logits and states of positions [start, pos); where the
    model's passes compute their logits lazily, so does the whole recurrence."""
    outs = []
    h_prev = carry
    x, first, below = emb, 0, feedback_target(model)
    if below:  # no state reaches the blocks below the target: run them once, every position
        model.set_context(None, None, start)
        x, first = model.run_blocks(emb[:, start:], start, cache, 0, below)[0], start
    for t in range(start, emb.shape[1]):
        out = model.feedback_pass(
            x[:, t - first : t - first + 1],
            carry=h_prev,
            plain=plain[:, t : t + 1],
            first_position=t,
            cache=cache,
            pass_number=None,
            step=t,
            from_layer=below,
        )
        h_prev = out.states
        outs.append(out)
    return cat_positions(outs)


def feedback_target(model: FeedbackModel) -> int:
    """The first block a step of the recurrence must run: the block the fed-back state enters
    (0: the embeddings, the paper's design), or the source block if it lies below (its output
    is fed back, so each step must compute it)."""
    target = getattr(model.cfg, "feedback_target", 0)
    return min(target, model.cfg.source_block) if target else 0


def run_recurrence_with_cache(
    model: FeedbackModel,
    tokens: torch.Tensor,
    names_filter: str | Sequence[str] | Callable[[str], bool] | None = None,
    positions: torch.Tensor | None = None,
    prefix_len=None,
) -> tuple[PassOutput, ActivationCache]:
    """The recurrence with an ``ActivationCache``; ``positions`` (batch,) keeps one position
    per example (e.g. the colon), so memory does not grow with the sequence length."""
    cap = PositionCapture(model, names_filter, positions, 1, by_pass=False)
    with model.hooks(fwd_hooks=[(cap.filter, cap.hook)]):
        out = run_recurrence(model, tokens, prefix_len=prefix_len)
    return out, cap.caches().last

"""Hooks that know their pass: restrict any TransformerLens hook function to chosen passes,
recurrence steps and positions.

Every forward of a ``FeedbackModel`` (Jacobi passes, the sequential recurrence, decoding) fills
``hook.ctx`` before each pass: ``"pass"`` (0 = pass 1, None outside Jacobi passes),
``"step"`` (the position the recurrence or the decoder computes, None in Jacobi passes) and
``"offset"`` (the first position of the tensor the hook sees). ``at`` reads them::

    def patch(x, hook):
        return x_twin  # (batch, pos, d_model)

    model.run_with_hooks(tokens, passes=2,
                         fwd_hooks=[("fusion.hook_state", at(patch, passes=[1], positions=[7]))])

patches the fed-back state of pass 2 at position 7 only; pass 1 and every other position see
what they would have seen. Hooks are added by TransformerLens's ``run_with_hooks`` or
``model.hooks(...)`` context manager, so none stays registered after an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fbt_probe.positions import put, select_positions, take


def _as_set(x) -> set | None:
    if x is None:
        return None
    if isinstance(x, int):
        return {x}
    return set(x)


def at(
    fn: Callable,
    passes: Iterable[int | None] | int | None = None,
    steps: Iterable[int] | int | None = None,
    positions=None,
) -> Callable:
    """``fn(tensor, hook)`` applied only in ``passes`` (0 = pass 1) and recurrence ``steps``,
    and only at absolute ``positions``: an int or a list (the same for every example), or a
    (batch,) / (batch, n) tensor of positions per example. Elsewhere the tensor is unchanged.
    ``fn`` may return a new tensor (a patch) or None (it only reads)."""
    want_pass, want_step = _as_set(passes), _as_set(steps)

    def hook(tensor: torch.Tensor, hook):
        ctx = hook.ctx
        if want_pass is not None and ctx.get("pass") not in want_pass:
            return None
        if want_step is not None and ctx.get("step") not in want_step:
            return None
        if positions is None:
            return fn(tensor, hook)
        b, _, src = select_positions(tensor, hook, positions)
        if len(b) == 0:
            return None
        new = fn(tensor.clone(), hook)
        if new is None:
            return None
        out = tensor.clone()
        put(out, hook, b, src, take(new, hook, b, src))
        return out

    return hook

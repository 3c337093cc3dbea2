"""Hooks that know their pass: restrict any TransformerLens hook function to chosen passes,
recurrence steps and positions.

Every forward of a ``FeedbackModel`` (Jacobi passes, the sequential recurrence, decoding) fills
``hook.ctx`` before each pass: ``"pass_number"`` (counted from 1, as everywhere in
fbt-probe; None outside Jacobi passes), ``"step"`` (the position the recurrence or the
decoder computes, None in Jacobi passes) and ``"first_position"`` (the absolute position of
the tensor's first entry); while ``fbt_probe.decode.generate_tokens`` generates, ``"decode_step"`` is
s for the step that reads generated token s - 1 (fused with its top state, in the modes that
feed it back) and produces token s (None in the prompt's prefill, which produces token 0).
``at`` reads them::

    def patch(x, hook):
        return x_twin  # (batch, pos, d_model)

    model.run_with_hooks(tokens, passes=2,
                         fwd_hooks=[("fusion.hook_state", at(patch, on_pass=2, positions=[7]))])

patches the fed-back state of pass 2 at position 7 only; pass 1 and every other position see
what they would have seen. While generating, ``at(patch, decode_steps=3)`` patches generated
step 3 only, in every decoding mode::

    generate_tokens(model, prompt, "fused", 8, fwd_hooks=[("fusion.hook_state", at(patch, decode_steps=3))])
 Hooks are added by TransformerLens's ``run_with_hooks`` or
``model.hooks(...)`` context manager, so none stays registered after an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fbt_probe.positions import put, select_positions, take

# keys of hook.ctx that are gone, with what replaced them
GONE = {
    "pass": "hook.ctx['pass_number'] (counted from 1: pass 1 is 1)",
    "offset": "hook.ctx['first_position']",
}


class HookContext(dict):
    """``hook.ctx`` and ``model.context``: ``pass_number`` (1 = pass 1; None outside Jacobi
    passes), ``step`` (the position the recurrence or the decoder computes; None in Jacobi
    passes) and ``first_position`` (the absolute position of the tensor's first entry). A key
    of the old vocabulary is refused in one line naming its replacement."""

    def __getitem__(self, key):
        if key in GONE and not super().__contains__(key):
            raise KeyError(f"hook.ctx[{key!r}] is gone: read {GONE[key]}")
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in GONE else super().get(key, default)


def context(
    pass_number: int | None, step: int | None, first_position: int, decode_step: int | None = None
) -> HookContext:
    return HookContext(
        pass_number=pass_number, step=step, first_position=first_position, decode_step=decode_step
    )


def _as_set(x) -> set | None:
    if x is None:
        return None
    if isinstance(x, int):
        return {x}
    return set(x)


def at(
    fn: Callable,
    *legacy,
    on_pass: Iterable[int | None] | int | None = None,
    steps: Iterable[int] | int | None = None,
    positions=None,
    decode_steps: Iterable[int] | int | None = None,
    passes=None,
) -> Callable:
    """``fn(tensor, hook)`` applied only on the passes ``on_pass`` names (counted from 1: pass
        1 is the plain forward) and at recurrence ``steps`` (absolute positions), at generated ``decode_steps`` (s: the step that
    produces generated token s, from 1), and only at absolute ``positions``:
        an int or a list (the same for every example), or a (batch,) / (batch, n) tensor of
        positions per example. Elsewhere the tensor is unchanged. ``fn`` may return a new tensor
        (a patch) or None (it only reads). ``passes=``, which counted from 0, is refused."""
    if passes is not None or legacy:
        old = passes if passes is not None else legacy[0]
        new = sorted(p + 1 for p in _as_set(old) if p is not None) if old is not None else None
        raise TypeError(
            f"at(passes=...) counted passes from 0 and is gone: use "
            f"at(fn, on_pass={new}) (counted from 1)"
        )
    want_pass, want_step, want_decode = _as_set(on_pass), _as_set(steps), _as_set(decode_steps)

    def hook(tensor: torch.Tensor, hook):
        ctx = hook.ctx
        if want_pass is not None and ctx.get("pass_number") not in want_pass:
            return None
        if want_step is not None and ctx.get("step") not in want_step:
            return None
        if want_decode is not None and ctx.get("decode_step") not in want_decode:
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

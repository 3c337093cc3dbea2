"""Positions inside a hook: which entries of the tensor a hook sees are the positions asked for.

A hook sees the positions [offset, offset + n) of its tensor's position axis, ``offset``
being ``hook.ctx["first_position"]`` (0 in a Jacobi pass, t in step t of the recurrence or of
decoding). The axis is the HookPoint's own ``pos_dim`` (1 unless the HookPoint says otherwise:
an attention pattern, (batch, head, query_pos, key_pos), says 2). ``select_positions`` is the
one place that maps absolute positions onto a hook's tensor; ``fbt_probe.hooks.at``,
``fbt_probe.kernels.patching.replace_where`` and the caches of ``FeedbackModel`` use it.
"""

from __future__ import annotations

import torch


def pos_dim(hook) -> int:
    """The position axis of the tensors ``hook`` (a HookPoint) carries: its ``pos_dim``, or
    1 where it sets none (TransformerLens's HookPoint starts it at None)."""
    axis = getattr(hook, "pos_dim", None)
    return 1 if axis is None else axis


def select_positions(tensor: torch.Tensor, hook, positions) -> tuple[torch.Tensor, ...]:
    """The entries of ``tensor`` (at ``hook``) that lie at absolute ``positions``.

    ``positions``: an int or a list (the same in every example), a (batch,) or (batch, n)
    tensor of positions per example, or a (batch, length) bool mask over absolute positions.
    Returns ``(b, j, src)``, three equal-length index tensors: the example, the slot of the
    position in ``positions`` (for a mask, the absolute position itself) and its index along
    the tensor's position axis. Positions the tensor does not hold are left out."""
    B, T = tensor.shape[0], tensor.shape[pos_dim(hook)]
    offset = int(hook.ctx.get("first_position", 0))
    pos = torch.as_tensor(positions, device=tensor.device)
    if pos.dtype == torch.bool:  # (batch or 1, length): one row is every example's
        window = pos[:, offset : offset + T].expand(B, -1)
        b, rel = window.nonzero(as_tuple=True)
        return b, rel + offset, rel
    pos = pos.long()
    if isinstance(positions, torch.Tensor) and pos.ndim in (1, 2) and pos.shape[0] == B:
        pos = pos.view(B, -1)  # per example
    else:
        pos = pos.view(1, -1).expand(B, -1)  # the same positions in every example
    rel = pos - offset
    b, j = ((rel >= 0) & (rel < T)).nonzero(as_tuple=True)
    return b, j, rel[b, j]


def take(tensor: torch.Tensor, hook, b: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``tensor``'s entries at (example b, position src) along the hook's position axis."""
    return tensor[b, src] if pos_dim(hook) == 1 else tensor[b, :, src]


def put(tensor: torch.Tensor, hook, b, dst, values: torch.Tensor) -> None:
    """Write ``values`` (as ``take`` returns them) at (example b, position dst), in place."""
    if pos_dim(hook) == 1:
        tensor[b, dst] = values
    else:
        tensor[b, :, dst] = values

"""How each position's top state moves from pass to pass (the views of Geiping et al. 2025 on
a recurrent-depth model, here on Jacobi passes of the feedback).

``pass_states`` runs K Jacobi passes over a right-padded batch and keeps, per pass, the top
state h^(k) at every position, and the fusion's gate sigma(W_G e_t) averaged over its width
(the gate depends on the token alone, so every feedback pass has the same one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fbt_probe.feedback import FeedbackModel


@dataclass
class PassStates:
    states: torch.Tensor  # (passes, batch, pos, d_model), zero at padded positions
    gate: torch.Tensor | None  # (batch, pos) the mean gate; None without a gated fusion
    out: object  # the MultiPassOutput (each pass's logits, lazily for a large head)


@torch.no_grad()
def pass_states(
    model: FeedbackModel, tokens: torch.Tensor, lengths: torch.Tensor, passes: int
) -> PassStates:
    gate: list[torch.Tensor] = []

    def keep_gate(x, hook):
        if not gate:
            gate.append(x.float().mean(-1))

    with model.hooks(fwd_hooks=[("fusion.hook_gate", keep_gate)]):
        out = model(tokens, passes=passes, lengths=lengths)
    states = torch.stack([p.states for p in out.passes])
    return PassStates(states, gate[0] if gate else None, out)


def distance_to_last(states: torch.Tensor) -> torch.Tensor:
    """(passes, batch, pos): ||h^(k) - h^(K)|| / ||h^(K)|| at every position (0 where h^(K)
    is zero: padding)."""
    last = states[-1]
    norm = last.norm(dim=-1)
    d = (states - last).norm(dim=-1)
    return torch.where(norm > 0, d / norm.clamp_min(1e-12), torch.zeros_like(d))


def pca_2d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, d) -> (n, 2) its coordinates on the first two principal components, and the
    share of the variance each explains."""
    x = x.double() - x.double().mean(0)
    _, s, v = torch.linalg.svd(x, full_matrices=False)
    var = s**2 / (s**2).sum().clamp_min(1e-30)
    return (x @ v[:2].T).float(), var[:2].float()

"""Latent feedback: how the previous position's top state re-enters the bottom of the stack."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from fbt_probe.config import FBTConfig


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


class Fusion(nn.Module):
    """``u_t = RMSNorm(W_U h_{t-1} * sigmoid(W_G e_t))`` (gated), its ablations, or
    ``RMSNorm(W_U h_{t-1})`` (replace: the state instead of the token).

    The state is the *value* and the token only a multiplicative gate: with the state
    gone the input is gone, so the model cannot learn to ignore the feedback (the
    additive form leaves that shortcut, which is why the paper argues against it).
    Hooks: ``hook_state`` (the shifted state h_{t-1}), ``hook_gate``, ``hook_fused``.
    """

    def __init__(self, cfg: FBTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.W_U = nn.Parameter(torch.empty(d, d))
        self.W_G = nn.Parameter(torch.empty(d, d)) if cfg.fusion == "gated" else None
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.hook_state = HookPoint()  # (batch, pos, d_model)
        self.hook_gate = HookPoint()  # (batch, pos, d_model)
        self.hook_fused = HookPoint()  # (batch, pos, d_model)

    def forward(self, state: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """state: (batch, pos, d_model) = h_{t-1}; embed: (batch, pos, d_model) = e_t."""
        state = self.hook_state(state)
        value = state @ self.W_U.T
        if self.cfg.fusion == "gated":
            gate = self.hook_gate(torch.sigmoid(embed @ self.W_G.T))
            return self.hook_fused(self.norm(value * gate))
        if self.cfg.fusion == "replace":
            return self.hook_fused(self.norm(value))
        return self.hook_fused(self.norm(embed + value))  # additive ablation

"""Edge attribution between components (EAP, Syed et al. 2023), through the feedback loop.

Upstream nodes write into the residual: the input of block 0 (the embeddings, or the fusion
from pass 2 on), each head, each MLP, and pass k's top state fed back into pass k+1 (a
``feedback`` edge). Downstream nodes read it: each layer's attention and MLP input and the
readout. An edge's score is the upstream node's change (twin minus clean) dotted with the
gradient at the downstream node's input alone, summed over positions. On the built-in model
a branch's input gradient is derived from the residual's (``dM/d resid_pre - dM/d resid_mid``
for a layer's attention: the residual's own gradient minus the part that skips the layer); a
Hugging Face pre-norm model shows each branch's own input (``hook_attn_in``, ``hook_mlp_in``).
An upstream node's edges therefore add up to its node score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fbt_probe.feedback import FeedbackModel
from fbt_probe.kernels.patching import STATE_HOOK as STATE


@dataclass(frozen=True)
class Edge:
    """``source`` writes into the residual that ``target`` reads, in pass ``pass_number`` (the
    target's pass; a feedback edge's source is the pass before's top state)."""

    pass_number: int | None
    source: str
    target: str

    @property
    def feedback(self) -> bool:
        return self.source.startswith("feedback")


def edge_layout(model: FeedbackModel) -> str | None:
    """How a model shows what each branch reads: ``resid_mid`` (the built-in model: the
    residual between attention and MLP, each branch's input gradient derived from the
    residual's), ``branches`` (a Hugging Face pre-norm model: ``hook_attn_in`` and
    ``hook_mlp_in``, each branch's own copy), or None (edges cannot be scored)."""
    hooks = model.hook_dict
    if model.entry_depth != 0 or not model.n_heads:
        return None
    if "blocks.0.hook_resid_mid" in hooks:
        return "resid_mid"
    if "blocks.0.hook_mlp_in" in hooks and "blocks.0.hook_attn_in" in hooks:
        try:
            model.head_writers(0)
        except (NotImplementedError, ValueError):
            return None
        return "branches"
    return None


def per_position(delta: torch.Tensor, g: torch.Tensor, keep: int = 2) -> torch.Tensor:
    """(delta . g) summed over every dimension after the first ``keep`` (batch, pos[, head])."""
    wide = torch.promote_types(delta.dtype, torch.float32)  # half precision sums in float32
    return (delta.to(wide) * g.to(wide)).reshape(*delta.shape[:keep], -1).sum(-1)


def dot_over(delta: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(batch,): sum over the positions of ``mask`` (batch, pos) and every feature."""
    prod = per_position(delta, g)
    return (prod * mask[:, : prod.shape[1]]).sum(1)


def _branch_inputs(model, p, clean, grad, twin):
    """Per layer: the gradient at what its attention and its MLP each read, and the change of
    the residual between them."""
    L = model.cfg.n_layers
    pre = [(f"blocks.{i}.hook_resid_pre", p) for i in range(L)]
    top = (f"blocks.{L - 1}.hook_resid_post", p)
    post = [grad[pre[i + 1]] if i + 1 < L else grad[top] for i in range(L)]
    if edge_layout(model) == "branches":
        attn = [grad[(f"blocks.{i}.hook_attn_in", p)] for i in range(L)]
        mids = [(f"blocks.{i}.hook_mlp_in", p) for i in range(L)]
        mlp = [grad[m] for m in mids]
    else:  # d resid_pre = d attn input + d resid_mid; d resid_mid = d mlp input + d resid_post
        mids = [(f"blocks.{i}.hook_resid_mid", p) for i in range(L)]
        attn = [grad[pre[i]] - grad[mids[i]] for i in range(L)]
        mlp = [grad[mids[i]] - post[i] for i in range(L)]
    d_mid = [twin[m] - clean[m] for m in mids]
    return attn, mlp, d_mid


def edge_scores(model, clean, grad, twin, mask, edges: dict) -> None:
    """Every edge of every pass (see the module docstring), summed over the positions of
    ``mask`` (batch, pos)."""
    L = model.cfg.n_layers
    for p in sorted({p for (_, p) in clean}, key=lambda p: p or 0):
        attn, mlp, d_mid = _branch_inputs(model, p, clean, grad, twin)
        pre = [(f"blocks.{i}.hook_resid_pre", p) for i in range(L)]
        top = (f"blocks.{L - 1}.hook_resid_post", p)
        targets = {f"attn {i}": attn[i] for i in range(L)}
        targets.update({f"mlp {i}": mlp[i] for i in range(L)})
        targets["readout"] = grad[top]
        order = {
            t: (int(t.split()[1]) * 2 + (t[0] == "m") if t != "readout" else 2 * L) for t in targets
        }
        d = {n: twin[n] - clean[n] for n in (*pre, top)}
        mlp_out = [(d[pre[i + 1]] if i + 1 < L else d[top]) - d_mid[i] for i in range(L)]
        sources = {"input": (d[pre[0]], -1)}
        sources.update({f"mlp {i}": (mlp_out[i], 2 * i + 1) for i in range(L)})
        for name, (delta, at) in sources.items():
            prods = {t: dot_over(delta, gt, mask) for t, gt in targets.items() if order[t] > at}
            edges.update({Edge(p, name, t): v for t, v in prods.items()})
        for i in range(L):
            _head_edges(model, i, p, clean, twin, targets, order, mask, edges)
        if (STATE, p) in clean:
            fed = twin[(STATE, p)] - clean[(STATE, p)]
            edges[Edge(p, "feedback", "input")] = dot_over(fed, grad[(STATE, p)], mask)


def _head_edges(model, layer, p, clean, twin, targets, order, mask, edges: dict) -> None:
    """Each head of ``layer``: its output's change (z through its slice of W_O) dotted with
    every later input's gradient."""
    z = f"blocks.{layer}.attn.hook_z"
    dz = twin[(z, p)] - clean[(z, p)]  # (batch, pos, head, d_head)
    W = model.head_writers(layer)  # (d_model, head, d_head)
    for t, gt in targets.items():
        if order[t] <= 2 * layer:
            continue
        wide = torch.promote_types(dz.dtype, torch.float32)
        gz = torch.einsum("btd,dhe->bthe", gt.to(wide), W.to(wide))
        per = (dz.to(wide) * gz).sum(-1) * mask[:, : dz.shape[1], None]  # (batch, pos, head)
        for h, s in enumerate(per.sum(1).unbind(1)):
            edges[Edge(p, f"head {layer}.{h}", t)] = s

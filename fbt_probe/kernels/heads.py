"""Attention by pass: what every head of every pass attends to, reduced inside the hook.

A full pattern is (batch, head, pos, pos) per layer and pass; only three numbers per head and
example are kept, and one row of the pattern for a shown example:

- ``prev_token``: the weight of position t on t - 1, averaged over the positions 1..read;
- ``label``: the weight of the read position (whose next token is the answer) on the
  label-bearing token;
- ``label_next``: its weight on the token after it, whose input from pass 2 on is fused with
  the label-bearing token's state (the feedback's copy of the label);
- ``row``: the read position's whole row (batch, head, key_pos), for the examples asked for.

``pair_weights`` gives the weight of any chosen query position on any chosen key position.

``induction_scores`` is the standard induction test (Olsson et al. 2022): on a random sequence
repeated once, ``[BOS] r r``, the weight of each token of the repeat on the token after its
first occurrence. Everything works on any ``FeedbackModel`` with per-head hooks
(``model.n_heads`` > 0): the built-in model and Hugging Face models through eager attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fbt_probe.feedback import FeedbackModel


def pattern_hooks(model: FeedbackModel) -> list[str]:
    """``blocks.{l}.attn.hook_pattern`` of every layer, in order."""
    if not model.n_heads:
        raise ValueError(
            "this model has no per-head attention hooks (its attention layout is "
            "not one fbt-probe knows)"
        )
    return [f"blocks.{i}.attn.hook_pattern" for i in range(model.cfg.n_layers)]


def read_patterns(model: FeedbackModel, tokens: torch.Tensor, passes: int, read) -> None:
    """A ``passes``-pass forward of ``tokens`` with ``read(pattern, pass, layer)`` called on
    every layer's pattern (batch, head, query_pos, key_pos) in every pass."""
    hooks = [
        (
            name,
            functools.partial(
                lambda x, hook, layer: read(x, hook.ctx["pass_number"] - 1, layer), layer=i
            ),
        )
        for i, name in enumerate(pattern_hooks(model))
    ]
    with model.hooks(fwd_hooks=hooks):
        model(tokens, passes=passes, keep_all=False)


@dataclass
class HeadReads:
    """Per pass, layer, example and head: (passes, layers, batch, heads)."""

    prev_token: torch.Tensor
    label: torch.Tensor
    label_next: torch.Tensor
    # example -> (passes, layers, heads, key_pos): its read position's row
    rows: dict[int, torch.Tensor]


@torch.inference_mode()
def head_reads(
    model: FeedbackModel,
    tokens: torch.Tensor,
    read: torch.Tensor,
    label: torch.Tensor,
    passes: int,
    show: tuple[int, ...] = (),
) -> HeadReads:
    """tokens (batch, pos), right-padded; read, label (batch,): the read position and the
    label-bearing token of each example (label < read); ``show``: the examples whose read row
    is kept."""
    pattern_hooks(model)  # refuses a model without per-head hooks before any work
    B, L, H = tokens.shape[0], model.cfg.n_layers, model.n_heads
    prev = torch.zeros(passes, L, B, H)
    lab = torch.zeros(passes, L, B, H)
    nxt = torch.zeros(passes, L, B, H)
    rows = {j: torch.zeros(passes, L, H, int(read[j]) + 1) for j in show}
    r = torch.arange(B, device=tokens.device)
    t = torch.arange(1, tokens.shape[1], device=tokens.device)
    upto = (t[None] <= read[:, None]).float()  # (batch, pos - 1): positions 1..read

    def reduce(x, k, layer):  # x: (batch, head, query_pos, key_pos)
        diag = x.diagonal(offset=-1, dim1=-2, dim2=-1)  # (batch, head, pos - 1): t on t - 1
        prev[k, layer] = ((diag * upto[:, None]).sum(-1) / upto.sum(-1)[:, None]).float().cpu()
        lab[k, layer] = x[r, :, read, label].float().cpu()
        nxt[k, layer] = x[r, :, read, (label + 1).clamp(max=x.shape[-1] - 1)].float().cpu()
        for j, row in rows.items():
            row[k, layer] = x[j, :, int(read[j]), : row.shape[-1]].float().cpu()

    read_patterns(model, tokens, passes, reduce)
    return HeadReads(prev, lab, nxt, rows)


@torch.inference_mode()
def pair_weights(
    model: FeedbackModel, tokens: torch.Tensor, query: torch.Tensor, key: torch.Tensor, passes: int
) -> torch.Tensor:
    """(passes, layers, batch, n, heads): every head's weight of query position
    ``query[b, i]`` on key position ``key[b, i]`` (both (batch, n)), in every pass."""
    pattern_hooks(model)
    B, n = query.shape
    out = torch.zeros(passes, model.cfg.n_layers, B, n, model.n_heads)
    r = torch.arange(B, device=tokens.device)[:, None].expand(B, n)

    def reduce(x, k, layer):  # x: (batch, head, query_pos, key_pos)
        out[k, layer] = x.permute(0, 2, 3, 1)[r, query, key].float().cpu()

    read_patterns(model, tokens, passes, reduce)
    return out


def repeated_tokens(
    ids: torch.Tensor, n_seq: int, half: int, bos: int | None, seed: int
) -> torch.Tensor:
    """(n_seq, [1 +] 2 * half): ``[BOS] r r`` with r drawn uniformly from ``ids``."""
    g = torch.Generator().manual_seed(seed)
    r = ids[torch.randint(len(ids), (n_seq, half), generator=g)]
    parts = [r, r] if bos is None else [torch.full((n_seq, 1), bos, dtype=r.dtype), r, r]
    return torch.cat(parts, dim=1)


@torch.inference_mode()
def induction_scores(
    model: FeedbackModel, tokens: torch.Tensor, half: int, passes: int
) -> torch.Tensor:
    """(passes, layers, n_seq, heads): on ``repeated_tokens`` (with BOS or not: the repeat
    is the last ``2 * half`` positions), the mean weight of each token of the second copy on
    the token after its first occurrence."""
    pattern_hooks(model)
    n, T = tokens.shape
    start = T - half  # the first position of the second copy
    out = torch.zeros(passes, model.cfg.n_layers, n, model.n_heads)

    def reduce(x, k, layer):
        # query t >= start attends to t - half + 1: the diagonal at offset 1 - half
        d = x.diagonal(offset=1 - half, dim1=-2, dim2=-1)  # query positions half - 1 .. T - 1
        out[k, layer] = d[..., start - (half - 1) :].mean(-1).float().cpu()

    read_patterns(model, tokens, passes, reduce)
    return out

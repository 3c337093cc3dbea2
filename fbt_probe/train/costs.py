"""What a model of a given shape costs, from its config alone: parameters, FLOPs per token
and memory per rank (``fbt-probe train --dry-run``; the formulas are in docs/distributed.md).
"""

from __future__ import annotations

import torch

from fbt_probe.config import FBTConfig
from fbt_probe.stack import FBTModel
from fbt_probe.train.steps import plan_of


def param_formula(cfg: FBTConfig) -> dict[str, int]:
    """Parameters by part: the tied embedding V·D, per block 4·D² (attention) + 2·D·F (MLP)
    + 2·D (norms), the final norm D, the fusion 2·D² + D (gated; D² + D additive; 0 none)."""
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.d_mlp, cfg.d_vocab
    # W_U and the norm exist for every option (with "none" they are never called); W_G only
    # for the gated fusion
    fusion = (2 if cfg.fusion == "gated" else 1) * D * D + D
    return {
        "embedding": V * D,
        "blocks": L * (4 * D * D + 2 * D * F + 2 * D),
        "final_norm": D,
        "fusion": fusion,
    }


def count_on_meta(cfg: FBTConfig) -> int:
    """Parameters of the real module, built on the meta device (nothing is allocated)."""

    with torch.device("meta"):
        model = FBTModel(cfg)
    return sum(p.numel() for p in model.parameters())


def matmul_flops(cfg: FBTConfig, feedback: bool) -> float:
    """Forward FLOPs per token of one pass's matmuls: 2 per weight of the blocks and the
    unembedding, and of the fusion in a feedback pass (2·D² gated, D² additive)."""
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.d_mlp, cfg.d_vocab
    fusion = {"gated": 2 * D * D, "additive": D * D, "none": 0}[cfg.fusion] if feedback else 0
    return 2 * (L * (4 * D * D + 2 * D * F) + V * D + fusion)


def flops_per_token(cfg: FBTConfig, passes: int, context: int | None = None) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token for a ``passes``-pass step:
    each pass 2 FLOPs per weight of every matmul (blocks and unembedding) plus causal
    attention 2·L·T·D at context T; every pass after the first also runs the fusion (2·D²)."""
    attention = 2 * cfg.n_layers * (context or cfg.n_ctx) * cfg.d_model
    forward = [matmul_flops(cfg, feedback=k > 0) + attention for k in range(passes)]
    return 3.0 * sum(forward)


def pass_equivalents(mix: list[float]) -> float:
    """Mean passes per token of a pass mix (share of 1-, 2-, 3-pass batches ...)."""
    return float(sum((k + 1) * p for k, p in enumerate(mix)) / sum(mix))


def memory_per_rank(n_params: int, world_size: int, sharded: bool) -> dict[str, float]:
    """Bytes per rank of the model states in fp32 with AdamW: weights 4, gradients 4, two
    moments 8 per parameter; FSDP shards all of them over the ranks (activations come on top
    and depend on the batch)."""
    per = {"weights": 4, "gradients": 4, "adamw_moments": 8}
    div = world_size if sharded else 1
    out = {k: v * n_params / div for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


def dry_run(cfg, world_size: int = 8) -> str:
    """The report ``fbt-probe train --dry-run`` prints for a recipe (``TrainConfig``)."""

    m = cfg.model
    n = count_on_meta(m)
    parts = param_formula(m)
    formula = sum(parts.values())
    fusion_mm = (2 if m.fusion == "gated" else 1) * m.d_model**2
    lines = [
        f"{cfg.name}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads x "
        f"{m.d_head}, MLP {m.d_mlp}, vocabulary {m.d_vocab}, context {m.n_ctx}, fusion {m.fusion}",
        f"parameters: {n:,} (built on the meta device; the formula gives {formula:,}: "
        f"embedding {parts['embedding']:,}, blocks {parts['blocks']:,}, fusion {parts['fusion']:,})",
        f"fusion matrices: {fusion_mm:,} ({100 * fusion_mm / n:.2f} % of the parameters)",
        f"training FLOPs per token at context {m.n_ctx}: "
        + ", ".join(
            f"{k} pass{'es' if k > 1 else ''} {flops_per_token(m, k):.3g}" for k in (1, 2, 3)
        ),
    ]
    mixes = [plan_of(cfg, s).passes for s in range(cfg.steps)]
    mean = sum(pass_equivalents(x) for x in mixes) / len(mixes)
    main = max(set(map(tuple, mixes)), key=lambda x: sum(tuple(y) == x for y in mixes))
    lines.append(
        f"pass mix: {' / '.join(f'{100 * p:g} %' for p in main)} (most steps) = "
        f"{pass_equivalents(list(main)):.3g} passes per token (200B tokens cost as "
        f"{200 * pass_equivalents(list(main)):.0f}B); over the whole schedule {mean:.3g}"
    )
    gib = 2**30
    ddp = memory_per_rank(n, world_size, sharded=False)
    fsdp = memory_per_rank(n, world_size, sharded=True)
    lines.append(
        f"model states per rank (fp32 weights, gradients, AdamW moments) at world size "
        f"{world_size}: DDP {ddp['total'] / gib:.1f} GiB, FSDP {fsdp['total'] / gib:.1f} GiB "
        "(activations come on top)"
    )
    return "\n".join(lines)

"""The latent channel while the model generates: residuals at every depth of every generated
step, and closed-loop interventions that swap what one step reads for a twin's and let the
model go on generating from there.

Generated step s is the forward that produces token s: step 0 is the prompt's last position
(under the mode's prefill), step s >= 1 reads token s - 1, fused with step s - 1's top state
in the modes that feed it back (``fbt_probe.decode``). Hooks see ``decode_step`` = s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fbt_probe.decode import Decoded, decode, decode_steps
from fbt_probe.feedback import FeedbackModel
from fbt_probe.hooks import at
from fbt_probe.prefill import DecodeMode, decode_mode

# what a closed-loop intervention swaps at step s for the twin's: the fed-back state h_{s-1},
# the embedding of token s - 1, or both
KINDS = ("state", "token", "both")
SITES = {
    "state": ("fusion.hook_state",),
    "token": ("hook_embed",),
    "both": ("fusion.hook_state", "hook_embed"),
}


@torch.no_grad()
def step_residuals(
    model: FeedbackModel,
    prompt: torch.Tensor,
    mode: str | DecodeMode,
    n_steps: int,
    names: list[str] | None = None,
) -> tuple[Decoded, dict]:
    """Greedy decoding of ``n_steps`` tokens after equal-length prompts (batch, pos), with the
    residual at each hook of ``names`` (default: the depths, ``model.depth_hooks()``) at every
    generated step: {name: (batch, n_steps, d_model)}. Step 0 is read at the prompt's last
    position in the prefill's last pass (or its last step of the exact recurrence)."""
    mode = decode_mode(mode)
    names = list(names or model.depth_hooks())
    T, passes = prompt.shape[1], mode.prefill.passes
    got: dict[str, list] = {n: [None] * n_steps for n in names}

    def grab(x: torch.Tensor, hook) -> None:
        c = hook.ctx
        if c.get("decode_step") is not None:
            got[hook.name][c["decode_step"]] = x[:, -1].clone()
        elif passes is None and c.get("step") == T - 1:
            got[hook.name][0] = x[:, -1].clone()
        elif passes is not None and c.get("pass_number") == passes:
            got[hook.name][0] = x[:, T - 1 - c["first_position"]].clone()

    d = decode(model, prompt, mode, n_steps, fwd_hooks=[(n, grab) for n in names])
    missing = [n for n in names if any(v is None for v in got[n])]
    if missing:
        raise ValueError(f"hook {missing[0]} did not fire at every generated step")
    return d, {n: torch.stack(v, 1) for n, v in got.items()}


@dataclass
class ClosedLoop:
    """A closed-loop battery on a batch: the example's own decoding (``clean``), the twin's
    (``twin``), and for each (kind, step s) the tokens (batch, n_steps) and logits at the clean
    and twin tokens (batch, n_steps, 2) of the example's decoding with step s's input swapped
    for the twin's (steps before s are the clean run's)."""

    clean: Decoded
    twin: Decoded
    steps: tuple[int, ...]
    kinds: tuple[str, ...]
    tokens: dict = field(default_factory=dict)  # (kind, s) -> (batch, n_steps)
    pair_logits: dict = field(default_factory=dict)  # (kind, s) -> (batch, n_steps, 2)


def pair_logits(logits: torch.Tensor, clean: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
    """(batch, steps, 2): the logits (batch, steps, d_vocab) at each step's clean and twin token."""
    return torch.stack(
        [logits.gather(-1, clean[..., None])[..., 0], logits.gather(-1, twin[..., None])[..., 0]],
        -1,
    )


@torch.no_grad()
def closed_loop(
    model: FeedbackModel,
    prompt: torch.Tensor,
    twin_prompt: torch.Tensor,
    mode: str | DecodeMode,
    n_steps: int,
    kinds=KINDS,
    steps=None,
) -> ClosedLoop:
    """Decode ``prompt`` and ``twin_prompt`` (equal shapes, (batch, pos)) for ``n_steps`` tokens
    each, then for every kind of ``kinds`` and step s of ``steps`` (default 1 .. n_steps - 1)
    swap step s's input for the twin's (``KINDS``; with ``fbt_probe.hooks.at(...,
    decode_steps=s)`` on ``fusion.hook_state`` / ``hook_embed``) and keep generating. The
    prompt's prefill runs once: each swapped run re-uses the clean run's KV cache up to step s
    (put back from a snapshot) and computes steps s .. n_steps - 1 only."""
    if prompt.shape != twin_prompt.shape:
        raise ValueError("an example and its twin must have prompts of the same length")
    mode = decode_mode(mode)
    B, T = prompt.shape
    steps = tuple(range(1, n_steps)) if steps is None else tuple(steps)
    if any(not 1 <= s < n_steps for s in steps):
        raise ValueError(f"steps must be in 1..{n_steps - 1}")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown intervention {k!r}; choose from {', '.join(KINDS)}")
    cache = model.new_cache(B, T + n_steps - 1, device=prompt.device)
    clean = decode(model, prompt, mode, n_steps, keep_logits=True, cache=cache)
    twin = decode(model, twin_prompt, mode, n_steps, keep_logits=True)
    res = ClosedLoop(clean, twin, steps, tuple(kinds))
    res.tokens[None] = clean.tokens
    res.pair_logits[None] = pair_logits(clean.logits, clean.tokens, twin.tokens)
    res.pair_logits["twin"] = pair_logits(twin.logits, clean.tokens, twin.tokens)
    pristine = model.snapshot_cache(cache)
    twin_embed = model.embed(twin.tokens)  # (batch, n_steps, d_model)
    for kind in kinds:
        for s in steps:
            swap = {
                "fusion.hook_state": twin.states[:, s - 1 : s],
                "hook_embed": twin_embed[:, s - 1 : s],
            }
            hooks = [
                (site, at(lambda x, hook, v=swap[site]: v, decode_steps=s)) for site in SITES[kind]
            ]
            model.restore_cache(cache, pristine, T + s - 1)
            with model.hooks(fwd_hooks=hooks):
                d = decode_steps(
                    model,
                    mode,
                    cache,
                    T,
                    clean.tokens[:, s - 1],
                    clean.states[:, s - 1 : s],
                    s,
                    n_steps,
                    keep_logits=True,
                )
            toks = torch.cat([clean.tokens[:, :s], d.tokens], 1)
            logits = torch.cat([clean.logits[:, :s], d.logits], 1)
            res.tokens[kind, s] = toks
            res.pair_logits[kind, s] = pair_logits(logits, clean.tokens, twin.tokens)
    return res

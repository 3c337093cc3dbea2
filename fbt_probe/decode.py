"""Decoding with a KV cache in the paper's modes (``fbt_probe.prefill.MODES``): the prompt
runs under the mode's prefill, then each generated token runs on its plain embedding
(``standard``) or fused with the previous step's top state (``soft``, ``fused``, ``full``).
The KV cache layout is the ordinary one; a fused step costs two extra D x D matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fbt_probe.feedback import FeedbackModel
from fbt_probe.prefill import DecodeMode, decode_mode


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """logits (batch, d_vocab) -> next token (batch,)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: FeedbackModel,
    prompt: torch.Tensor,
    mode: str | DecodeMode = "soft",
    max_new_tokens: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    return_states: bool = False,
):
    """Continue equal-length prompts (batch, pos); greedy when ``temperature`` is 0.

    Returns the new tokens (batch, max_new_tokens), and with ``return_states`` also the top
    state of every generated step (batch, max_new_tokens, d_model).
    """
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError("prompt must be a non-empty (batch, pos) tensor")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    mode = decode_mode(mode)
    B, T = prompt.shape
    gen = torch.Generator(device=prompt.device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(B, T + max_new_tokens - 1, device=prompt.device)
    out = mode.prefill.run(model, prompt, cache).out
    h = out.states[:, -1:]  # (batch, 1, d_model)
    tok = _pick(out.logits[:, -1], temperature, gen)
    new, states = [tok], [h]
    for i in range(max_new_tokens - 1):
        model.set_context(None, T + i, T + i)
        e = model.embed(tok[:, None])
        carry = h if mode.soft else None  # fused with the previous step's state
        out = model.feedback_pass(
            e, carry=carry, first_position=T + i, cache=cache, pass_number=None, step=T + i
        )
        h = out.states
        tok = _pick(out.logits[:, -1], temperature, gen)
        new.append(tok)
        states.append(h)
    tokens = torch.stack(new, dim=1)
    return (tokens, torch.cat(states, dim=1)) if return_states else tokens


@torch.no_grad()
def generate_ragged(
    model: FeedbackModel,
    prompts: Sequence[Sequence[int]],
    mode: str | DecodeMode = "soft",
    max_new_tokens: int = 1,
    batch_size: int = 256,
) -> list[list[int]]:
    """Greedy continuation of prompts of different lengths (batched by equal length)."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    for _, idx in sorted(by_len.items()):
        for s in range(0, len(idx), batch_size):
            chunk = idx[s : s + batch_size]
            x = torch.tensor([list(prompts[i]) for i in chunk], device=device)
            toks = generate(model, x, mode, max_new_tokens).tolist()
            for i, t in zip(chunk, toks, strict=True):
                out[i] = t
    return out

"""Decoding with a KV cache in the paper's modes (``fbt_probe.prefill.MODES``): the prompt
runs under the mode's prefill, then each generated token runs on its plain embedding
(``standard``) or fused with the previous step's top state (``soft``, ``fused``, ``full``).
The KV cache layout is the ordinary one; a fused step costs two extra D x D matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from fbt_probe.feedback import FeedbackModel
from fbt_probe.prefill import DecodeMode, decode_mode


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """logits (batch, d_vocab) -> next token (batch,)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Decoded:
    """What a decoding computed, one entry per generated step s (token s; step 0 is the
    prompt's last position): the tokens (batch, steps), each step's top state (batch, steps,
    d_model) and, where kept, its logits (batch, steps, d_vocab)."""

    tokens: torch.Tensor
    states: torch.Tensor
    logits: torch.Tensor | None = None


def decode_steps(
    model: FeedbackModel,
    mode: DecodeMode,
    cache,
    prompt_len: int,
    tok: torch.Tensor,
    h: torch.Tensor,
    first: int,
    stop: int,
    temperature: float = 0.0,
    generator=None,
    keep_logits: bool = False,
) -> Decoded:
    """Decoding steps ``first`` .. ``stop - 1`` after a prompt of ``prompt_len`` positions whose
    keys and values (and those of every step before ``first``) are in ``cache``: step s reads
    token s - 1 (``tok``, (batch,)) at position prompt_len + s - 1, fused with its top state
    (``h``, (batch, 1, d_model)) in the modes that feed it back, and produces token s. Hooks
    see ``decode_step`` = s. A re-run from step s overwrites the cache from that position on."""
    new, states, logits = [], [], []
    for s in range(first, stop):
        pos = prompt_len + s - 1
        model.set_context(None, pos, pos, decode_step=s)
        e = model.embed(tok[:, None])
        carry = h if mode.soft else None  # fused with the previous step's state
        out = model.feedback_pass(
            e,
            carry=carry,
            first_position=pos,
            cache=cache,
            pass_number=None,
            step=pos,
            decode_step=s,
        )
        h, last = out.states, out.logits[:, -1]
        tok = _pick(last, temperature, generator)
        new.append(tok)
        states.append(h)
        if keep_logits:
            logits.append(last)
    B, D = h.shape[0], h.shape[-1]
    return Decoded(
        torch.stack(new, 1) if new else tok.new_zeros(B, 0),
        torch.cat(states, 1) if states else h.new_zeros(B, 0, D),
        torch.stack(logits, 1) if logits else None,
    )


@torch.no_grad()
def decode(
    model: FeedbackModel,
    prompt: torch.Tensor,
    mode: str | DecodeMode = "soft",
    max_new_tokens: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    fwd_hooks=(),
    keep_logits: bool = False,
    cache=None,
) -> Decoded:
    """Continue equal-length prompts (batch, pos) by ``max_new_tokens`` tokens (greedy when
    ``temperature`` is 0) and return every step's token, top state and (``keep_logits``)
    logits. ``fwd_hooks`` ((name, fn) pairs, as TransformerLens's ``run_with_hooks`` takes)
    are active for the whole of it; ``fbt_probe.hooks.at(fn, decode_steps=s)`` restricts one
    to generated step s. ``cache``: a KV cache of at least pos + max_new_tokens - 1
    positions to fill (a new one by default), kept for a re-run from a later step."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError("prompt must be a non-empty (batch, pos) tensor")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    mode = decode_mode(mode)
    B, T = prompt.shape
    gen = torch.Generator(device=prompt.device).manual_seed(seed) if seed is not None else None
    if cache is None:
        cache = model.new_cache(B, T + max_new_tokens - 1, device=prompt.device)
    with model.hooks(fwd_hooks=list(fwd_hooks)) if fwd_hooks else nullcontext():
        out = mode.prefill.run(model, prompt, cache).out
        h, first = out.states[:, -1:], out.logits[:, -1]  # (batch, 1, d_model), (batch, d_vocab)
        tok = _pick(first, temperature, gen)
        rest = decode_steps(
            model, mode, cache, T, tok, h, 1, max_new_tokens, temperature, gen, keep_logits
        )
    logits = torch.cat([first[:, None], rest.logits], 1) if keep_logits else None
    return Decoded(
        torch.cat([tok[:, None], rest.tokens], 1), torch.cat([h, rest.states], 1), logits
    )


@torch.no_grad()
def generate_tokens(
    model: FeedbackModel,
    prompt: torch.Tensor,
    mode: str | DecodeMode = "soft",
    max_new_tokens: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    return_states: bool = False,
    fwd_hooks=(),
):
    """Continue equal-length prompts (batch, pos); greedy when ``temperature`` is 0.

    Returns the new tokens (batch, max_new_tokens), and with ``return_states`` also the top
    state of every generated step (batch, max_new_tokens, d_model). ``fwd_hooks`` apply while
    it runs (see ``decode``: ``at(fn, decode_steps=s)`` for one generated step).
    """
    d = decode(model, prompt, mode, max_new_tokens, temperature, seed, fwd_hooks)
    return (d.tokens, d.states) if return_states else d.tokens


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
            toks = generate_tokens(model, x, mode, max_new_tokens).tolist()
            for i, t in zip(chunk, toks, strict=True):
                out[i] = t
    return out

"""The built-in stack: rotary attention, MLP and blocks read top to bottom, then ``FBTModel``,
a ``FeedbackModel`` (``fbt_probe.feedback``) whose layers are these. Sequential recurrence and
decoding, which use the KV cache, live in ``recurrence.py`` and ``decode.py``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens.hook_points import HookPoint

from fbt_probe.config import TOP, FBTConfig
from fbt_probe.feedback import FeedbackModel, PassOutput, check_context
from fbt_probe.fusion import Fusion, RMSNorm
from fbt_probe.hooks import context


class KVCache:
    """Keys and values of every layer for positions [0, length), preallocated to ``max_len``."""

    def __init__(self, cfg: FBTConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        check_context(max_len, cfg.n_ctx)
        shape = (cfg.n_layers, batch, cfg.n_heads, max_len, cfg.d_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # smeared keys: the unsmeared key of the last cached position is needed for the next
        self.k_raw = torch.zeros(shape, device=device, dtype=dtype) if cfg.smear_keys else None
        self.length = 0


class _Growing:
    """One of a cache's tensors as attention writes and reads it (``x[layer, :, :, a:b] = new``,
    ``x[layer, :, :, :b]``), each write making a new tensor: autograd can then go back through
    every step of the recurrence, where a preallocated cache written in place cannot."""

    def __init__(self, n_layers: int):
        self.layers: list[torch.Tensor | None] = [None] * n_layers

    def __setitem__(self, index, value: torch.Tensor) -> None:
        layer, span = index[0], index[-1]
        old = self.layers[layer]
        kept = old[:, :, : span.start] if old is not None else value[:, :, :0]
        self.layers[layer] = torch.cat([kept, value], dim=2)

    def __getitem__(self, index) -> torch.Tensor:
        return self.layers[index[0]][:, :, index[-1]]


class GrowingKVCache(KVCache):
    """A ``KVCache`` that keeps the autograd graph: what gradients through the exact recurrence
    run on (``fbt_probe.kernels.attribution``); slower than the preallocated one."""

    def __init__(self, cfg: FBTConfig):
        self.k, self.v = _Growing(cfg.n_layers), _Growing(cfg.n_layers)
        self.k_raw = _Growing(cfg.n_layers) if cfg.smear_keys else None
        self.length = 0


def rotary_tables(cfg: FBTConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (n_ctx, d_head) for rotate-half rotary embeddings."""
    half = cfg.d_head // 2
    inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(cfg.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, pos, d_head); cos/sin: (pos, d_head)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: FBTConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.smears = cfg.smears(layer)
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(h * dh, d))
        self.W_K = nn.Parameter(torch.empty(h * dh, d))
        self.W_V = nn.Parameter(torch.empty(h * dh, d))
        self.W_O = nn.Parameter(torch.empty(d, h * dh))
        if self.smears:  # per head; set by ``init_weights`` (FBTConfig.smear_spread)
            self.smear = nn.Parameter(torch.zeros(h))
            self.hook_smear = HookPoint()  # (head,): each head's weight on its own key
        self.hook_q = HookPoint()  # (batch, pos, head, d_head)
        self.hook_k = HookPoint()  # (batch, pos, head, d_head)
        self.hook_v = HookPoint()  # (batch, pos, head, d_head)
        # (batch, head, query_pos, key_pos); computed only if hooked
        self.hook_pattern = HookPoint()
        self.hook_pattern.pos_dim = 2  # its query positions: fbt_probe.positions reads it
        self.hook_z = HookPoint()  # (batch, pos, head, d_head)

    def forward(self, x, rope, offset: int, cache: KVCache | None, layer: int) -> torch.Tensor:
        """x: (batch, pos, d_model) for positions [offset, offset + pos)."""
        B, T, _ = x.shape
        H, dh = self.cfg.n_heads, self.cfg.d_head
        q = self.hook_q((x @ self.W_Q.T).view(B, T, H, dh)).transpose(1, 2)
        k = self.hook_k((x @ self.W_K.T).view(B, T, H, dh)).transpose(1, 2)
        v = self.hook_v((x @ self.W_V.T).view(B, T, H, dh)).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][offset : offset + T], rope[1][offset : offset + T]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.smears:
            k = self._smear(k, offset, cache, layer)
        if cache is not None:
            cache.k[layer, :, :, offset : offset + T] = k
            cache.v[layer, :, :, offset : offset + T] = v
            k, v = cache.k[layer, :, :, : offset + T], cache.v[layer, :, :, : offset + T]
        S = k.shape[2]
        if self.hook_pattern.fwd_hooks:  # explicit pattern only when someone looks at it
            scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
            mask = (
                torch.arange(S, device=x.device)[None, :]
                > (offset + torch.arange(T, device=x.device))[:, None]
            )
            pattern = self.hook_pattern(scores.masked_fill(mask, float("-inf")).softmax(-1))
            z = pattern @ v
        elif S == T:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:
            # one query (the recurrence, decoding): two small matmuls beat the flash kernel,
            # whose per-block overhead dominates a query of small heads (bench/model.py)
            z = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))).softmax(-1) @ v
        else:
            keep = (
                torch.arange(S, device=x.device)[None, :]
                <= (offset + torch.arange(T, device=x.device))[:, None]
            )
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        z = self.hook_z(z.transpose(1, 2))  # (batch, pos, head, d_head)
        return z.reshape(B, T, H * dh) @ self.W_O.T

    def _smear(self, k, offset: int, cache: KVCache | None, layer: int) -> torch.Tensor:
        """k'_t = a k_t + (1 - a) k_{t-1} on rotated keys, so that the previous token's part
        keeps its own position; before position 0 (or the first position this call sees,
        without a cache) the key is zero."""
        B, H, T, dh = k.shape
        # in the projection's memory order (batch, pos, head * d_head) the per-head weight
        # broadcasts along the contiguous axis: a (1, H, 1, 1) broadcast over the transposed
        # keys ran several times slower than the attention itself
        kf = k.transpose(1, 2).reshape(B, T, H * dh)
        if cache is not None and offset > 0:
            first = cache.k_raw[layer, :, :, offset - 1 : offset].transpose(1, 2)
            first = first.reshape(B, 1, H * dh)
        else:
            first = kf.new_zeros(B, 1, H * dh)
        if cache is not None:
            cache.k_raw[layer, :, :, offset : offset + T] = k
        prev = torch.cat([first, kf[:, :-1]], dim=1)
        a = self.hook_smear(torch.sigmoid(self.smear))
        a = a.repeat_interleave(dh)
        return torch.lerp(prev, kf, a).view(B, T, H, dh).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: FBTConfig):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.W_out = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.hook_pre = HookPoint()  # (batch, pos, d_mlp)
        self.hook_post = HookPoint()  # (batch, pos, d_mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_post(F.gelu(self.hook_pre(x @ self.W_in.T))) @ self.W_out.T


class Block(nn.Module):
    """Pre-norm block; each branch output is scaled by ``residual_scale`` (depth scaling)."""

    def __init__(self, cfg: FBTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.scale = cfg.residual_scale
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()  # (batch, pos, d_model)
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x, rope, offset: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        a = self.hook_attn_out(self.attn(self.ln1(x), rope, offset, cache, self.layer) * self.scale)
        x = self.hook_resid_mid(x + a)
        m = self.hook_mlp_out(self.mlp(self.ln2(x)) * self.scale)
        return self.hook_resid_post(x + m)


class FinalNorm(RMSNorm):
    def __init__(self, d: int, eps: float):
        super().__init__(d, eps)
        self.hook_normalized = HookPoint()  # (batch, pos, d_model): the top state h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(super().forward(x))


class FBTModel(FeedbackModel):
    """Full-bandwidth transformer with TransformerLens hooks on every component."""

    @property
    def skips_layers(self) -> bool:
        """A patch at depth d re-runs the blocks from d up only in the paper's design: where
        the feedback enters a block above the embeddings, or comes from below the top, the
        blocks below a depth carry it too, and a patched run runs the stack whole."""
        return self.cfg.feedback_target == 0 and self.cfg.feedback_source == TOP

    def __init__(self, cfg: FBTConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))  # tied with the unembedding
        self.hook_embed = HookPoint()  # (batch, pos, d_model): e_t
        self.fusion = Fusion(cfg)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.ln_final = FinalNorm(cfg.d_model, cfg.norm_eps)
        if cfg.positional == "rotary":
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.context = context(1, None, 0)  # what the hooks are firing for
        self.init_weights(seed)
        self.setup()
        self._hook_points = list(self.hook_dict.values())

    # ---- weights -------------------------------------------------------------------
    def init_weights(self, seed: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.init_std
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".w"):
                    p.fill_(1.0)
                elif name.endswith(".smear"):  # no draw: the other weights stay the seed's
                    spread = self.cfg.smear_spread
                    p.copy_(
                        torch.linspace(-spread, spread, len(p)) if len(p) > 1 else torch.zeros(1)
                    )
                else:  # W_E too: tied, so a large init would make every token predict itself
                    p.normal_(0.0, std, generator=g)

    @property
    def rope(self):
        return (self.rope_cos, self.rope_sin) if self.cfg.positional == "rotary" else None

    def new_cache(self, batch: int, max_len: int, device=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` positions."""
        return KVCache(self.cfg, batch, max_len, device=device, dtype=self.W_E.dtype)

    def snapshot_cache(self, cache: KVCache):
        raw = cache.k_raw.clone() if cache.k_raw is not None else None
        return cache.k.clone(), cache.v.clone(), raw

    def restore_cache(self, cache: KVCache, snapshot, start: int) -> None:
        cache.k[..., start:, :].copy_(snapshot[0][..., start:, :])
        cache.v[..., start:, :].copy_(snapshot[1][..., start:, :])
        if cache.k_raw is not None:
            cache.k_raw[..., start:, :].copy_(snapshot[2][..., start:, :])

    def head_writers(self, layer: int) -> torch.Tensor:
        """(d_model, head, d_head): how each head of ``layer`` writes into the residual (its
        slice of W_O, times the block's residual scale)."""
        blk = self.blocks[layer]
        return blk.attn.W_O.view(-1, self.cfg.n_heads, self.cfg.d_head) * blk.scale

    # ---- pieces --------------------------------------------------------------------
    def read_state(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.W_E.T

    def read_resid(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNorm.forward(self.ln_final, x) @ self.W_E.T

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, pos) -> e (batch, pos, d_model)."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            raise ValueError(f"token ids must be in [0, {self.cfg.d_vocab})")
        # F.embedding, not W_E[tokens]: the indexing's backward (index_put_ with accumulate)
        # sums W_E's gradient in a thread-dependent order on the CPU, so two runs of the same
        # training differed by 1e-7 at some step and then drifted apart (docs/history/training-log.md)
        return self.hook_embed(F.embedding(tokens, self.W_E) * math.sqrt(self.cfg.d_model))

    def stack(
        self,
        x: torch.Tensor,
        offset: int = 0,
        cache: KVCache | None = None,
        from_layer: int = 0,
        inject: tuple[int, Callable] | None = None,
    ) -> PassOutput:
        """Run the blocks on inputs x (batch, pos, d_model) at positions [offset, offset+pos).

        ``from_layer`` > 0: x is the input of that block and the blocks below are skipped
        (an intervention at that depth re-runs only what it can change). ``inject`` (b, fn):
        block b's input becomes fn(its residual input), the fusion of a design whose feedback
        enters block b. The states returned are what the design feeds back: the top state,
        or the output of block ``cfg.feedback_source``."""
        check_context(offset + x.shape[1], self.cfg.n_ctx)
        x, fed = self.run_blocks(x, offset, cache, from_layer, self.cfg.n_layers, inject)
        h = self.ln_final(x)
        if cache is not None:
            cache.length = offset + x.shape[1]
        if self.cfg.feedback_source == TOP:
            fed = h
        elif fed is None:
            raise ValueError(
                f"block {self.cfg.feedback_source}'s output, the state this design "
                f"feeds back, is not run again from block {from_layer}"
            )
        return PassOutput(logits=h @ self.W_E.T, states=fed)

    def run_blocks(
        self,
        x: torch.Tensor,
        offset: int,
        cache: KVCache | None,
        start: int,
        stop: int,
        inject: tuple[int, Callable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks ``start`` .. ``stop`` - 1 on x, their input: block ``stop``'s input, and the
        output of block ``cfg.feedback_source`` if it ran (else None)."""
        rope, fed = self.rope, None
        for i in range(start, stop):
            if inject is not None and i == inject[0]:
                x = inject[1](x)
            x = self.blocks[i](x, rope, offset, cache)
            if i == self.cfg.feedback_source:
                fed = x
        return x, fed

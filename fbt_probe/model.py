"""The full-bandwidth transformer: a hooked decoder whose top state feeds back into its input.

Read top to bottom: rotary attention, MLP, block, then ``FBTModel`` with its multi-pass
(Jacobi) forward and per-pass caches. Sequential recurrence and decoding, which use the
KV cache, live in ``recurrence.py`` and ``decode.py``.

Hook names follow TransformerLens (``hook_embed``, ``blocks.{l}.hook_resid_pre``,
``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized``)
plus the feedback's own: ``fusion.hook_state``, ``fusion.hook_gate``, ``fusion.hook_fused``.
A multi-pass forward fires every hook once per pass; ``run_with_pass_caches`` keys the
activations by pass so that pass 2 never overwrites pass 1.

Every pass, of the Jacobi forward, of the sequential recurrence or of decoding, goes through
``feedback_pass``: the one place where states are shifted and fused. It also tells every hook
what fired it: ``hook.ctx["pass"]`` (0 = pass 1; None in the recurrence and in generated
steps), ``hook.ctx["step"]`` (the position the recurrence or the decoder is computing; None
in Jacobi passes) and ``hook.ctx["offset"]`` (the first position of the tensor the hook
sees); ``model.context`` holds the same. ``fbt_probe.hooks.at`` restricts a hook to passes,
steps and positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from fbt_probe.config import TOP, FBTConfig
from fbt_probe.fusion import Fusion, RMSNorm
from fbt_probe.positions import pos_dim, put, select_positions, take


def check_context(n_tokens: int, n_ctx: int, where: str = "") -> None:
    """Refuse a sequence longer than the model's context: the one check every path makes.
    ``where``: the file that sets the context, named in the message."""
    if n_tokens > n_ctx:
        of = f" ({where})" if where else ""
        raise ValueError(f"sequence of {n_tokens} tokens exceeds the context length {n_ctx}{of}")


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


@dataclass
class PassOutput:
    """One pass: logits (batch, pos, d_vocab) and top states h (batch, pos, d_model)."""

    logits: torch.Tensor
    states: torch.Tensor

    def logits_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(n, d_vocab): the logits at (rows[i], positions[i]) only."""
        return self.logits[rows, positions]


class LazyPassOutput(PassOutput):
    """A pass whose logits are computed from its top states on first use: the next pass needs
    only the states, so a large vocabulary's head is paid only for the logits someone reads
    (feature extraction reads none)."""

    def __init__(self, states: torch.Tensor, head: Callable, source: torch.Tensor | None = None):
        self.states = states
        self._head, self._source, self._logits = head, source, None

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._read(self.states if self._source is None else self._source)
        return self._logits

    def _read(self, x: torch.Tensor) -> torch.Tensor:
        # states made under inference mode can take no gradient: read them the same way,
        # wherever the logits are asked for
        with torch.inference_mode(x.is_inference()):
            return self._head(x)

    def logits_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The head on the n states read only: a large vocabulary's logits at every position
        of a long batch would be (batch x pos x d_vocab) floats."""
        if self._logits is not None:
            return self._logits[rows, positions]
        source = self.states if self._source is None else self._source
        return self._read(source[rows, positions])

    def masked(self, valid: torch.Tensor) -> LazyPassOutput:
        """The same pass with the states of invalid positions zeroed (the logits unchanged)."""
        source = self.states if self._source is None else self._source
        return LazyPassOutput(self.states * valid[..., None], self._head, source)


def cat_positions(outs: list[PassOutput]) -> PassOutput:
    """Steps' outputs joined along positions; lazy where every step's logits are."""
    states = torch.cat([o.states for o in outs], dim=1)
    if all(type(o) is LazyPassOutput and o._source is None for o in outs):
        return LazyPassOutput(states, outs[0]._head)
    return PassOutput(torch.cat([o.logits for o in outs], dim=1), states)


@dataclass
class MultiPassOutput:
    passes: list[PassOutput]

    @property
    def logits(self) -> torch.Tensor:
        """Logits of the last pass: (batch, pos, d_vocab)."""
        return self.passes[-1].logits

    @property
    def states(self) -> torch.Tensor:
        return self.passes[-1].states


class FeedbackModel(HookedRootModule):
    """What every full-bandwidth model shares: the fusion of the fed-back state
    (``feedback_pass``, the one place where states are shifted and fused), the multi-pass
    (Jacobi) forward, per-pass caches and the hook context. A subclass provides ``cfg``
    (``d_model``, ``n_layers``, ``d_vocab``, ``n_ctx``, ``fusion``, ``jitter``), ``fusion``,
    ``embed(tokens)``, ``stack(x, offset, cache, from_layer)`` and ``new_cache(batch, length)``;
    ``_hook_points`` and ``context`` are set in its ``__init__``."""

    # whether ``stack(from_layer=l)`` can start at block l from that block's input
    skips_layers = False
    # whether a pass's logits are computed only when read (``LazyPassOutput``)
    lazy_logits = False

    def new_cache(self, batch: int, max_len: int, device=None):
        raise NotImplementedError

    def snapshot_cache(self, cache):
        """What ``restore_cache`` needs to give ``cache`` back its present keys and values."""
        raise NotImplementedError

    def restore_cache(self, cache, snapshot, start: int) -> None:
        """Put back the keys and values of positions >= ``start`` that ``snapshot_cache``
        saw (a patched re-run from ``start`` replaced them)."""
        raise NotImplementedError

    def depth_hooks(self) -> list[str]:
        """The residual stream's hooks in depth order: depth l < L is block l's input (depth 0:
        the embeddings, or the fused feedback), depth L the last block's output."""
        L = self.cfg.n_layers
        return [f"blocks.{i}.hook_resid_pre" for i in range(L)] + [
            f"blocks.{L - 1}.hook_resid_post"
        ]

    @property
    def entry_depth(self) -> int:
        """The depth where the fed-back state enters: block ``cfg.feedback_target``'s input
        (0, the embeddings, in the paper's design). The paper's layer-0 probe is the probe
        at this depth."""
        return int(getattr(self.cfg, "feedback_target", 0))

    @property
    def n_heads(self) -> int:
        """Attention heads per layer that have per-head hooks (``blocks.{l}.attn.hook_z``,
        ``hook_q``, ``hook_k``, ``hook_v``, ``hook_pattern``); 0 for a model without them."""
        return int(getattr(self.cfg, "n_heads", 0))

    def read_state(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on top states h (..., d_model): the logits they give."""
        raise NotImplementedError

    def read_resid(self, x: torch.Tensor) -> torch.Tensor:
        """The logit lens: the final norm and the head on residuals x (..., d_model), no hook
        firing; at depth L this is the model's own output."""
        raise NotImplementedError

    def set_context(self, pass_index: int | None, step: int | None, offset: int) -> None:
        """Record what fires the hooks next, in ``model.context`` and every ``hook.ctx``."""
        self.context = {"pass": pass_index, "step": step, "offset": offset}
        for hp in self._hook_points:
            hp.ctx.update(self.context)

    def fuse(
        self, prev_states: torch.Tensor, emb: torch.Tensor, plain: torch.Tensor | None
    ) -> torch.Tensor:
        """Block-0 input of a feedback pass.

        prev_states: (batch, pos, d_model), the state h_{t-1} *already aligned* with emb;
        plain: (batch, pos) bool, positions that keep their plain embedding.
        """
        if self.cfg.fusion == "none":
            return emb
        fused = self.fusion(prev_states, emb)
        return fused if plain is None else torch.where(plain[..., None], emb, fused)

    def feedback_pass(
        self,
        emb: torch.Tensor,
        states: torch.Tensor | None = None,
        carry: torch.Tensor | None = None,
        plain: torch.Tensor | None = None,
        *,
        offset: int = 0,
        cache: KVCache | None = None,
        pass_index: int | None = 0,
        step: int | None = None,
        from_layer: int = 0,
    ) -> PassOutput:
        """One pass of the stack over positions [offset, offset + pos): the only place where
        the fed-back state enters.

        emb: (batch, pos, d_model) plain embeddings; states: (batch, pos, d_model) top states of
        the previous pass at the same positions (None: a plain pass); carry: (batch, 1, d_model)
        the top state of position offset - 1 (the recurrence and decoding, one position at a
        time); plain: (batch, pos) bool, positions that keep their plain embedding. Position t
        is fused with h_{t-1}, i.e. ``states`` shifted right by one with ``carry`` in front.
        ``pass_index`` and ``step`` go to every hook's ``ctx``.

        A design whose feedback enters block b > 0 (``cfg.feedback_target``) fuses the state
        into block b's residual input instead of the embeddings; ``from_layer`` = b then means
        ``emb`` is already that input (the blocks below, which no state reaches, were run once
        for every position: the recurrence).
        """
        self.set_context(pass_index, step, offset)
        if states is None and carry is None:
            return self.stack(emb, offset, cache, from_layer=from_layer)
        B, T, D = emb.shape
        first = carry if carry is not None else emb.new_zeros(B, 1, D)
        prev = first if states is None else torch.cat([first, states[:, : T - 1]], dim=1)
        if T == 1 and plain is not None and bool(plain.all()):
            # one position of the recurrence inside a plain prefix: nothing to fuse (checked
            # for single positions only, so that a Jacobi pass never waits on the device)
            return self.stack(emb, offset, cache, from_layer=from_layer)
        target = getattr(self.cfg, "feedback_target", 0)
        if target:
            fuse = (target, lambda x: self.fuse(prev, x, plain))
            return self.stack(emb, offset, cache, from_layer=from_layer, inject=fuse)
        return self.stack(self.fuse(prev, emb, plain), offset, cache)

    @staticmethod
    def plain_mask(batch: int, T: int, prefix_len, device, offset: int = 0) -> torch.Tensor:
        """(batch, T) bool: position < max(1, prefix_len) keeps its plain embedding."""
        p = torch.ones(batch, dtype=torch.long, device=device)
        if prefix_len is not None:
            p = torch.as_tensor(prefix_len, device=device).long().expand(batch).clamp(min=1)
        return (offset + torch.arange(T, device=device))[None, :] < p[:, None]

    @staticmethod
    def length_mask(T: int, lengths, device) -> torch.Tensor:
        """(batch, T) bool: position < that example's length (right padding is False)."""
        return (
            torch.arange(T, device=device)[None, :]
            < torch.as_tensor(lengths, device=device)[:, None]
        )

    # ---- multi-pass forward ----------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        passes: int = 1,
        prefix_len: torch.Tensor | int | None = None,
        lengths: torch.Tensor | None = None,
        init_states: torch.Tensor | None = None,
        keep_all: bool = True,
    ) -> MultiPassOutput:
        """tokens (batch, pos). Pass 1 runs on plain embeddings; pass k fuses pass k-1's top
        states, shifted right by one position, into every position t >= max(1, prefix_len).

        ``init_states`` (batch, pos, d_model): top states of an earlier forward over the same
        tokens; pass 1 then fuses them (shifted) like a feedback pass, so this forward
        continues that one's Jacobi iteration (training's fixed-point batches).

        Batches are right-padded: attention is causal, so padding never reaches a real
        position; ``lengths`` (batch,) only zeroes the states of padded positions.
        Pass k is one Jacobi step of the sequential recurrence: positions < k equal it.
        ``keep_all=False`` keeps the last pass's output only (memory does not grow with k).
        """
        if passes < 1:
            raise ValueError(f"passes must be >= 1, got {passes}")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, pos), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        self.set_context(0, None, 0)  # hook_embed fires with pass 1
        emb = self.embed(tokens)
        plain = self.plain_mask(B, T, prefix_len, tokens.device)
        valid = None if lengths is None else self.length_mask(T, lengths, tokens.device)
        if init_states is not None and init_states.shape != emb.shape:
            raise ValueError(
                f"init_states must be {tuple(emb.shape)}, got {tuple(init_states.shape)}"
            )
        outs: list[PassOutput] = []
        prev = init_states
        for k in range(passes):
            out = self.feedback_pass(emb, prev, plain=plain, pass_index=k)
            if isinstance(out, LazyPassOutput) and valid is not None:
                out = out.masked(valid)
            elif valid is not None:
                out = PassOutput(out.logits, out.states * valid[..., None])
            if not keep_all:
                outs.clear()
            outs.append(out)
            prev = out.states
        return MultiPassOutput(outs)

    # ---- caching -----------------------------------------------------------------
    def run_with_cache(self, *args, passes: int = 1, **kwargs):
        if passes != 1:
            raise ValueError(
                "run_with_cache keeps one activation per hook and would let pass 2 "
                "overwrite pass 1: use run_with_pass_caches(tokens, passes=k)"
            )
        return super().run_with_cache(*args, **kwargs)

    def run_with_pass_caches(
        self,
        tokens: torch.Tensor,
        passes: int = 1,
        names_filter: str | Sequence[str] | Callable[[str], bool] | None = None,
        positions: torch.Tensor | None = None,
        prefix_len=None,
        lengths=None,
        last_only: bool = False,
    ) -> tuple[MultiPassOutput, list[ActivationCache]]:
        """Forward with ``passes`` passes; one ``ActivationCache`` per pass (index 0 = pass 1).

        positions: (batch,) or (batch, n) indices: keep only those positions, so memory is
        O(batch x n x hooks x d_model). A cached tensor then has shape (batch, [n,] ...).
        ``last_only``: keep the last pass's output and activations only (one cache): what a
        many-pass probe needs, in the memory of one pass.
        """
        cap = PositionCapture(self, names_filter, positions, passes,
                              only_pass=passes - 1 if last_only else None)  # fmt: skip
        with self.hooks(fwd_hooks=[(cap.filter, cap.hook)]):
            out = self.forward(tokens, passes=passes, prefix_len=prefix_len, lengths=lengths,
                               keep_all=not last_only)  # fmt: skip
        return out, cap.caches()


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
        self.context = {"pass": 0, "step": None, "offset": 0}  # what the hooks are firing for
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
        return KVCache(self.cfg, batch, max_len, device=device)

    def snapshot_cache(self, cache: KVCache):
        raw = cache.k_raw.clone() if cache.k_raw is not None else None
        return cache.k.clone(), cache.v.clone(), raw

    def restore_cache(self, cache: KVCache, snapshot, start: int) -> None:
        cache.k[..., start:, :].copy_(snapshot[0][..., start:, :])
        cache.v[..., start:, :].copy_(snapshot[1][..., start:, :])
        if cache.k_raw is not None:
            cache.k_raw[..., start:, :].copy_(snapshot[2][..., start:, :])

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
            raise ValueError(f"block {self.cfg.feedback_source}'s output, the state this design "
                             f"feeds back, is not run again from block {from_layer}")  # fmt: skip
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


class PositionCapture:
    """A caching hook that files activations by pass and keeps only chosen positions."""

    def __init__(
        self,
        model: FeedbackModel,
        names_filter,
        positions: torch.Tensor | None,
        n_passes: int,
        by_pass: bool = True,
        only_pass: int | None = None,
    ):
        self.model = model
        self.by_pass = by_pass  # False: one cache for everything (the recurrence)
        self.only_pass = only_pass  # keep this pass's activations only (None: every pass)
        if names_filter is None:
            self.filter = lambda name: True
        elif isinstance(names_filter, str):
            self.filter = lambda name: name == names_filter
        elif callable(names_filter):
            self.filter = names_filter
        else:
            allowed = set(names_filter)
            self.filter = lambda name: name in allowed
        self.squeeze = positions is not None and positions.ndim == 1
        self.positions = (
            None
            if positions is None
            else (positions[:, None] if self.squeeze else positions).long()
        )
        # one store per pass; with ``only_pass``, one store, for that pass
        self.store: list[dict[str, object]] = [
            {} for _ in range(1 if only_pass is not None else n_passes)
        ]

    def hook(self, tensor: torch.Tensor, hook: HookPoint) -> None:
        name = hook.name
        k = self.model.context["pass"] if self.by_pass else 0
        if self.only_pass is not None:
            if k != self.only_pass:
                return
            k = 0
        t = tensor.detach()
        if self.positions is None:
            self.store[k].setdefault(name, []).append(t)
            return
        if pos_dim(hook) != 1 and t.shape[2] != t.shape[3]:
            raise ValueError(
                "hook_pattern at chosen positions is only available in multi-pass forwards"
            )
        buf = self.store[k].get(name)
        if buf is None:
            shape = list(t.shape)
            shape[pos_dim(hook)] = self.positions.shape[1]
            buf = torch.zeros(shape, dtype=t.dtype, device=t.device)
            self.store[k][name] = buf
        b, j, src = select_positions(t, hook, self.positions.to(t.device))
        if len(b):
            put(buf, hook, b, j, take(t, hook, b, src))

    def caches(self) -> list[ActivationCache]:
        out = []
        for d in self.store:
            final = {}
            for name, v in d.items():
                axis = pos_dim(self.model.hook_dict[name])
                if isinstance(v, list):
                    v = v[0] if len(v) == 1 else torch.cat(v, dim=axis)
                elif self.squeeze:
                    v = v.select(axis, 0)
                final[name] = v
            out.append(ActivationCache(final, self.model))
        return out

"""The backend-independent full-bandwidth model: ``FeedbackModel`` (the multi-pass forward,
the one place states are shifted and fused, hooks that know their pass), its outputs and its
per-pass caches. The built-in stack (``fbt_probe.stack``) and a Hugging Face model
(``fbt_probe.hf``) each provide the layers.

Hook names follow TransformerLens (``hook_embed``, ``blocks.{l}.hook_resid_pre``,
``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized``)
plus the feedback's own: ``fusion.hook_state``, ``fusion.hook_gate``, ``fusion.hook_fused``.
A multi-pass forward fires every hook once per pass; ``run_with_pass_caches`` keys the
activations by pass so that pass 2 never overwrites pass 1.

Every pass, of the Jacobi forward, of the sequential recurrence or of decoding, goes through
``feedback_pass``: the one place where states are shifted and fused. It also tells every hook
what fired it: ``hook.ctx["pass_number"]`` (counted from 1; None in the recurrence and in
generated steps), ``hook.ctx["step"]`` (the position the recurrence or the decoder is
computing; None in Jacobi passes) and ``hook.ctx["first_position"]`` (the absolute position of
the first entry of the tensor the hook sees); ``model.context`` holds the same. ``fbt_probe.hooks.at`` restricts a hook to passes,
steps and positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformer_lens import HookedRootModule

from fbt_probe.caches import PassCaches, PositionCapture
from fbt_probe.hooks import HookContext, context

if TYPE_CHECKING:  # the built-in stack's cache; a Hugging Face model passes its own
    from fbt_probe.stack import KVCache


def check_context(n_tokens: int, n_ctx: int, where: str = "") -> None:
    """Refuse a sequence longer than the model's context: the one check every path makes.
    ``where``: the file that sets the context, named in the message."""
    if n_tokens > n_ctx:
        of = f" ({where})" if where else ""
        raise ValueError(f"sequence of {n_tokens} tokens exceeds the context length {n_ctx}{of}")


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

    def head_writers(self, layer: int) -> torch.Tensor:
        """(d_model, head, d_head): how each head's output (``hook_z``) of ``layer`` enters the
        residual, for edge attribution."""
        raise NotImplementedError

    def read_resid(self, x: torch.Tensor) -> torch.Tensor:
        """The logit lens: the final norm and the head on residuals x (..., d_model), no hook
        firing; at depth L this is the model's own output."""
        raise NotImplementedError

    def set_context(
        self,
        pass_number: int | None,
        step: int | None,
        first_position: int,
        decode_step: int | None = None,
    ) -> None:
        """Record what fires the hooks next, in ``model.context`` and every ``hook.ctx``
        (``fbt_probe.hooks.HookContext``: the pass counted from 1, the step, the first
        position of the tensor a hook sees, and while generating the decoding step)."""
        self.context = context(pass_number, step, first_position, decode_step)
        for hp in self._hook_points:
            if not isinstance(hp.ctx, HookContext):
                hp.ctx = HookContext(hp.ctx)
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
        first_position: int = 0,
        cache: KVCache | None = None,
        pass_number: int | None = 1,
        step: int | None = None,
        from_layer: int = 0,
        decode_step: int | None = None,
    ) -> PassOutput:
        """One pass of the stack over positions [first_position, first_position + pos): the
        only place where
        the fed-back state enters.

        emb: (batch, pos, d_model) plain embeddings; states: (batch, pos, d_model) top states of
        the previous pass at the same positions (None: a plain pass); carry: (batch, 1, d_model)
        the top state of position first_position - 1 (the recurrence and decoding, one position at a
        time); plain: (batch, pos) bool, positions that keep their plain embedding. Position t
        is fused with h_{t-1}, i.e. ``states`` shifted right by one with ``carry`` in front.
        ``pass_number`` (counted from 1; None outside Jacobi passes) and ``step`` go to every
        hook's ``ctx``, with ``decode_step`` while generating.

        A design whose feedback enters block b > 0 (``cfg.feedback_target``) fuses the state
        into block b's residual input instead of the embeddings; ``from_layer`` = b then means
        ``emb`` is already that input (the blocks below, which no state reaches, were run once
        for every position: the recurrence).
        """
        self.set_context(pass_number, step, first_position, decode_step)
        offset = first_position  # the stack's own word for it
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
        self.set_context(1, None, 0)  # hook_embed fires with pass 1
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
            out = self.feedback_pass(emb, prev, plain=plain, pass_number=k + 1)
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
    ) -> tuple[MultiPassOutput, PassCaches]:
        """Forward with ``passes`` passes; one ``ActivationCache`` per pass, numbered from 1
        (``caches.of_pass(2)`` is pass 2; ``fbt_probe.caches.PassCaches``).

        positions: (batch,) or (batch, n) indices: keep only those positions, so memory is
        O(batch x n x hooks x d_model). A cached tensor then has shape (batch, [n,] ...).
        ``last_only``: keep the last pass's output and activations only (one cache): what a
        many-pass probe needs, in the memory of one pass.
        """
        cap = PositionCapture(
            self, names_filter, positions, passes, only_pass=passes - 1 if last_only else None
        )
        with self.hooks(fwd_hooks=[(cap.filter, cap.hook)]):
            out = self.forward(
                tokens,
                passes=passes,
                prefix_len=prefix_len,
                lengths=lengths,
                keep_all=not last_only,
            )
        return out, cap.caches()

"""Any Hugging Face causal LM as a full-bandwidth model: the fusion in front of its stack.

``HFFeedbackModel`` wraps an ``AutoModelForCausalLM``. Pass k's block-0 input is the fusion of
pass k-1's top state (the last hidden state, after the model's final norm) with the token's
plain embedding, given to the model as ``inputs_embeds``; the logits come from the model's own
head. Everything else is ``FeedbackModel``'s, as for the built-in model: the Jacobi forward,
``feedback_pass`` (so the exact recurrence, decoding, per-pass caches and the hook context work
unchanged) and the TransformerLens hook names ``hook_embed``, ``blocks.{l}.hook_resid_pre``,
``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized`` and ``fusion.*`` (and, on a
sequential pre-norm layer, ``hook_attn_in`` and ``hook_mlp_in``: the input of the attention's
and of the MLP's norm, each branch's own copy of the residual). The block hooks
are HookPoints of our own, attached to the Hugging Face modules with PyTorch module hooks
(``docs/design.md`` says why not TransformerLens's bridge).

A model folder is what ``save_pretrained`` writes (the model and its tokenizer) plus
``fusion.safetensors`` and ``fusion_config.json``. A folder without the fusion files is an
upcycling start: a fresh fusion (``init_fusion``). Nothing is ever downloaded.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from fbt_probe.config import FUSIONS
from fbt_probe.feedback import FeedbackModel, LazyPassOutput, PassOutput, check_context
from fbt_probe.fusion import Fusion
from fbt_probe.hf.adapters import (
    FINAL_NORMS,
    LAYER_LISTS,
    BlockHooks,
    FinalHooks,
    attach_attention,
    attach_branches,
    attention_of,
    branch_norms,
    find_module,
    head_size,
    head_writer,
    post_hook,
    pre_hook,
)
from fbt_probe.hooks import context

FORMAT = "fbt-probe-hf-fusion"  # fusion_config.json's format


@dataclass(frozen=True)
class HFConfig:
    """What fbt-probe needs to know of a wrapped model (read from its Hugging Face config)
    and the fusion's own settings."""

    architecture: str
    d_model: int
    n_layers: int
    d_vocab: int
    n_ctx: int
    fusion: str = "gated"
    jitter: float = 0.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.fusion not in FUSIONS:
            raise ValueError(f"invalid fusion config: fusion must be one of {FUSIONS}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"invalid fusion config: jitter must be in [0, 1), got {self.jitter}")

    def to_dict(self) -> dict:
        return asdict(self)

    def fusion_dict(self) -> dict:
        """The part ``fusion_config.json`` holds (the rest is the Hugging Face config's)."""
        return {
            "format": FORMAT,
            "version": 1,
            "fusion": self.fusion,
            "jitter": self.jitter,
            "norm_eps": self.norm_eps,
            "d_model": self.d_model,
        }


class HFFeedbackModel(FeedbackModel):
    """A Hugging Face causal LM with the full-bandwidth fusion (see the module docstring)."""

    lazy_logits = True

    def __init__(self, hf_model: nn.Module, cfg: HFConfig, encoding=None, source: str = ""):
        super().__init__()
        self.cfg = cfg
        self.encoding = encoding  # tasks.encoding.TokenizerEncoding of its tokenizer, if any
        self.source = source  # the folder it was loaded from
        self.hf = hf_model
        self.hook_embed = HookPoint()  # (batch, pos, d_model): e_t
        self.fusion = Fusion(cfg)
        base = hf_model.base_model
        self._layers = find_module(base, LAYER_LISTS, "decoder layers", cfg.architecture)
        self._final_norm = find_module(base, FINAL_NORMS, "final norm", cfg.architecture)
        d_head = head_size(hf_model.config)
        heads = d_head is not None and all(attention_of(layer) for layer in self._layers)
        branches = all(branch_norms(layer, hf_model.config) for layer in self._layers)
        self.blocks = nn.ModuleList([BlockHooks(heads, branches) for _ in range(cfg.n_layers)])
        self.ln_final = FinalHooks()
        for layer, hooks in zip(self._layers, self.blocks, strict=True):
            layer.register_forward_pre_hook(pre_hook(hooks.hook_resid_pre), with_kwargs=True)
            layer.register_forward_hook(post_hook(hooks.hook_resid_post))
            if heads:
                attach_attention(attention_of(layer), hooks.attn, d_head)
            if branches:
                attach_branches(layer, hooks, hf_model.config)
        self._n_heads = int(hf_model.config.num_attention_heads) if heads else 0
        self._final_norm.register_forward_hook(post_hook(self.ln_final.hook_normalized))
        self.context = context(1, None, 0)
        self.setup()
        self._hook_points = list(self.hook_dict.values())

    @property
    def n_heads(self) -> int:
        return self._n_heads

    def head_writers(self, layer: int) -> torch.Tensor:
        """(d_model, head, d_head): how each head of ``layer`` writes into the residual."""
        return head_writer(attention_of(self._layers[layer]), self._n_heads)

    @property
    def skips_layers(self) -> bool:
        """Whether ``stack(from_layer=d)`` can start at decoder layer d: where position enters
        only inside the layers (rotary), the model's own forward runs on layers d.. alone; a
        model that adds position embeddings to its input (GPT-2) runs its stack whole."""
        base = self.hf.base_model
        return not any(hasattr(base, n) for n in ("wpe", "embed_positions"))

    @contextmanager
    def _layers_from(self, first: int):
        """The base model's decoder layers (and per-layer types) from ``first`` on, for one
        call: its forward then builds its own rotary embeddings and masks for them, and each
        layer keeps its index into the cache."""
        if not first:
            yield
            return
        base, config = self.hf.base_model, self.hf.config
        name = next(n for n in LAYER_LISTS if getattr(base, n, None) is self._layers)
        types = getattr(config, "layer_types", None)
        setattr(base, name, nn.ModuleList(list(self._layers)[first:]))
        if types is not None:
            config.layer_types = list(types)[first:]
        try:
            yield
        finally:
            setattr(base, name, self._layers)
            if types is not None:
                config.layer_types = types

    # ---- the interface FeedbackModel needs ---------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, pos) -> the model's own input embeddings (batch, pos, d_model)."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            raise ValueError(f"token ids must be in [0, {self.cfg.d_vocab})")
        return self.hook_embed(self.hf.get_input_embeddings()(tokens))

    def read_state(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(h)

    @property
    def context_source(self) -> str:
        """Where the context length comes from (the weights' folder's config.json, a fusion
        folder's base), for a message that names it."""
        folder = getattr(self.hf.config, "_name_or_path", "") or self.source
        return f"{folder}/config.json" if folder else ""

    def read_resid(self, x: torch.Tensor) -> torch.Tensor:
        # ``forward`` itself: calling the module would fire ln_final.hook_normalized
        return self.read_state(self._final_norm.forward(x))

    def new_cache(self, batch: int, max_len: int, device=None):
        """An empty Hugging Face KV cache (grows as positions are added)."""
        from transformers import DynamicCache

        check_context(max_len, self.cfg.n_ctx, self.context_source)
        return DynamicCache(config=self.hf.config)

    def snapshot_cache(self, cache):
        # a DynamicCache layer grows by concatenation and shrinks by slicing, never in place,
        # so its present tensors (and counters) are the snapshot: nothing is copied
        return [dict(layer.__dict__) for layer in cache.layers]

    def restore_cache(self, cache, snapshot, start: int) -> None:
        for layer, saved in zip(cache.layers, snapshot, strict=True):
            layer.__dict__.update(saved)

    def stack(
        self, x: torch.Tensor, offset: int = 0, cache=None, from_layer: int = 0
    ) -> PassOutput:
        """The model's stack on inputs x (batch, pos, d_model) at positions [offset, offset+pos);
        with ``cache``, keys and values of positions >= offset are replaced."""
        if from_layer and not self.skips_layers:
            raise ValueError(
                f"{self.cfg.architecture} adds position embeddings to its input: it "
                "runs its stack whole (from_layer must be 0)"
            )
        T = x.shape[1]
        check_context(offset + T, self.cfg.n_ctx, self.context_source)
        if cache is not None:
            # the first layer run (layers below a start depth are not, and may hold less)
            have = cache.get_seq_length(from_layer)
            if have > offset:  # a negative count removes that many (old and new transformers)
                cache.crop(offset - have)
            elif have < offset:
                raise ValueError(f"the cache holds {have} positions; cannot run from {offset}")
        pos = torch.arange(offset, offset + T, device=x.device)[None].expand(x.shape[0], T)
        config = self.hf.config
        impl = config._attn_implementation
        if self._n_heads and any(b.attn.hook_pattern.fwd_hooks for b in self.blocks):
            # only eager attention computes the pattern; it is switched per call, so a forward
            # that nobody reads the pattern of keeps the faster kernel
            config._attn_implementation = "eager"
        try:
            with self._layers_from(from_layer):
                out = self.hf.base_model(
                    inputs_embeds=x, position_ids=pos, cache=cache, use_cache=cache is not None
                )
        finally:
            config._attn_implementation = impl
        return LazyPassOutput(out.last_hidden_state, self.hf.get_output_embeddings())


def require_tokenizer(model) -> None:
    """A Hugging Face model reads tasks through its tokenizer: refuse one without any (before
    a dataset is generated for it)."""
    if isinstance(model, HFFeedbackModel) and model.encoding is None:
        raise ValueError(f"{model.source} has no tokenizer: save one beside the model")

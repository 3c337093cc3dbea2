"""How fbt-probe hooks into a Hugging Face model's own modules, per family: the block hooks (PyTorch
module hooks that fire our HookPoints) and the per-head attention hooks on the projections of
Llama, Qwen2, Mistral (q/k/v/o_proj), GPT-2 (c_attn/c_proj) and GPT-NeoX
(query_key_value/dense)."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

# where each family keeps its decoder layers and final norm, under ``model.base_model``
LAYER_LISTS = ("layers", "h")


FINAL_NORMS = ("norm", "ln_f", "final_layer_norm")


class AttnHooks(nn.Module):
    """Per-head hooks on a Hugging Face attention layer, with the built-in model's names and
    shapes. q, k and v are the projections' outputs (before rotary), k and v with the model's
    key-value heads; z is each head's output before the output projection. The pattern
    (batch, head, query_pos, key_pos) is computed only while something hooks it, through
    eager attention, and is read-only: the layer's output is already made from it."""

    def __init__(self):
        super().__init__()
        self.hook_q = HookPoint()  # (batch, pos, head, d_head)
        self.hook_k = HookPoint()  # (batch, pos, kv_head, d_head)
        self.hook_v = HookPoint()  # (batch, pos, kv_head, d_head)
        self.hook_pattern = HookPoint()  # (batch, head, query_pos, key_pos)
        self.hook_pattern.pos_dim = 2  # its query positions: fbt_probe.positions reads it
        self.hook_z = HookPoint()  # (batch, pos, head, d_head)


class BlockHooks(nn.Module):
    def __init__(self, attention: bool, branches: bool = False):
        super().__init__()
        self.hook_resid_pre = HookPoint()  # (batch, pos, d_model): the layer's input
        self.hook_resid_post = HookPoint()  # (batch, pos, d_model): its output
        if attention:
            self.attn = AttnHooks()
        if branches:  # TransformerLens's names: what the attention and the MLP read, each alone
            self.hook_attn_in = HookPoint()  # (batch, pos, d_model): the input norm's input
            self.hook_mlp_in = HookPoint()  # (batch, pos, d_model): the MLP norm's input


BRANCH_NORMS = ("input_layernorm", "post_attention_layernorm")


def branch_norms(layer: nn.Module, config) -> tuple[nn.Module, nn.Module] | None:
    """A sequential pre-norm layer's two norms (Llama, Qwen2, Mistral, and GPT-NeoX without
    its parallel residual): the attention reads the first's input, the MLP the second's, which
    is the residual between them. None for any other layout."""
    if getattr(config, "use_parallel_residual", False):
        return None
    if not all(isinstance(getattr(layer, n, None), nn.Module) for n in BRANCH_NORMS):
        return None
    return tuple(getattr(layer, n) for n in BRANCH_NORMS)


def attach_branches(layer: nn.Module, hooks: BlockHooks, config) -> None:
    attn_norm, mlp_norm = branch_norms(layer, config)
    attn_norm.register_forward_pre_hook(pre_hook(hooks.hook_attn_in), with_kwargs=True)
    mlp_norm.register_forward_pre_hook(pre_hook(hooks.hook_mlp_in), with_kwargs=True)


def head_writer(attn: nn.Module, n_heads: int) -> torch.Tensor:
    """(d_model, head, d_head): how each head's output (``hook_z``) enters the residual, the
    output projection without a bias (Llama's o_proj, GPT-NeoX's dense without one)."""
    proj = getattr(attn, "o_proj", None) or getattr(attn, "dense", None)
    if proj is None or getattr(proj, "bias", None) is not None:
        raise ValueError("edges need an output projection without a bias (Llama-style o_proj)")
    W = proj.weight  # (d_model, head * d_head)
    return W.view(W.shape[0], n_heads, -1)


class FinalHooks(nn.Module):
    def __init__(self):
        super().__init__()
        self.hook_normalized = HookPoint()  # (batch, pos, d_model): the top state h


def find_module(module: nn.Module, names: tuple[str, ...], what: str, arch: str):
    for n in names:
        if hasattr(module, n):
            return getattr(module, n)
    raise ValueError(
        f"{arch}: cannot find its {what} (looked for {', '.join(names)} on the base model); "
        "fbt-probe supports Llama-, GPT-2-, Qwen2- and GPT-NeoX-style models"
    )


def pre_hook(hp: HookPoint):
    def hook(module, args, kwargs):
        if args:
            return (hp(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hp(kwargs["hidden_states"])}

    return hook


def post_hook(hp: HookPoint):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (hp(output[0]), *output[1:])
        return hp(output)

    return hook


ATTENTIONS = ("self_attn", "attn", "attention")


def head_size(config) -> int | None:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def attention_of(layer: nn.Module):
    """A decoder layer's self-attention, if its family's layout is known: separate q, k, v and
    o projections (Llama, Qwen2, Mistral), GPT-2's c_attn and c_proj, or GPT-NeoX's
    query_key_value and dense."""
    attn = next((getattr(layer, n) for n in ATTENTIONS if hasattr(layer, n)), None)
    layouts = (
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        ("c_attn", "c_proj"),
        ("query_key_value", "dense"),
    )
    if attn is None or not any(all(hasattr(attn, n) for n in names) for names in layouts):
        return None
    return attn


def attach_attention(attn: nn.Module, hooks: AttnHooks, d_head: int) -> None:
    qkv = (hooks.hook_q, hooks.hook_k, hooks.hook_v)
    if hasattr(attn, "q_proj"):
        for proj, hp in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv, strict=True):
            proj.register_forward_hook(split_heads(hp, d_head))
        out_proj = attn.o_proj
    elif hasattr(attn, "c_attn"):  # GPT-2: q, k and v side by side, each d_model wide
        attn.c_attn.register_forward_hook(fused_qkv(qkv, d_head, per_head=False))
        out_proj = attn.c_proj
    else:  # GPT-NeoX: q, k and v of each head together
        attn.query_key_value.register_forward_hook(fused_qkv(qkv, d_head, per_head=True))
        out_proj = attn.dense
    out_proj.register_forward_pre_hook(heads_in(hooks.hook_z, d_head))
    attn.register_forward_hook(pattern_hook(hooks.hook_pattern))


def split_heads(hp: HookPoint, d_head: int):
    """A projection's output (batch, pos, n * d_head) through ``hp`` as (batch, pos, n, d_head)."""

    def hook(module, args, output):
        if not hp.fwd_hooks:  # nothing to see: no reshaping on the model's own path
            return None
        B, T, _ = output.shape
        return hp(output.view(B, T, -1, d_head)).reshape(B, T, -1)

    return hook


def fused_qkv(hps: tuple[HookPoint, ...], d_head: int, per_head: bool):
    def hook(module, args, output):
        if not any(hp.fwd_hooks for hp in hps):
            return None
        B, T, _ = output.shape
        if per_head:  # (batch, pos, head, [q k v], d_head)
            parts = output.view(B, T, -1, 3, d_head).unbind(3)
            out = torch.stack([hp(p) for hp, p in zip(hps, parts, strict=True)], 3)
            return out.reshape(B, T, -1)
        parts = [p.reshape(B, T, -1, d_head) for p in output.chunk(3, dim=-1)]
        return torch.cat([hp(p).reshape(B, T, -1) for hp, p in zip(hps, parts, strict=True)], -1)

    return hook


def heads_in(hp: HookPoint, d_head: int):
    """The output projection's input, each head's output side by side, through ``hp`` as
    (batch, pos, head, d_head)."""

    def hook(module, args):
        if not hp.fwd_hooks:
            return None
        z = args[0]
        B, T, _ = z.shape
        return (hp(z.reshape(B, T, -1, d_head)).reshape(B, T, -1), *args[1:])

    return hook


def pattern_hook(hp: HookPoint):
    def hook(module, args, output):
        if not hp.fwd_hooks or not isinstance(output, tuple) or output[1] is None:
            return None
        pattern = output[1]
        if hp(pattern) is not pattern:
            raise ValueError(
                f"{hp.name} is read-only on a Hugging Face model: patch hook_q, hook_k, "
                "hook_v or hook_z instead"
            )
        return None

    return hook

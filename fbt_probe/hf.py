"""Any Hugging Face causal LM as a full-bandwidth model: the fusion in front of its stack.

``HFFeedbackModel`` wraps an ``AutoModelForCausalLM``. Pass k's block-0 input is the fusion of
pass k-1's top state (the last hidden state, after the model's final norm) with the token's
plain embedding, given to the model as ``inputs_embeds``; the logits come from the model's own
head. Everything else is ``FeedbackModel``'s, as for the built-in model: the Jacobi forward,
``feedback_pass`` (so the exact recurrence, decoding, per-pass caches and the hook context work
unchanged) and the TransformerLens hook names ``hook_embed``, ``blocks.{l}.hook_resid_pre``,
``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized`` and ``fusion.*``. The block hooks
are HookPoints of our own, attached to the Hugging Face modules with PyTorch module hooks
(``docs/design.md`` says why not TransformerLens's bridge).

A model folder is what ``save_pretrained`` writes (the model and its tokenizer) plus
``fusion.safetensors`` and ``fusion_config.json``. A folder without the fusion files is an
upcycling start: a fresh fusion (``init_fusion``). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from fbt_probe.config import FUSIONS
from fbt_probe.fusion import Fusion
from fbt_probe.model import FeedbackModel, LazyPassOutput, PassOutput, check_context
from tasks.files import read_record

FUSION_CONFIG = "fusion_config.json"
FUSION_WEIGHTS = "fusion.safetensors"
FORMAT = "fbt-probe-hf-fusion"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# where each family keeps its decoder layers and final norm, under ``model.base_model``
LAYER_LISTS = ("layers", "h")
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm")


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
        return {"format": FORMAT, "version": 1, "fusion": self.fusion, "jitter": self.jitter,
                "norm_eps": self.norm_eps, "d_model": self.d_model}  # fmt: skip


class _AttnHooks(nn.Module):
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


class _BlockHooks(nn.Module):
    def __init__(self, attention: bool):
        super().__init__()
        self.hook_resid_pre = HookPoint()  # (batch, pos, d_model): the layer's input
        self.hook_resid_post = HookPoint()  # (batch, pos, d_model): its output
        if attention:
            self.attn = _AttnHooks()


class _FinalHooks(nn.Module):
    def __init__(self):
        super().__init__()
        self.hook_normalized = HookPoint()  # (batch, pos, d_model): the top state h


def _find(module: nn.Module, names: tuple[str, ...], what: str, arch: str):
    for n in names:
        if hasattr(module, n):
            return getattr(module, n)
    raise ValueError(
        f"{arch}: cannot find its {what} (looked for {', '.join(names)} on the base model); "
        "fbt-probe supports Llama-, GPT-2-, Qwen2- and GPT-NeoX-style models"
    )


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
        self._layers = _find(base, LAYER_LISTS, "decoder layers", cfg.architecture)
        self._final_norm = _find(base, FINAL_NORMS, "final norm", cfg.architecture)
        d_head = _d_head(hf_model.config)
        heads = d_head is not None and all(_attention_of(layer) for layer in self._layers)
        self.blocks = nn.ModuleList([_BlockHooks(heads) for _ in range(cfg.n_layers)])
        self.ln_final = _FinalHooks()
        for layer, hooks in zip(self._layers, self.blocks, strict=True):
            layer.register_forward_pre_hook(_pre_hook(hooks.hook_resid_pre), with_kwargs=True)
            layer.register_forward_hook(_post_hook(hooks.hook_resid_post))
            if heads:
                _attach_attention(_attention_of(layer), hooks.attn, d_head)
        self._n_heads = int(hf_model.config.num_attention_heads) if heads else 0
        self._final_norm.register_forward_hook(_post_hook(self.ln_final.hook_normalized))
        self.context = {"pass": 0, "step": None, "offset": 0}
        self.setup()
        self._hook_points = list(self.hook_dict.values())

    @property
    def n_heads(self) -> int:
        return self._n_heads

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
        if from_layer:
            raise ValueError("a Hugging Face model runs its stack whole (from_layer must be 0)")
        T = x.shape[1]
        check_context(offset + T, self.cfg.n_ctx, self.context_source)
        if cache is not None:
            have = cache.get_seq_length()
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
            out = self.hf.base_model(
                inputs_embeds=x, position_ids=pos, cache=cache, use_cache=cache is not None
            )
        finally:
            config._attn_implementation = impl
        return LazyPassOutput(out.last_hidden_state, self.hf.get_output_embeddings())


def _pre_hook(hp: HookPoint):
    def hook(module, args, kwargs):
        if args:
            return (hp(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hp(kwargs["hidden_states"])}

    return hook


def _post_hook(hp: HookPoint):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (hp(output[0]), *output[1:])
        return hp(output)

    return hook


ATTENTIONS = ("self_attn", "attn", "attention")


def _d_head(config) -> int | None:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def _attention_of(layer: nn.Module):
    """A decoder layer's self-attention, if its family's layout is known: separate q, k, v and
    o projections (Llama, Qwen2, Mistral), GPT-2's c_attn and c_proj, or GPT-NeoX's
    query_key_value and dense."""
    attn = next((getattr(layer, n) for n in ATTENTIONS if hasattr(layer, n)), None)
    layouts = (("q_proj", "k_proj", "v_proj", "o_proj"), ("c_attn", "c_proj"),
               ("query_key_value", "dense"))  # fmt: skip
    if attn is None or not any(all(hasattr(attn, n) for n in names) for names in layouts):
        return None
    return attn


def _attach_attention(attn: nn.Module, hooks: _AttnHooks, d_head: int) -> None:
    qkv = (hooks.hook_q, hooks.hook_k, hooks.hook_v)
    if hasattr(attn, "q_proj"):
        for proj, hp in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv, strict=True):
            proj.register_forward_hook(_split_heads(hp, d_head))
        out_proj = attn.o_proj
    elif hasattr(attn, "c_attn"):  # GPT-2: q, k and v side by side, each d_model wide
        attn.c_attn.register_forward_hook(_fused_qkv(qkv, d_head, per_head=False))
        out_proj = attn.c_proj
    else:  # GPT-NeoX: q, k and v of each head together
        attn.query_key_value.register_forward_hook(_fused_qkv(qkv, d_head, per_head=True))
        out_proj = attn.dense
    out_proj.register_forward_pre_hook(_heads_in(hooks.hook_z, d_head))
    attn.register_forward_hook(_pattern_hook(hooks.hook_pattern))


def _split_heads(hp: HookPoint, d_head: int):
    """A projection's output (batch, pos, n * d_head) through ``hp`` as (batch, pos, n, d_head)."""

    def hook(module, args, output):
        if not hp.fwd_hooks:  # nothing to see: no reshaping on the model's own path
            return None
        B, T, _ = output.shape
        return hp(output.view(B, T, -1, d_head)).reshape(B, T, -1)

    return hook


def _fused_qkv(hps: tuple[HookPoint, ...], d_head: int, per_head: bool):
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


def _heads_in(hp: HookPoint, d_head: int):
    """The output projection's input, each head's output side by side, through ``hp`` as
    (batch, pos, head, d_head)."""

    def hook(module, args):
        if not hp.fwd_hooks:
            return None
        z = args[0]
        B, T, _ = z.shape
        return (hp(z.reshape(B, T, -1, d_head)).reshape(B, T, -1), *args[1:])

    return hook


def _pattern_hook(hp: HookPoint):
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


def require_tokenizer(model) -> None:
    """A Hugging Face model reads tasks through its tokenizer: refuse one without any (before
    a dataset is generated for it)."""
    if isinstance(model, HFFeedbackModel) and model.encoding is None:
        raise ValueError(f"{model.source} has no tokenizer: save one beside the model")


# ---- folders -------------------------------------------------------------------------------
def is_hf_folder(path: Path) -> bool:
    """A folder that ``save_pretrained`` wrote (a Hugging Face ``config.json``), or a fusion
    folder that names its base model (``save_fusion``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return is_fusion_folder(path)
    try:
        keys = json.loads(cfg.read_text())
        return isinstance(keys, dict) and ("architectures" in keys or "model_type" in keys)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def is_fusion_folder(path: Path) -> bool:
    """A folder of the fusion alone (``save_fusion``): its config names the base model."""
    cfg = Path(path) / FUSION_CONFIG
    try:
        keys = json.loads(cfg.read_text()) if cfg.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(keys, dict) and keys.get("format") == FORMAT and "base" in keys


def hf_config_of(hf_model: nn.Module, fusion: str = "gated", jitter: float = 0.0,
                 norm_eps: float = 1e-6) -> HFConfig:  # fmt: skip
    c = hf_model.config
    arch = (getattr(c, "architectures", None) or [type(hf_model).__name__])[0]
    n_ctx = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    return HFConfig(
        architecture=arch,
        d_model=int(c.hidden_size),
        n_layers=int(c.num_hidden_layers),
        d_vocab=int(hf_model.get_output_embeddings().weight.shape[0]),
        n_ctx=int(n_ctx or 2048),
        fusion=fusion,
        jitter=jitter,
        norm_eps=norm_eps,
    )


@torch.no_grad()
def init_fusion(model: HFFeedbackModel, seed: int = 0) -> None:
    """A fresh fusion for an upcycling start. W_U and W_G are drawn N(0, 1/d_model), so the
    value W_U h keeps the scale of h and the gate starts near 0.5; the norm's gain is the RMS
    of the model's input-embedding rows, so a fused input starts at the scale of a token
    embedding (the stack never sees an input far larger than the ones it was trained on)."""
    g = torch.Generator().manual_seed(seed)
    d = model.cfg.d_model
    f = model.fusion
    for p in (f.W_U, f.W_G):
        if p is not None:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(d))
    emb = model.hf.get_input_embeddings().weight.float()
    f.norm.w.fill_(float(emb.pow(2).mean(-1).sqrt().mean()))


def quiet() -> None:
    """No progress bars or advice from transformers: fbt-probe reports its own progress."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_hf(
    path: str | Path, device="cpu", fusion: str = "gated", seed: int = 0
) -> HFFeedbackModel:
    """A model folder (``save_pretrained`` plus, if present, the fusion files; or a fusion
    folder that names its base, ``save_fusion``) as an ``HFFeedbackModel`` in eval mode.
    Without fusion files: a fresh fusion (upcycling)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model folder not found: {path} (a Hugging Face model must be saved locally, "
            "e.g. with save_pretrained; nothing is downloaded)"
        )
    saved = read_fusion_config(path)
    spec = {"fusion": fusion, "jitter": 0.0, "norm_eps": 1e-6}
    if saved is not None:
        spec = {k: saved[k] for k in spec if k in saved}
    weights = base_folder(path, saved["base"]) if saved and "base" in saved else path
    quiet()
    config = check_hf_config(weights)
    encoding = None
    if any((weights / f).is_file() for f in TOKENIZER_FILES):
        from tasks.encoding import TokenizerEncoding

        encoding = TokenizerEncoding.from_folder(weights)
        check_vocabulary(weights, config, encoding)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(weights), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt weights raise safetensors' own error type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{weights} is not a loadable Hugging Face model ({first})") from None
    hf.eval()
    cfg = hf_config_of(hf, **spec)
    model = HFFeedbackModel(hf, cfg, encoding, str(path))
    if saved is not None:
        load_fusion(model, path / FUSION_WEIGHTS, saved.get("d_model"))
    else:
        init_fusion(model, seed)
    return model.to(device).eval()


def check_hf_config(folder: Path):
    """The folder's ``config.json`` as transformers reads it, refused in one line naming the
    file unless it describes a causal LM that transformers knows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = folder / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several types here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{where} is not a Hugging Face model config ({first})") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"{where}: model type {config.model_type!r} has no causal LM in "
                         "transformers (fbt-probe runs causal LMs)")  # fmt: skip
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(f"{where}: architecture {archs[0]} is not a causal LM (fbt-probe runs "
                         "causal LMs: ...ForCausalLM, ...LMHeadModel)")  # fmt: skip
    return config


def check_vocabulary(folder: Path, config, encoding) -> None:
    """The model's vocabulary holds every id its tokenizer gives text (special tokens added
    beyond it, e.g. a padding token, are never given to a prompt)."""
    n_vocab = getattr(config, "vocab_size", None)
    tok = encoding.tok
    special = set(tok.all_special_ids)
    special |= {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
    ids = [i for i in tok.get_vocab().values() if i not in special]
    n_tok = max(ids) + 1 if ids else 0
    if isinstance(n_vocab, int) and n_tok > n_vocab:
        tok_file = next(f for f in TOKENIZER_FILES if (folder / f).is_file())
        raise ValueError(f"{folder / 'config.json'}: vocab_size {n_vocab} is smaller than the "
                         f"tokenizer's {n_tok} tokens ({folder / tok_file})")  # fmt: skip


def read_fusion_config(path: Path) -> dict | None:
    """A folder's ``fusion_config.json`` (checked, with its weights beside it), or None for a
    folder without fusion files."""
    fcfg_path, fw_path = path / FUSION_CONFIG, path / FUSION_WEIGHTS
    if fcfg_path.is_file() != fw_path.is_file():
        have, miss = (
            (FUSION_CONFIG, FUSION_WEIGHTS)
            if fcfg_path.is_file()
            else (FUSION_WEIGHTS, FUSION_CONFIG)
        )
        raise ValueError(f"{path} has {have} but no {miss}: both or neither")  # fmt: skip
    if not fcfg_path.is_file():
        return None
    saved = read_record(fcfg_path, FORMAT, "fusion config")
    base = saved.get("base")
    if base is not None and not (
        isinstance(base, dict) and isinstance(base.get("path"), str)
        and isinstance(base.get("weights_sha256"), str)
    ):  # fmt: skip
        raise ValueError(f"{fcfg_path}: 'base' needs a path and a weights_sha256")
    check_fusion_values(saved, fcfg_path)
    return saved


def check_fusion_values(saved: dict, where: Path) -> None:
    """The values a fusion config sets, each refused by name in one line naming the file."""
    if "fusion" in saved and saved["fusion"] not in FUSIONS:
        raise ValueError(f"{where}: fusion must be one of {FUSIONS}, got {saved['fusion']!r}")
    for key, ok, rule in (("jitter", lambda v: 0 <= v < 1, "in [0, 1)"),
                          ("norm_eps", lambda v: 0 < v < 1, "in (0, 1)")):  # fmt: skip
        v = saved.get(key)
        if key in saved and (isinstance(v, bool) or not isinstance(v, int | float) or not ok(v)):
            raise ValueError(f"{where}: {key} must be a number {rule}, got {v!r}")
    d = saved.get("d_model")
    if "d_model" in saved and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
        raise ValueError(f"{where}: d_model must be a positive integer, got {d!r}")


def base_folder(path: Path, base: dict) -> Path:
    """The model folder a fusion folder was trained on: its ``base.path`` (a relative one is
    looked for from the working folder, then from each folder above the fusion folder),
    holding the weights ``base.weights_sha256`` names."""
    from fbt_probe.convert import folder_weights_digest

    rel = Path(base["path"])
    places = [rel] if rel.is_absolute() else [rel, *(up / rel for up in path.resolve().parents)]
    found = next((p for p in places if is_hf_folder(p)), None)
    want = base["weights_sha256"]
    if found is None:
        how = f": make it with {base['made_by']}" if base.get("made_by") else ""
        raise FileNotFoundError(
            f"{path} is a fusion for the model {rel} (weights sha256 {want[:12]}...), "
            f"which is not there{how}"
        )
    got = folder_weights_digest(found)
    if got != want:
        raise ValueError(
            f"{path} is a fusion for other weights than {found} holds (sha256 {got[:12]}..., "
            f"the fusion was trained on {want[:12]}...)"
        )
    return found


def load_fusion(model: HFFeedbackModel, path: Path, d_model) -> None:
    """The saved fusion weights into ``model``, checked against its fusion and width."""
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
        raise ValueError(f"{path} cannot be read ({str(e).splitlines()[0]})") from None
    mine, cfg = model.fusion.state_dict(), model.cfg
    bad = sorted(set(weights) ^ set(mine)) or [
        k for k in mine if tuple(weights[k].shape) != tuple(mine[k].shape)
    ]
    if bad or d_model != cfg.d_model:
        raise ValueError(
            f"{path} does not match {FUSION_CONFIG} and the model "
            f"(fusion {cfg.fusion!r}, d_model {cfg.d_model}; mismatched: {', '.join(bad) or 'd_model'})"
        )
    model.fusion.load_state_dict(weights)


def copy_hf(model: HFFeedbackModel, dtype=None) -> HFFeedbackModel:
    """An independent copy (its own modules and hooks), optionally in another dtype."""
    from transformers import AutoModelForCausalLM

    twin = HFFeedbackModel(AutoModelForCausalLM.from_config(model.hf.config), model.cfg,
                           model.encoding, model.source)  # fmt: skip
    twin.load_state_dict(model.state_dict())
    twin = twin.to(next(model.parameters()).device)
    return (twin.to(dtype) if dtype is not None else twin).eval()


def random_init_hf(model: HFFeedbackModel, seed: int = 0) -> HFFeedbackModel:
    """The same architecture with fresh weights (stack and fusion): the probes' control."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(model.hf.config)
    twin = HFFeedbackModel(hf, model.cfg, model.encoding, model.source)
    init_fusion(twin, seed)
    return twin.to(next(model.parameters()).device).eval()


def save_hf(
    model: HFFeedbackModel, out: str | Path, tokenizer=None, extra: dict | None = None
) -> Path:
    """Write the model folder: ``save_pretrained`` and the tokenizer (the one given, else the
    model's own), the fusion, and ``extra`` ({file name: text}). The folder is written whole
    or not at all (a full disk leaves the folder that was there)."""
    from safetensors.torch import save_file

    from tasks.files import atomic_folder

    out = Path(out)
    quiet()
    if tokenizer is None and model.encoding is not None:
        tokenizer = model.encoding.tok
    sd = {k: v.detach().cpu().contiguous() for k, v in model.fusion.state_dict().items()}

    def write(tmp: Path) -> None:
        model.hf.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        save_file(sd, str(tmp / FUSION_WEIGHTS), metadata={"format": FORMAT})
        (tmp / FUSION_CONFIG).write_text(json.dumps(model.cfg.fusion_dict(), indent=2) + "\n")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    atomic_folder(out, write)
    return out


def save_fusion(model: HFFeedbackModel, out: str | Path, base: str | Path,
                extra: dict | None = None) -> Path:  # fmt: skip
    """Write a fusion folder: the fusion's weights and config, which names the model folder
    ``base`` it was trained on (its path as given, and the digest of its weights, which
    loading checks), and ``extra`` ({file name: text}); a few MB where a whole folder is the
    model's size. Only for a fusion trained on ``base``'s weights as they are."""
    from safetensors.torch import save_file

    from fbt_probe.convert import PACKAGED, folder_weights_digest, read_source
    from tasks.files import atomic_folder

    out, base = Path(out), Path(base)
    rec = {"path": str(base), "weights_sha256": folder_weights_digest(base)}
    source = read_source(base)
    named = {file: name for name, (_, file) in PACKAGED.items()}
    if source and source.get("gguf") in named:
        rec["made_by"] = f"fbt-probe convert --gguf {named[source['gguf']]} --out {base}"
    sd = {k: v.detach().cpu().contiguous() for k, v in model.fusion.state_dict().items()}

    def write(tmp: Path) -> None:
        save_file(sd, str(tmp / FUSION_WEIGHTS), metadata={"format": FORMAT})
        cfg = {**model.cfg.fusion_dict(), "base": rec}
        (tmp / FUSION_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    atomic_folder(out, write)
    return out

"""Hugging Face model folders: what is one, loading and saving the model with its fusion
(``fusion.safetensors`` + ``fusion_config.json`` beside ``save_pretrained's files, or a fusion
folder that names its base by hash), and the checks that refuse a broken folder in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from fbt_probe.config import FUSIONS
from fbt_probe.hf.quiet import quiet
from fbt_probe.hf.wrapper import FORMAT, HFConfig, HFFeedbackModel
from fbt_probe.util.files import read_record

FUSION_CONFIG = "fusion_config.json"


FUSION_WEIGHTS = "fusion.safetensors"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


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


def hf_config_of(
    hf_model: nn.Module, fusion: str = "gated", jitter: float = 0.0, norm_eps: float = 1e-6
) -> HFConfig:
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


def load_hf(
    path: str | Path,
    device="cpu",
    fusion: str = "gated",
    seed: int = 0,
    lora=None,
    keep_adapter: bool = False,
) -> HFFeedbackModel:
    """A model folder (``save_pretrained`` plus, if present, the fusion files; or a fusion
    folder that names its base, ``save_fusion``) as an ``HFFeedbackModel`` in eval mode.
    Without fusion files: a fresh fusion (upcycling). A LoRA adapter saved in the folder
    (``fbt_probe.hf.lora``) is merged into the stack's weights, or with ``keep_adapter`` kept
    apart to train on; ``lora`` (a ``LoraSpec``) adds a fresh one where the folder has none."""
    from transformers import AutoModelForCausalLM

    from fbt_probe.hf.lora import add_lora, has_adapter, load_lora

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

        encoding = TokenizerEncoding.from_folder(weights, recorded_label_words(path))
        check_vocabulary(weights, config, encoding)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(weights), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt weights raise safetensors' own error type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{weights} is not a loadable Hugging Face model ({first})") from None
    if has_adapter(path):
        hf = load_lora(hf, path, merge=not keep_adapter)
    elif lora is not None:
        add_lora(hf, lora, seed)
    hf.eval()
    cfg = hf_config_of(hf, **spec)
    model = HFFeedbackModel(hf, cfg, encoding, str(path))
    if saved is not None:
        load_fusion(model, path / FUSION_WEIGHTS, saved.get("d_model"))
    else:
        init_fusion(model, seed)
    return model.to(device).eval()


META = "fbt_probe_meta.json"  # what training records beside a model it saved


def recorded_label_words(folder: Path) -> dict | None:
    """The label words a model was trained with (its ``fbt_probe_meta.json``'s
    ``label_words``), or None where it records none (they are then chosen for its tokenizer)."""
    from tasks.encoding import check_label_words

    meta = folder / META
    if not meta.is_file():
        return None
    try:
        rec = json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta} is not valid JSON ({e})") from None
    if not isinstance(rec, dict) or "label_words" not in rec:
        return None
    return check_label_words(rec["label_words"], str(meta))


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
        raise ValueError(
            f"{where}: model type {config.model_type!r} has no causal LM in "
            "transformers (fbt-probe runs causal LMs)"
        )
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"{where}: architecture {archs[0]} is not a causal LM (fbt-probe runs "
            "causal LMs: ...ForCausalLM, ...LMHeadModel)"
        )
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
        raise ValueError(
            f"{folder / 'config.json'}: vocab_size {n_vocab} is smaller than the "
            f"tokenizer's {n_tok} tokens ({folder / tok_file})"
        )


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
        raise ValueError(f"{path} has {have} but no {miss}: both or neither")
    if not fcfg_path.is_file():
        return None
    saved = read_record(fcfg_path, FORMAT, "fusion config")
    base = saved.get("base")
    if base is not None and not (
        isinstance(base, dict)
        and isinstance(base.get("path"), str)
        and isinstance(base.get("weights_sha256"), str)
    ):
        raise ValueError(f"{fcfg_path}: 'base' needs a path and a weights_sha256")
    check_fusion_values(saved, fcfg_path)
    return saved


def check_fusion_values(saved: dict, where: Path) -> None:
    """The values a fusion config sets, each refused by name in one line naming the file."""
    if "fusion" in saved and saved["fusion"] not in FUSIONS:
        raise ValueError(f"{where}: fusion must be one of {FUSIONS}, got {saved['fusion']!r}")
    for key, ok, rule in (
        ("jitter", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("norm_eps", lambda v: 0 < v < 1, "in (0, 1)"),
    ):
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
    from fbt_probe.hf.convert import folder_weights_digest

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

    twin = HFFeedbackModel(
        AutoModelForCausalLM.from_config(model.hf.config), model.cfg, model.encoding, model.source
    )
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

    from fbt_probe.util.files import atomic_folder

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


def save_fusion(
    model: HFFeedbackModel, out: str | Path, base: str | Path, extra: dict | None = None
) -> Path:
    """Write a fusion folder: the fusion's weights and config, which names the model folder
    ``base`` it was trained on (its path as given, and the digest of its weights, which
    loading checks), and ``extra`` ({file name: text}); a few MB where a whole folder is the
    model's size. Only for a fusion trained on ``base``'s weights as they are."""
    from safetensors.torch import save_file

    from fbt_probe.hf.convert import PACKAGED, folder_weights_digest, read_source
    from fbt_probe.hf.lora import has_lora, write_lora
    from fbt_probe.util.files import atomic_folder

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
        if has_lora(model.hf):  # the stack's adapter, in peft's format
            write_lora(model.hf, tmp, str(base))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    atomic_folder(out, write)
    return out

"""Model folders: ``model.safetensors`` + ``config.json`` + ``meta.json`` (hashes, versions).

A folder whose config is invalid or edited, whose tensors do not match the config, or whose
weights file does not match its recorded hash fails to load with a one-line reason.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fbt_probe import __version__
from fbt_probe.config import FBTConfig
from fbt_probe.feedback import FeedbackModel
from fbt_probe.stack import FBTModel
from fbt_probe.util.files import atomic_write
from tasks import vocab

WEIGHTS, CONFIG, META = "model.safetensors", "config.json", "meta.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_hash(model: FeedbackModel) -> str:
    """A hash of the config and every weight: names results and extraction caches."""
    h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


def write_text(path: Path, text: str) -> None:
    """A whole file or none: a full disk leaves no 0-byte config or meta file."""

    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_model(model: FBTModel, folder: str | Path, extra_meta: dict | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}

    atomic_write(
        folder / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "fbt-probe"})
    )
    write_text(folder / CONFIG, json.dumps(model.cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    meta = {
        # the config is part of what is verified: an edited n_heads or positional loads
        # silently otherwise (the weights' shapes do not show it)
        "config_sha256": file_sha256(folder / CONFIG),
        "fbt_probe_version": __version__,
        "vocab_version": vocab.VOCAB_VERSION,
        # the words the model's token ids stand for (tasks registered later only append)
        "vocab": list(vocab.TOKENS[: model.cfg.d_vocab]),
        "weights_sha256": file_sha256(folder / WEIGHTS),
        "model_hash": model_hash(model),
        **(extra_meta or {}),
    }
    write_text(folder / META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return folder


def load_model(folder: str | Path, device: str | torch.device = "cpu") -> FBTModel:
    """Load a model folder; clear errors for anything missing, corrupted or mismatched."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    for name in (WEIGHTS, CONFIG):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} is not a model folder: {name} is missing")
    try:
        cfg = FBTConfig.from_dict(json.loads((folder / CONFIG).read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / CONFIG} is not valid JSON ({e.msg})") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{folder / CONFIG}: {e}") from None
    if cfg.vocab_version != vocab.VOCAB_VERSION:
        raise ValueError(
            f"{folder} was trained on vocabulary v{cfg.vocab_version}, this fbt-probe has v{vocab.VOCAB_VERSION}"
        )
    if (folder / META).is_file():
        _check_meta(folder)
    model = FBTModel(cfg)
    model.load_state_dict(_read_weights(folder, model.state_dict()))
    return model.to(device).eval()


def _check_meta(folder: Path) -> None:
    """The folder's files against what meta.json recorded when it was saved: the config's and
    the weights' hashes, and the vocabulary it was trained on."""
    meta_path = folder / META
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path} is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} must hold a JSON object, not {type(meta).__name__}")
    want_cfg = meta.get("config_sha256")
    if want_cfg and file_sha256(folder / CONFIG) != want_cfg:
        raise ValueError(
            f"{folder / CONFIG} was changed after the model was saved (its hash differs "
            "from meta.json); restore it or retrain"
        )
    if isinstance(meta.get("vocab"), list):
        vocab.check_prefix(meta["vocab"], str(folder))
    want = meta.get("weights_sha256")
    if want and file_sha256(folder / WEIGHTS) != want:
        raise ValueError(f"{folder / WEIGHTS} is corrupted: its hash differs from meta.json")


def _read_weights(folder: Path, expected: dict) -> dict:
    """The folder's tensors, each name and shape checked against ``expected`` (the state
    dict its config.json implies)."""
    try:
        tensors = load_file(str(folder / WEIGHTS), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"{folder / WEIGHTS} cannot be read as safetensors ({str(e).splitlines()[0]})"
        ) from None
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for k, v in tensors.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"{folder}: tensor {k} has shape {tuple(v.shape)}, config.json implies {tuple(expected[k].shape)}"
            )
    return tensors

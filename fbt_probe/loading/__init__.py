"""The built-in default model and how ``--model`` names a model: a package above the model
core and ``fbt_probe.hf``, because it chooses between their backends."""

from __future__ import annotations

import shutil
from pathlib import Path

from fbt_probe.checkpoint import load_model
from fbt_probe.feedback import FeedbackModel
from fbt_probe.hf import FUSION_CONFIG, HFFeedbackModel, is_hf_folder, load_hf, random_init_hf
from fbt_probe.stack import FBTModel

DEFAULTS = Path(__file__).resolve().parents[1] / "defaults"
DEFAULT_MODEL_DIR = DEFAULTS / "default"
# models shipped beside the default that ``--model NAME`` finds; a fusion folder names its
# base, which ``fbt-probe convert`` makes (docs/real-model.md)
SHIPPED = ("smollm2-upcycled", "smollm2-lora", "generation")


def resolve_model(
    spec: str | Path | FeedbackModel | None, device="cpu"
) -> tuple[FeedbackModel, str]:
    """``default`` (or None) -> the packaged default; a ``SHIPPED`` name -> that packaged
    model; otherwise a model folder (a training run folder works too: its ``model/``
    subfolder is used). Returns (model on ``device``, its name). A model already loaded is
    returned as it is, where it is, with the name it was loaded under."""
    if isinstance(spec, FeedbackModel):
        return spec, getattr(spec, "loaded_as", type(spec).__name__)
    model, name = _load(spec, device)
    model.loaded_as = name
    return model, name


def load(spec: str | Path | None = "default", device="cpu") -> FeedbackModel:
    """The model ``spec`` names (see ``resolve_model``), on ``device``."""
    return resolve_model(spec, device)[0]


def _load(spec, device) -> tuple[FeedbackModel, str]:
    if spec is None or str(spec) == "default":
        if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the built-in default model is missing from {DEFAULT_MODEL_DIR}; "
                "train it with 'fbt-probe train' or pass --model DIR"
            )
        return load_model(DEFAULT_MODEL_DIR, device), "default"

    try:
        path = model_folder(spec)
        if not path.exists() and str(spec) in SHIPPED:
            path = DEFAULTS / str(spec)
        found = path.exists()
    except OSError:  # a name no folder can have (too long, say)
        found = False
    if found and is_hf_folder(path):
        return load_hf(path, device), str(path)
    if not found:
        raise FileNotFoundError(
            f"model folder not found: {spec} (a Hugging Face model must be a local folder "
            "saved with save_pretrained; nothing is downloaded, see docs/hf.md)"
        )
    return load_model(path, device), str(path)


def model_folder(spec: str | Path) -> Path:
    """The model folder ``spec`` names: itself, or a training run folder's ``model/``."""

    path = Path(spec)
    marks = ("config.json", FUSION_CONFIG)
    if not any((path / f).is_file() for f in marks) and any(
        (path / "model" / f).is_file() for f in marks
    ):
        return path / "model"
    return path


def random_init_like(model: FeedbackModel, seed: int = 0) -> FeedbackModel:
    """A random-init model of the same config: the control every probe is compared to."""

    if isinstance(model, HFFeedbackModel):
        return random_init_hf(model, seed)
    device = next(model.parameters()).device
    return FBTModel(model.cfg, seed=seed).to(device).eval()


def install_default(run_dir: str | Path) -> Path:
    """Copy a finished run's model (with its metrics and config) into the package default."""

    run = Path(run_dir)
    src = run / "model"
    if not (src / "model.safetensors").is_file():
        raise FileNotFoundError(f"{run} has no trained model/ folder")
    load_model(src)  # refuse to install anything that does not load
    DEFAULT_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy2(f, DEFAULT_MODEL_DIR / f.name)
    for name in ("metrics.json", "train_config.json", "command.txt"):
        if (run / name).is_file():
            shutil.copy2(run / name, DEFAULT_MODEL_DIR / name)
    return DEFAULT_MODEL_DIR

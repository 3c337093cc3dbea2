"""Low-rank adapters (peft's LoRA) on a Hugging Face model's stack: added for training, saved in
peft's own format beside the fusion (``adapter_config.json`` + ``adapter_model.safetensors``,
so ``PeftModel.from_pretrained(base, folder)`` loads them), and loaded back.

Adapters go into the model before ``HFFeedbackModel`` attaches its hooks: the hooks then sit on
peft's layers, whose output includes the adapter's. For the analyses a saved adapter is merged
into the weights it adapts (one matrix per layer again, so a head's output weights are what it
writes); a run that goes on training keeps it apart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's names for a PeftModel's weights start so
ADAPTER = "default"


@dataclass(frozen=True)
class LoraSpec:
    """A fresh adapter: its rank, its scale's numerator (the update is alpha / rank * B A) and
    the names of the linear layers it adapts (peft's ``target_modules``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


def _config(spec: LoraSpec, base: str = ""):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        base_model_name_or_path=base or None,
    )


def add_lora(hf: nn.Module, spec: LoraSpec, seed: int = 0) -> None:
    """A fresh adapter into ``hf`` (in place; B = 0, so the model computes what it did).
    Its A matrices are drawn from ``seed``: a run resumed from a checkpoint starts alike."""
    from peft.tuners.lora import LoraModel

    missing = [
        t
        for t in spec.targets
        if not any(n.endswith("." + t) or n == t for n, _ in hf.named_modules())
    ]
    if missing:
        raise ValueError(
            f"optim.lora_targets: {', '.join(missing)} is no module of "
            f"{type(hf).__name__} (its linear layers are named like "
            f"{', '.join(_linear_names(hf)[:6])})"
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        LoraModel(hf, _config(spec), ADAPTER)


def _linear_names(hf: nn.Module) -> list[str]:
    return list(
        dict.fromkeys(
            n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, nn.Linear)
        )
    )


def has_lora(hf: nn.Module) -> bool:
    return any("lora_A" in n for n, _ in hf.named_parameters())


def has_adapter(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def load_lora(hf: nn.Module, folder: Path, merge: bool = True) -> nn.Module:
    """The adapter saved in ``folder`` into ``hf``: merged into the weights (the model then
    has plain layers again) or, with ``merge=False``, kept apart to train on. Refused in one
    line naming the file where it cannot be read or does not fit the model."""
    from peft import LoraConfig, set_peft_model_state_dict
    from peft.tuners.lora import LoraModel
    from safetensors.torch import load_file

    cfg_path, w_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not w_path.is_file():
        raise ValueError(f"{folder} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    try:
        cfg = LoraConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - peft raises several types for a bad config
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{cfg_path} is not a LoRA adapter config ({first})") from None
    try:
        saved = load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
        raise ValueError(f"{w_path} cannot be read ({str(e).splitlines()[0]})") from None
    try:
        tuner = LoraModel(hf, cfg, ADAPTER)
    except ValueError as e:
        raise ValueError(f"{cfg_path} does not fit the model ({str(e).splitlines()[0]})") from None
    state = {k.removeprefix(PREFIX): v for k, v in saved.items()}
    mine = {k.replace(f".{ADAPTER}.", ".") for k, _ in hf.named_parameters() if "lora_" in k}
    bad = (
        sorted(set(state) ^ mine)[:2]
        or [k for k, v in state.items() if not torch.isfinite(v).all()][:2]
    )
    if bad:
        raise ValueError(
            f"{w_path} does not match {cfg_path} and the model "
            f"({', '.join(bad)}: missing, extra or not finite)"
        )
    set_peft_model_state_dict(hf, state, adapter_name=ADAPTER)
    if merge:
        return tuner.merge_and_unload()
    return hf


def lora_state(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under the names peft saves them by."""
    from peft import get_peft_model_state_dict

    sd = get_peft_model_state_dict(hf, adapter_name=ADAPTER)
    return {PREFIX + k: v.detach().cpu().contiguous() for k, v in sd.items()}


def write_lora(hf: nn.Module, tmp: Path, base: str) -> None:
    """The adapter of ``hf`` into the folder being written, in peft's format (its config
    names the base model folder)."""
    from safetensors.torch import save_file

    cfg = hf.peft_config[ADAPTER]
    cfg.base_model_name_or_path = base
    cfg.save_pretrained(str(tmp))
    save_file(lora_state(hf), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    rec = json.loads((tmp / ADAPTER_CONFIG).read_text())
    if rec.get("peft_type") != "LORA":
        raise ValueError(f"peft wrote an adapter config of type {rec.get('peft_type')!r}")

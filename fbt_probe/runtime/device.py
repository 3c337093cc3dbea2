"""Where a model runs: one parser of ``--device`` for every command."""

from __future__ import annotations

import torch

DEVICE_HELP = "Where to run: cpu, cuda, cuda:N, or auto (cuda when available)."


def resolve_device(device: str) -> torch.device:
    """A torch device from "cpu", "cuda", "cuda:N" or "auto" (cuda when available), checked."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) exist"
            )
    return dev

"""How a run starts its model: built from the recipe or upcycled from a folder, what is frozen
or learned, the learned state saved in a checkpoint, and the optimiser."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from fbt_probe.config import TOP
from fbt_probe.feedback import FeedbackModel
from fbt_probe.loading import model_folder, resolve_model
from fbt_probe.stack import FBTModel
from fbt_probe.train.config import TrainConfig


# ---- building a run ---
def build_model(cfg: TrainConfig):
    """The model a run starts from: the built-in one drawn from ``cfg.model`` and the seed,
    or the model ``cfg.init_from`` names. A Hugging Face folder is trained with its own
    architecture; ``model.fusion`` and ``model.jitter`` of the recipe apply to its fusion
    (the saved one, or a fresh one for an upcycling start), the rest of ``model.*`` does not."""
    if cfg.init_from:
        from fbt_probe.hf import is_hf_folder, load_hf

        path = init_folder(cfg)
        if is_hf_folder(path):
            if cfg.model.feedback_source != TOP or cfg.model.feedback_target != 0:
                raise ValueError(
                    "model.feedback_source and model.feedback_target: a Hugging Face "
                    "model feeds its top state into its embeddings only"
                )
            m = load_hf(
                path,
                fusion=cfg.model.fusion,
                seed=cfg.run.seed,
                lora=lora_spec(cfg),
                keep_adapter=True,
            )
            if m.cfg.fusion != cfg.model.fusion:
                raise ValueError(
                    f"init_from {cfg.init_from!r} has a {m.cfg.fusion} fusion, the recipe sets "
                    f"model.fusion={cfg.model.fusion}"
                )
            if m.encoding is None:
                raise ValueError(f"init_from {cfg.init_from!r} has no tokenizer beside the model")
            m.cfg = replace(m.cfg, jitter=cfg.model.jitter)
            return m
    if cfg.optim.learn == "lora":
        raise ValueError(
            "optim.learn = 'lora' adapts a Hugging Face model's stack: set init_from "
            "to a Hugging Face model folder"
        )
    model = FBTModel(cfg.model, seed=cfg.run.seed)
    if cfg.init_from:
        model.load_state_dict(initial_weights(cfg).state_dict())
    return model


def lora_spec(cfg: TrainConfig):
    """The fresh adapter ``optim.learn = "lora"`` trains (None under the other settings)."""
    if cfg.optim.learn != "lora":
        return None
    from fbt_probe.hf.lora import LoraSpec

    o = cfg.optim
    return LoraSpec(o.lora_rank, o.lora_alpha, tuple(o.lora_targets))


def init_folder(cfg: TrainConfig) -> Path:
    """The model folder ``cfg.init_from`` names (a run folder stands for its ``model/``)."""

    return model_folder(cfg.init_from)


def initial_weights(cfg: TrainConfig) -> FBTModel:
    """The model ``cfg.init_from`` names, checked against ``cfg.model``."""

    src, _ = resolve_model(cfg.init_from)
    mine = cfg.model.to_dict()
    diff = sorted(k for k, v in src.cfg.to_dict().items() if k != "jitter" and mine.get(k) != v)
    if diff:  # jitter only acts in training: it may differ
        raise ValueError(
            f"init_from {cfg.init_from!r} has a different model config ({', '.join(diff)}); "
            "set the same model.* fields"
        )
    return src


def frozen_parameters(model: FeedbackModel, schedule) -> dict[str, list]:
    """Each prefix any phase freezes -> the parameters whose names start with it; a prefix
    that matches no parameter is an error."""
    named = list(model.named_parameters())
    out = {}
    for f in dict.fromkeys(f for p in schedule for f in p.frozen or ()):
        params = [p for n, p in named if n.startswith(f)]
        if not params:
            raise ValueError(
                f"frozen prefix {f!r} matches no parameter; names look like "
                f"{', '.join(n for n, _ in named[:4])}, ..."
            )
        out[f] = params
    return out


def set_learning(model: FeedbackModel, learn: str) -> None:
    """``optim.learn``: "all" parameters learn, or the "fusion" only, or the fusion and the
    stack's low-rank adapters ("lora"); the rest get no gradient, so neither their gradients
    nor AdamW's state for them take memory."""
    for n, p in model.named_parameters():
        p.requires_grad_(
            learn == "all" or n.startswith("fusion.") or (learn == "lora" and ".lora_" in n)
        )


def learned_state(model: FeedbackModel) -> dict:
    """The entries of the model's state that training changes: all of it, or under
    ``optim.learn = "fusion"`` the fusion's (a checkpoint then holds no copy of the stack)."""
    sd = model.state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return sd
    learned = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in learned}


def load_learned(model: FeedbackModel, saved: dict, where: Path) -> None:
    """A checkpoint's ``learned_state`` back into ``model``."""
    want = learned_state(model).keys()
    if set(saved) != set(want):
        raise ValueError(
            f"{where} holds other parameters than this run trains "
            f"({len(saved)} saved, {len(want)} trained); resume it with its own recipe"
        )
    model.load_state_dict(saved, strict=False)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that learn, with weight decay on the matrices only (betas
    0.9 / 0.95)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(0.9, 0.95))

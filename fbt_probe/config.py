"""FBTConfig: the frozen, validated description of a full-bandwidth transformer."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from tasks import vocab

FUSIONS = ("gated", "additive", "none")
POSITIONALS = ("rotary", "none")


@dataclass(frozen=True)
class FBTConfig:
    """Shape and options of the model. ``fusion`` picks how pass k feeds pass k-1's state back:

    - ``gated`` (the paper): ``RMSNorm(W_U h_{t-1} * sigmoid(W_G e_t))``
    - ``additive`` (the paper's ablation): ``RMSNorm(e_t + W_U h_{t-1})``
    - ``none``: no feedback; every pass equals pass 1.
    """

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    d_vocab: int = vocab.VOCAB_SIZE
    n_ctx: int = 2048  # rotary: no learned positions, this only bounds the rotary table and caches
    positional: str = "rotary"  # rotary: position never enters the residual stream
    rope_base: float = 10000.0
    fusion: str = "gated"
    jitter: float = 0.02  # uniform noise added to h before fusion, training mode only
    depth_scaling: bool = True  # residual branches scaled by 1/sqrt(2 L): ||h|| stays O(1)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    vocab_version: str = vocab.VOCAB_VERSION

    def __post_init__(self):
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid FBTConfig: {msg}")

        for name in ("d_model", "n_layers", "n_heads", "d_mlp", "d_vocab", "n_ctx"):
            v = getattr(self, name)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v > 0,
                f"{name} must be a positive int, got {v!r}",
            )
        need(
            self.d_model % self.n_heads == 0,
            f"d_model {self.d_model} not divisible by n_heads {self.n_heads}",
        )
        need(self.fusion in FUSIONS, f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        need(
            self.positional in POSITIONALS,
            f"positional must be one of {POSITIONALS}, got {self.positional!r}",
        )
        if self.positional == "rotary":
            need(self.d_head % 2 == 0, f"rotary needs an even d_head, got {self.d_head}")
        need(self.rope_base > 1, "rope_base must be > 1")
        need(0.0 <= self.jitter < 1.0, f"jitter must be in [0, 1), got {self.jitter}")
        need(self.norm_eps > 0 and self.init_std > 0, "norm_eps and init_std must be positive")
        need(
            self.d_vocab >= vocab.VOCAB_SIZE,
            f"d_vocab must be at least the task vocabulary ({vocab.VOCAB_SIZE})",
        )

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def residual_scale(self) -> float:
        return 1.0 / math.sqrt(2 * self.n_layers) if self.depth_scaling else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FBTConfig:
        reject_unknown_keys(cls, d)
        return cls(**d)


def reject_unknown_keys(cls, d: dict) -> None:
    """A clear error for keys that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"invalid {cls.__name__}: unknown keys {unknown}")


def build_cfg(**overrides) -> FBTConfig:
    """A tiny config for tests and quick experiments; ``overrides`` replace any field."""
    base = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, n_ctx=64)
    base.update(overrides)
    return FBTConfig(**base)

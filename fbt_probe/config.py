"""FBTConfig: the frozen, validated description of a full-bandwidth transformer."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass

from tasks import vocab

FUSIONS = ("gated", "additive", "none", "replace")
TOP = -1  # feedback_source: the top state (the final norm's output), the paper's source
POSITIONALS = ("rotary", "none")


@dataclass(frozen=True)
class FBTConfig:
    """Shape and options of the model. ``fusion`` picks how pass k feeds pass k-1's state back:

    - ``gated`` (the paper): ``RMSNorm(W_U h_{t-1} * sigmoid(W_G e_t))``
    - ``additive`` (the paper's ablation): ``RMSNorm(e_t + W_U h_{t-1})``
    - ``none``: no feedback; every pass equals pass 1.
    - ``replace`` (Coconut-like): ``RMSNorm(W_U h_{t-1})``, the token's embedding only where
      there is no state (the first position, a plain prefix).

    Where the feedback comes from and where it enters: ``feedback_source`` is the top state
    (``TOP``, the paper) or the output of block a (its residual stream, unnormalised), and
    ``feedback_target`` is the block whose input is fused (0, the paper: the embeddings; b:
    block b's residual input, which then plays the embedding's part in the fusion). A target
    b <= a + 1 keeps the design causal across positions: position t reads position t-1's
    source, which never depends on position t.
    """

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    d_vocab: int = vocab.BASE_SIZE  # a task with tokens of its own needs vocab.VOCAB_SIZE
    n_ctx: int = 2048  # rotary: no learned positions, this only bounds the rotary table and caches
    positional: str = "rotary"  # rotary: position never enters the residual stream
    rope_base: float = 10000.0
    # smeared keys (Olsson et al. 2022): each head's key at t is mixed with the key at t-1,
    # k'_t = a k_t + (1 - a) k_{t-1}, a = sigmoid of a learned per-head scalar (see smear_spread),
    # so a single head can match on the previous token without a previous-token head
    smear_keys: bool = False
    # the smear weights' logits at init, spread evenly over a layer's heads in [-s, s] (0: all
    # heads start at 0.5); a scalar gate moves slowly under AdamW, so the spread is a menu
    smear_spread: float = 0.0
    # the layers whose keys are smeared (None: every layer); e.g. (1, 2, 3) keeps block 0's
    # keys plain, block 0 being where done_tracking's running bit is built
    smear_layers: tuple[int, ...] | None = None
    fusion: str = "gated"
    feedback_source: int = TOP
    feedback_target: int = 0
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
        a, b = self.feedback_source, self.feedback_target
        need(
            a == TOP or 0 <= a < self.n_layers,
            f"feedback_source must be -1 (the top state) or a block 0..{self.n_layers - 1}, got {a}",
        )
        need(
            0 <= b < self.n_layers,
            f"feedback_target must be a block 0..{self.n_layers - 1}, got {b}",
        )
        need(
            a == TOP or b <= a + 1,
            f"feedback_target {b} is above feedback_source {a} + 1: not causal across positions",
        )
        need(
            self.positional in POSITIONALS,
            f"positional must be one of {POSITIONALS}, got {self.positional!r}",
        )
        if self.positional == "rotary":
            need(self.d_head % 2 == 0, f"rotary needs an even d_head, got {self.d_head}")
        need(self.rope_base > 1, "rope_base must be > 1")
        need(0.0 <= self.jitter < 1.0, f"jitter must be in [0, 1), got {self.jitter}")
        need(self.smear_spread >= 0, f"smear_spread must be >= 0, got {self.smear_spread}")
        if self.smear_layers is not None:
            layers = tuple(self.smear_layers)
            need(self.smear_keys, "smear_layers needs smear_keys = true")
            need(
                all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
                and all(0 <= i < self.n_layers for i in layers)
                and len(set(layers)) == len(layers),
                f"smear_layers must be distinct layers in 0..{self.n_layers - 1}, "
                f"got {list(layers)}",
            )
            object.__setattr__(self, "smear_layers", layers)  # a list from Python or JSON
        need(self.norm_eps > 0 and self.init_std > 0, "norm_eps and init_std must be positive")
        need(
            self.d_vocab >= vocab.BASE_SIZE,
            f"d_vocab must be at least the built-in vocabulary ({vocab.BASE_SIZE})",
        )

    def smears(self, layer: int) -> bool:
        """Whether layer ``layer``'s keys are smeared."""
        return self.smear_keys and (self.smear_layers is None or layer in self.smear_layers)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def residual_scale(self) -> float:
        return 1.0 / math.sqrt(2 * self.n_layers) if self.depth_scaling else 1.0

    @property
    def source_block(self) -> int:
        """The block whose output is the fed-back state (the last one for the top state)."""
        return self.n_layers - 1 if self.feedback_source == TOP else self.feedback_source

    def to_dict(self) -> dict:
        # the feedback's source and target are written only where they leave the paper's
        # design: every model saved before they existed keeps its config hash
        d = asdict(self)
        for k, default in (("feedback_source", TOP), ("feedback_target", 0)):
            if d[k] == default:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> FBTConfig:
        return cls(**typed_fields(cls, d, where))


def reject_unknown_keys(cls, d: dict, where: str = "") -> None:
    """A clear error for keys that are not fields of the dataclass ``cls``."""
    if not isinstance(d, dict):
        raise ValueError(f"invalid {cls.__name__}: {where or 'the config'} must be an object")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ValueError(f"invalid {cls.__name__}: unknown key {key!r}")


def _typed(value, hint, name: str):
    """``value`` checked against the annotation ``hint``; JSON lists become tuples."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _typed(value, hint, name)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{name} must be a list of {len(args)}, got {list(value)!r}")
        return tuple(
            _typed(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
    elif hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
    elif hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object ({{...}}), got {value!r}")
    return value


def typed_fields(cls, d: dict, where: str = "") -> dict:
    """``d``'s entries checked against the field types of dataclass ``cls``: a one-line
    ValueError naming the first unknown key or wrongly typed value (dotted under ``where``)."""
    reject_unknown_keys(cls, d, where)
    hints = typing.get_type_hints(cls)
    out = {}
    for k, v in d.items():
        name = f"{where}.{k}" if where else k
        if is_dataclass(hints[k]) and isinstance(v, hints[k]):
            out[k] = v
            continue
        try:
            out[k] = _typed(v, hints[k], name)
        except ValueError as e:
            raise ValueError(f"invalid {cls.__name__}: {e}") from None
    return out


def build_cfg(**overrides) -> FBTConfig:
    """A tiny config for tests and quick experiments; ``overrides`` replace any field."""
    base = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, n_ctx=64)
    base.update(overrides)
    return FBTConfig(**base)

"""The interventions of ``fbt-probe intervene``, one function each, registered by name.

An intervention kind is a function ``kind(ctx, where) -> list[Spec]``: for one batch of
pairs (``ctx``, a ``Context``) and one place (``where``, a ``Location``), the patched runs
it makes there, each a ``Spec`` (the hooks, the first re-run position, ...). The battery
(``probes.intervene.run``) walks the places in order and asks every selected kind at each, so
the rows of a table come grouped by where they act. Adding a kind is one function and one
line::

    def double_state(ctx, where):
        if where.kind != "window" or not ctx.feedback:
            return []
        m = window_mask(where.name, ctx.b)
        return [ctx.state_patch("double_state", where.name, m, 2 * ctx.clean.fed)]

    register("double_state", double_state)

after which ``fbt-probe intervene --intervention double_state`` runs it. The kinds:

- ``interchange_state``: the fed-back state (``fusion.hook_state``) takes the twin's value in
  a window of positions before the answer (``fbt_probe``'s ``twins.WINDOWS``); under full
  recurrence a patch propagates to later steps, and the site ``fusion.hook_state (patch
  only)`` forces every later fed-back state to its clean value (``label_next`` only).
- ``zero_state``, ``mean_state`` (the mean fed-back state over the dataset),
  ``resample_state`` (another example's, aligned at the answer): ablations in the same
  windows but ``label_next``.
- ``interchange_token``: the label-bearing token's embedding takes the twin's in the last
  pass only, every fed-back state kept clean: the other route, attention to the token. A
  shifted twin (its label word of another number of tokens) has no token to swap in place;
  under standard prefill, where the label's tokens are all that differs, the patched run
  is then the twin's own run (under feedback such twins are not run: ``run_battery``).
- ``erase_probe``: LEACE of the target at one depth of the colon, cross-fitted over grouped
  folds; ``erase_random``: a random subspace of the same rank.
- ``steer_probe``: the residual at one depth of the colon moved by alpha standard deviations
  of its projection on the probe's direction from the clean label to the twin's;
  ``steer_random``: a random direction, the same distance.
- ``self``: the fed-back states (standard prefill: the token embeddings) patched with their
  own clean values, which must change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from fbt_probe.kernels.patching import STATE_HOOK, first_true, replace_where
from fbt_probe.util.lists import comma_items
from fbt_probe.util.registry import Registry
from probes.common.twins import EARLY_WINDOWS, WINDOWS, PairBatch, window_mask
from probes.intervene.erasers import DepthTools, erase, erase_subspace

ALPHAS = (-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0)
PATCH_ONLY = f"{STATE_HOOK} (patch only)"
TOKEN_SITE = "hook_embed"


@dataclass(frozen=True)
class Location:
    """Where a patch acts: the ``check`` of the clean run, a state ``window``, the label
    ``token``, or a ``depth`` of the colon (with a steering ``alpha``, or None)."""

    kind: str
    name: str = ""
    depth: int = -1
    alpha: float | None = None


@dataclass
class Spec:
    """One patched run: its row's name (intervention, site, positions, alpha), the first
    position it re-runs, its hooks, the token embeddings it uses (None: the clean ones) and
    the block it may start from."""

    intervention: str
    site: str
    positions: str
    start: int
    hooks: list
    emb: torch.Tensor | None = None
    from_layer: int = 0
    alpha: float | None = None  # steering only
    twin_run: bool = False  # the patched run is the twin's own (a shifted twin's tokens)


@dataclass
class Context:
    """One batch of pairs as the kinds see it: the batch with its clean and twin runs, the
    prefill's passes (None: full), the dataset's mean fed-back state, each example's donor
    states (resample_state), the erasers and directions of the depths the battery runs at
    (None: not fitted), the
    hooks of the depths and whether the model's stack can start at a depth."""

    b: PairBatch
    passes: int | None
    mean_state: torch.Tensor | None
    donor_fed: torch.Tensor | None
    tools: dict[int, DepthTools] | None
    hooks_by_depth: list[str]
    skips_layers: bool = True

    @property
    def clean(self):
        return self.b.clean

    @property
    def twin(self):
        return self.b.twin

    @property
    def feedback(self) -> bool:
        return self.b.clean.fed is not None

    @cached_property
    def t(self) -> torch.Tensor:
        return self.b.positions().to(self.b.answer.device)

    def state_patch(self, name: str, window: str, mask, values) -> Spec:
        """A patch of the fed-back states at ``mask`` (batch, pos) by ``values``."""
        hooks = [(STATE_HOOK, replace_where(mask, values))]
        return Spec(name, STATE_HOOK, window, first_true(mask), hooks)

    def depth_patch(self, name: str, d: int, fn, alpha: float | None = None) -> Spec:
        """A patch of the residual at depth ``d`` of the colon by ``fn(x)``; a Jacobi pass (and
        the recurrence when the answer is the colon) re-runs only the blocks from ``d`` up."""
        b = self.b
        colon = self.t == b.colon[:, None]
        skip = self.skips_layers and (self.passes is not None or bool((b.answer == b.colon).all()))
        first = min(d, len(self.hooks_by_depth) - 2) if skip else 0
        hook = self.hooks_by_depth[d]
        return Spec(
            name,
            hook,
            "colon",
            int(b.colon.min()),
            [(hook, replace_where(colon, fn))],
            from_layer=first,
            alpha=alpha,
        )

    def at_depth(self, d: int) -> DepthTools:
        """The erasers and directions of this batch's examples at depth ``d``."""
        idx = torch.as_tensor(self.b.idx)
        tl = self.tools[d]
        return DepthTools(
            *(getattr(tl, f)[idx].to(self.b.answer.device) for f in DepthTools.__dataclass_fields__)
        )


# ---- the kinds ----------------------------------------------------------------------------
def _window(ctx: Context, where: Location, early_too: bool):
    """The mask of a state window, or None where the kind does not patch it."""
    if where.kind != "window" or not ctx.feedback:
        return None
    if where.name in EARLY_WINDOWS and not early_too:
        return None
    return window_mask(where.name, ctx.b)


def interchange_state(ctx: Context, where: Location) -> list[Spec]:
    m = _window(ctx, where, early_too=True)
    if m is None:
        return []
    out = [ctx.state_patch("interchange_state", where.name, m, ctx.twin.fed)]
    if ctx.passes is None and where.name in EARLY_WINDOWS:  # the recurrence, not propagated
        later = ctx.t >= out[0].start
        v = torch.where(m[..., None], ctx.twin.fed, ctx.clean.fed)
        out.append(ctx.state_patch("interchange_state", where.name, later, v))
        out[-1].site = PATCH_ONLY
    return out


def zero_state(ctx: Context, where: Location) -> list[Spec]:
    m = _window(ctx, where, early_too=False)
    if m is None:
        return []
    return [ctx.state_patch("zero_state", where.name, m, torch.zeros_like(ctx.clean.fed))]


def mean_state(ctx: Context, where: Location) -> list[Spec]:
    m = _window(ctx, where, early_too=False)
    if m is None:
        return []
    return [ctx.state_patch("mean_state", where.name, m, ctx.mean_state.expand_as(ctx.clean.fed))]


def resample_state(ctx: Context, where: Location) -> list[Spec]:
    m = _window(ctx, where, early_too=False)
    return [] if m is None else [ctx.state_patch("resample_state", where.name, m, ctx.donor_fed)]


def interchange_token(ctx: Context, where: Location) -> list[Spec]:
    if where.kind != "token":
        return []
    b, c = ctx.b, ctx.clean
    s = int(b.label_pos.min())
    if not b.aligned:
        return [Spec("interchange_token", TOKEN_SITE, "label_token", s, [], twin_run=True)]
    emb = torch.where((ctx.t == b.label_pos[:, None])[..., None], ctx.twin.emb, c.emb)
    keep = [(STATE_HOOK, replace_where(ctx.t >= s, c.fed))] if ctx.passes is None else []
    return [Spec("interchange_token", TOKEN_SITE, "label_token", s, keep, emb)]


def erase_probe(ctx: Context, where: Location) -> list[Spec]:
    if where.kind != "depth" or where.alpha is not None:
        return []
    tl = ctx.at_depth(where.depth)
    fn = lambda x: erase(x, tl.erase_left, tl.erase_right, tl.erase_bias)  # noqa: E731
    return [ctx.depth_patch("erase_probe", where.depth, fn)]


def erase_random(ctx: Context, where: Location) -> list[Spec]:
    if where.kind != "depth" or where.alpha is not None:
        return []
    tl = ctx.at_depth(where.depth)
    fn = lambda x: erase_subspace(x, tl.random_basis, tl.erase_bias)  # noqa: E731
    return [ctx.depth_patch("erase_random", where.depth, fn)]


def _steer(name: str, field: str):
    """A steering kind: at each depth and alpha, x + alpha * sigma * u, u = ``field``."""

    def steer(ctx: Context, where: Location) -> list[Spec]:
        if where.kind != "depth" or where.alpha is None:
            return []
        tl = ctx.at_depth(where.depth)
        delta = (where.alpha * tl.sigma)[:, None] * getattr(tl, field)
        fn = lambda x: x + delta[:, None, :]  # noqa: E731
        return [ctx.depth_patch(name, where.depth, fn, where.alpha)]

    steer.__name__ = name
    return steer


def self_patch(ctx: Context, where: Location) -> list[Spec]:
    c = ctx.clean
    if where.kind == "check" and ctx.feedback:
        m = window_mask("all", ctx.b)
        return [Spec("self", STATE_HOOK, "all", 1, [(STATE_HOOK, replace_where(m, c.fed))])]
    if where.kind == "token" and not ctx.feedback:
        return [Spec("self", TOKEN_SITE, "label_token", int(ctx.b.label_pos.min()), [], c.emb)]
    return []


# ---- the registry ---------------------------------------------------------------------
@dataclass(frozen=True)
class Intervention:
    name: str
    fn: Callable[[Context, Location], list[Spec]]
    directions: bool = False  # needs the erasers and probe directions fitted at each depth


REGISTRY: Registry = Registry("intervention")


def register_intervention(
    name: str, fn: Callable, directions: bool = False, *, replace: bool = False
) -> Callable:
    """Add an intervention kind (``fn(ctx, where) -> list[Spec]``) under ``name``;
    ``directions``: it reads ``ctx.tools`` (erasers and probe directions by depth). A name
    already registered is refused unless ``replace``. Returns ``fn``."""
    REGISTRY.add(name, Intervention(name, fn, directions), replace=replace)
    return fn


register_intervention("interchange_state", interchange_state)
register_intervention("zero_state", zero_state)
register_intervention("mean_state", mean_state)
register_intervention("resample_state", resample_state)
register_intervention("interchange_token", interchange_token)
register_intervention("erase_probe", erase_probe, directions=True)
register_intervention("erase_random", erase_random, directions=True)
register_intervention("steer_probe", _steer("steer_probe", "unit"), directions=True)
register_intervention("steer_random", _steer("steer_random", "random_unit"), directions=True)
# last, so that at the label token the check's row follows the interchange it checks
register_intervention("self", self_patch)


def parse_interventions(spec: str | None) -> tuple[str, ...]:
    """``--intervention``'s value: names, comma-separated, or None / 'all' for every kind."""
    if spec is None or spec == "all":
        return tuple(REGISTRY)
    names = comma_items(spec, "--intervention")
    for n in names:
        if n not in REGISTRY:
            raise ValueError(f"unknown intervention {n!r}; choose from {', '.join(REGISTRY)}")
    return names


def locations(ctx: Context) -> list[Location]:
    """Every place of one batch, in the order the table lists them."""
    out = [Location("check")]
    if ctx.feedback:
        out += [
            Location("window", w) for w in WINDOWS if first_true(window_mask(w, ctx.b)) is not None
        ]
    out.append(Location("token"))
    if ctx.tools is not None:
        for d in sorted(ctx.tools):
            out += [Location("depth", depth=d)]
            out += [Location("depth", depth=d, alpha=a) for a in ALPHAS]
    return out


def specs(ctx: Context, kinds: tuple[str, ...]) -> list[Spec]:
    """Every patched run of one batch: each place, each kind of ``kinds`` there."""
    return [s for where in locations(ctx) for k in kinds for s in REGISTRY[k].fn(ctx, where)]

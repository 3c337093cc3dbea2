"""Per-pass caches: the activations a multi-pass forward keeps, filed by pass, at chosen positions
only (``FeedbackModel.run_with_pass_caches``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformer_lens import ActivationCache
from transformer_lens.hook_points import HookPoint

from fbt_probe.positions import pos_dim, put, select_positions, take

if TYPE_CHECKING:  # the model is what fills the caches; this module is below it
    from fbt_probe.feedback import FeedbackModel


class PositionCapture:
    """A caching hook that files activations by pass and keeps only chosen positions."""

    def __init__(
        self,
        model: FeedbackModel,
        names_filter,
        positions: torch.Tensor | None,
        n_passes: int,
        by_pass: bool = True,
        only_pass: int | None = None,
    ):
        self.model = model
        self.by_pass = by_pass  # False: one cache for everything (the recurrence)
        self.only_pass = only_pass  # keep this pass's activations only (None: every pass)
        if names_filter is None:
            self.filter = lambda name: True
        elif isinstance(names_filter, str):
            self.filter = lambda name: name == names_filter
        elif callable(names_filter):
            self.filter = names_filter
        else:
            allowed = set(names_filter)
            self.filter = lambda name: name in allowed
        self.squeeze = positions is not None and positions.ndim == 1
        self.positions = (
            None
            if positions is None
            else (positions[:, None] if self.squeeze else positions).long()
        )
        # one store per pass; with ``only_pass``, one store, for that pass
        self.store: list[dict[str, object]] = [
            {} for _ in range(1 if only_pass is not None else n_passes)
        ]

    def hook(self, tensor: torch.Tensor, hook: HookPoint) -> None:
        name = hook.name
        k = (self.model.context["pass_number"] or 1) - 1 if self.by_pass else 0
        if self.only_pass is not None:
            if k != self.only_pass:
                return
            k = 0
        t = tensor.detach()
        if self.positions is None:
            self.store[k].setdefault(name, []).append(t)
            return
        if pos_dim(hook) != 1 and t.shape[2] != t.shape[3]:
            raise ValueError(
                "hook_pattern at chosen positions is only available in multi-pass forwards"
            )
        buf = self.store[k].get(name)
        if buf is None:
            shape = list(t.shape)
            shape[pos_dim(hook)] = self.positions.shape[1]
            buf = torch.zeros(shape, dtype=t.dtype, device=t.device)
            self.store[k][name] = buf
        b, j, src = select_positions(t, hook, self.positions.to(t.device))
        if len(b):
            put(buf, hook, b, j, take(t, hook, b, src))

    def caches(self) -> PassCaches:
        out = []
        for d in self.store:
            final = {}
            for name, v in d.items():
                axis = pos_dim(self.model.hook_dict[name])
                if isinstance(v, list):
                    v = v[0] if len(v) == 1 else torch.cat(v, dim=axis)
                elif self.squeeze:
                    v = v.select(axis, 0)
                final[name] = v
            out.append(ActivationCache(final, self.model))
        first = self.only_pass + 1 if self.only_pass is not None else 1
        return PassCaches(out, first)


class PassCaches:
    """One ``ActivationCache`` per pass, numbered as passes are everywhere in fbt-probe, from
    1: ``caches.of_pass(2)`` is pass 2, ``caches.last`` the last pass kept; iterating gives
    them in pass order. Indexing by position (``caches[1]``, which counted from 0) is refused,
    so that no old call quietly reads another pass."""

    def __init__(self, caches: list[ActivationCache], first: int = 1):
        self._caches, self.first = list(caches), first

    def of_pass(self, k: int) -> ActivationCache:
        """Pass ``k``'s cache (counted from 1)."""
        if not self.first <= k < self.first + len(self._caches):
            raise IndexError(f"pass {k}: these caches hold passes {self.passes}")
        return self._caches[k - self.first]

    @property
    def passes(self) -> range:
        """The passes held, counted from 1."""
        return range(self.first, self.first + len(self._caches))

    @property
    def last(self) -> ActivationCache:
        return self._caches[-1]

    def __iter__(self):
        return iter(self._caches)

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i):
        hint = f"caches.of_pass({i + 1})" if isinstance(i, int) and i >= 0 else "caches.last"
        raise TypeError(
            f"caches[{i}] counted passes from 0 and is gone: use {hint} (passes are counted from 1)"
        )

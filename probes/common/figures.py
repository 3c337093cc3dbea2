"""Figures without a plotting backend: each is a ``matplotlib.figure.Figure`` of its own, drawn
and saved without pyplot, so that importing fbt-probe never sets a backend (a notebook keeps
its own) and no figure stays open in pyplot's global state."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from fbt_probe.util.files import atomic_write

PREFILL_ORDER = ["standard", "recurrent", "full"]
CMAP = "cividis"  # perceptually uniform and colour-blind safe
PALETTE = sns.color_palette("colorblind")


def ordered_prefills(df: pd.DataFrame) -> list[str]:
    """The prefills of a table in reading order: standard, recurrent, full, then the rest
    as they come (k<N>)."""
    present = list(dict.fromkeys(df.prefill))
    return [p for p in PREFILL_ORDER if p in present] + [
        p for p in present if p not in PREFILL_ORDER
    ]


def subplots(nrows: int = 1, ncols: int = 1, **kw):
    """``(figure, axes)`` as ``pyplot.subplots`` returns them, without pyplot: ``figsize``
    and ``layout`` go to the figure, the rest (``squeeze``, ``sharex``, ...) to its axes."""
    fig = Figure(**{k: kw.pop(k) for k in ("figsize", "layout", "dpi") if k in kw})
    return fig, fig.subplots(nrows, ncols, **kw)


def save_figure(fig, out: Path, stem: str) -> list[Path]:
    """``stem``.png and .pdf in ``out``, each written whole or not at all (a failed write
    leaves no partial or temporary file)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    atomic_write(paths[0], lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    atomic_write(paths[1], lambda tmp: fig.savefig(tmp, format="pdf", bbox_inches="tight"))
    return paths


DIVERGING = "RdBu"  # 0 (the twin's answer) red, 1 (the clean one) blue


def site_depth(site: str) -> int:
    """blocks.{l}.hook_resid_pre -> l; blocks.{l}.hook_resid_post -> l + 1."""
    layer = int(re.search(r"blocks\.(\d+)\.", site).group(1))
    return layer + 1 if site.endswith("resid_post") else layer


def logit_diff_heatmap(ax, table: pd.DataFrame, label: str) -> None:
    """A map on the normalised logit difference's scale (1: the clean run's answer, 0: the
    twin's), diverging around 0.5, with its values written in where there are few."""
    sns.heatmap(
        table,
        ax=ax,
        cmap=DIVERGING,
        vmin=-0.2,
        vmax=1.2,
        center=0.5,
        annot=table.size <= 200,
        fmt=".2f",
        cbar_kws={"label": label},
    )

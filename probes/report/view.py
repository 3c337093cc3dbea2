"""``fbt-probe view``: chosen examples as one interactive page that works offline.

For each example, from one ``passes``-pass forward of its prompt (through the colon):

- its tokens;
- per pass, what the saved probes of ``fbt-probe fit`` predict at every depth and position
  (pass 1 with the standard-prefill probes, later passes with the recurrent ones; the probes
  were fitted at the colon, so elsewhere they only say what a colon-trained reader would see);
- per pass, layer and head, the attention pattern (the ``blocks.{l}.attn.hook_pattern`` hooks);
- per pass, the logit lens at every depth and position, and from pass 2 on the lens's reads of
  the fed-back state: ``fed_state`` (the head on h_{t-1}) and ``fed_value`` (the head on the
  fusion's value W_U h_{t-1}; ``docs/anatomy.md``); with a tuned lens of ``fbt-probe lens``
  (``--tuned-lens``, or the one in ``<probes>/lens/tuned_lens`` where it fits the model), its
  read at every depth too.

The page holds its data as JSON and draws it with its own script: no CDN, no server.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.kernels.heads import pattern_hooks
from fbt_probe.kernels.lens import Translators
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import jacobi_passes
from fbt_probe.runtime.device import resolve_device
from fbt_probe.util.files import check_output_file, claims
from fbt_probe.util.lists import comma_numbers
from probes.common.artifacts import load_probes
from probes.common.data import load_or_generate, one_task
from probes.common.html import esc, page, write_page
from tasks import vocab

MAX_PASSES = 8
MAX_EXAMPLES = 8
DEFAULT_COUNT = (
    8  # the default examples' distractor count: short to read, long enough to need state
)
TOP_K = 3  # tokens a lens cell lists in its tooltip
SCRIPT = Path(__file__).with_name("view.js")


def parse_examples(spec: str) -> list[int]:
    """The row numbers ``spec`` names ("3,17"; empty: the default rows), read before any work."""
    if not spec.strip():
        return []
    usage = f"--examples: row numbers separated by commas, got {spec!r}"
    rows = list(comma_numbers(spec, "--examples", lambda x: [int(x)], usage))
    if len(rows) > MAX_EXAMPLES:
        raise ValueError(
            f"--examples: at most {MAX_EXAMPLES} examples in one page, got {len(rows)}"
        )
    return rows


def pick_examples(ds, spec: str) -> list[int]:
    """Rows named by ``spec`` ("3,17"), or by default the first two with DEFAULT_COUNT
    distractors (the first two rows where there are none)."""
    rows = parse_examples(spec)
    if not rows:
        rows = np.flatnonzero(ds.n_distractors == DEFAULT_COUNT)[:2].tolist()
        return rows or list(range(min(2, len(ds))))
    if any(not 0 <= r < len(ds) for r in rows):
        raise ValueError(f"--examples: rows must be in 0..{len(ds) - 1}, got {spec!r}")
    return rows


def token_words(model, ids) -> list[str]:
    """Each token as text: the built-in vocabulary's words, or a tokenizer's pieces."""

    enc = getattr(model, "encoding", None)
    if enc is None:
        return vocab.decode(ids).split(" ")
    return [enc.tok.decode([int(i)]) for i in ids]


def saved_probes(folder: Path, task: str, mhash: str) -> tuple[list, str]:
    """The saved probes of ``task`` fitted on this model's residual stream, and a note."""

    try:
        probes = load_probes(folder)
    except FileNotFoundError as e:
        return [], f"{e}; run 'fbt-probe fit --task {task}' to see the probes here"
    mine = [
        p for p in probes if p.meta.get("task") == task and p.meta.get("site", "resid") == "resid"
    ]
    if not mine:
        return [], f"{folder} holds no probes of {task}"
    if any(p.meta.get("model_hash") != mhash for p in mine):
        return (
            [],
            f"the probes in {folder} were fitted on another model (hash {mine[0].meta.get('model_hash')})",
        )
    return mine, f"probes from {folder}"


def tuned_lens_of(model, mhash: str, folder, probes: Path):
    """The tuned lens named (refused in one line unless it loads and fits the model), else the
    one a fit's results folder holds (``lens/tuned_lens``, used only where it fits), and a note."""

    if folder is not None:
        return Translators.load(folder, model, mhash), f"tuned lens from {folder}"
    auto = probes / "lens" / "tuned_lens"
    try:
        return Translators.load(auto, model, mhash), f"tuned lens from {auto}"
    except (OSError, ValueError):
        return None, "no tuned lens (fbt-probe lens fits one)"


def probe_reads(probes: list, xs: list[np.ndarray]) -> list[dict]:
    """Per pass: the prefill whose probes read it and, per target, each depth's predicted
    label at every position. ``xs[k]`` is pass k+1's residual (depths, pos, d_model)."""
    out = []
    for k, x in enumerate(xs):
        prefill = "standard" if k == 0 else "recurrent"
        by_target = {}
        for p in probes:
            if p.meta["prefill"] != prefill or p.meta["depth"] >= len(x):
                continue
            rows = by_target.setdefault(p.meta["target"], [None] * len(x))
            rows[p.meta["depth"]] = [str(v) for v in p.predict(x[p.meta["depth"]])]
        out.append({"prefill": prefill, "targets": by_target})
    return out


def _top(model, read, x: torch.Tensor, words) -> list:
    """The top token of each row of x read through ``read`` (the head), with its probability
    and the TOP_K best as 'word p' lines."""
    p = read(x).float().softmax(-1)
    val, idx = p.topk(TOP_K, dim=-1)
    return [
        [
            words(int(i[0])),
            round(float(v[0]), 3),
            "\n".join(f"{words(int(a))} {float(b):.3f}" for a, b in zip(i, v, strict=True)),
        ]
        for v, i in zip(val, idx, strict=True)
    ]


def lens_reads(model, caches, hooks, words, tuned=None) -> list[list[dict]]:
    """Per pass, rows of lens reads over positions: fed_state and fed_value (from pass 2),
    the logit lens at each depth, then the tuned lens at each depth (with ``tuned``, a
    ``fbt_probe.kernels.lens.Translators``)."""
    out = []
    for cache in caches:
        rows = []
        if "fusion.hook_state" in cache:
            h = cache["fusion.hook_state"][0]
            rows.append({"name": "fed_state", "cells": _top(model, model.read_state, h, words)})
            value = h @ model.fusion.W_U.T
            rows.append({"name": "fed_value", "cells": _top(model, model.read_resid, value, words)})
        for d, hook in enumerate(hooks):
            rows.append(
                {
                    "name": f"depth {d}",
                    "cells": _top(model, model.read_resid, cache[hook][0], words),
                }
            )
        for d, hook in enumerate(hooks if tuned is not None else []):
            x = tuned.apply(d, cache[hook][0].float())
            rows.append({"name": f"tuned {d}", "cells": _top(model, model.read_resid, x, words)})
        out.append(rows)
    return out


# attention weights travel as one character each: the printable ASCII characters a JSON
# string holds as they are (all but '"' and '\\'), 93 levels of weight (steps of 1/92)
ALPHABET = "".join(chr(c) for c in range(32, 127) if c not in (34, 92))
LEVELS = len(ALPHABET) - 1


def encode_weights(w: torch.Tensor) -> str:
    """Weights in [0, 1] as a string, one character of ALPHABET per weight."""
    idx = (w.float().clamp(0, 1) * LEVELS).round().to(torch.int64).cpu().numpy()
    return "".join(np.array(list(ALPHABET))[idx.ravel()])


def patterns(caches, n_layers: int) -> list[list[list[str]]]:
    """``[pass][layer][head]``: the causal pattern's lower triangle, row by row, encoded by
    ``encode_weights`` (the page decodes it)."""
    out = []
    for cache in caches:
        layers = []
        for layer in range(n_layers):
            a = cache[f"blocks.{layer}.attn.hook_pattern"][0]  # (head, q, k)
            rows = torch.tril_indices(a.shape[-1], a.shape[-1])
            layers.append([encode_weights(h[rows[0], rows[1]]) for h in a])
        out.append(layers)
    return out


@torch.no_grad()
def example_data(model, ds, row: int, passes: int, probes: list, words, tuned=None) -> dict:
    """Everything the page shows of one example."""

    colon = int(ds.colon_index[row])
    ids = [int(i) for i in ds.token_ids[row][: colon + 1]]
    hooks = model.depth_hooks()
    names = [*hooks, "fusion.hook_state", *(pattern_hooks(model) if model.n_heads else [])]
    dev = next(model.parameters()).device
    _, caches = model.run_with_pass_caches(
        torch.tensor([ids], device=dev), passes=passes, names_filter=names
    )
    xs = [torch.stack([c[h][0] for h in hooks]).float().cpu().numpy() for c in caches]
    return {
        "row": row,
        "distractors": int(ds.n_distractors[row]),
        "colon": colon,
        "tokens": token_words(model, ids),
        "labels": list(ds.labels[row]),
        "probe": probe_reads(probes, xs),
        "lens": lens_reads(model, caches, hooks, words, tuned),
        "attention": patterns(caches, model.cfg.n_layers) if model.n_heads else [],
    }


@claims("out")
def view(
    *,
    model: str = "default",
    task: str = "delayed_memory",
    examples: str = "",
    data: str | Path | None = None,
    probes: str | Path = "results",
    prefill: str = "k3",
    tuned_lens: str | Path | None = None,
    out: str | Path = "results/view.html",
    device: str = "cpu",
    force: bool = False,
    progress=None,
) -> tuple[Path, list[str]]:
    """``fbt-probe view`` (see the module docstring); every argument is checked first, and
    a page already at ``out`` is replaced only with ``force``."""

    t0, out = time.monotonic(), Path(out)
    one_task(task)
    passes = jacobi_passes(prefill, 1, MAX_PASSES)
    parse_examples(examples)
    if out.suffix != ".html":
        raise ValueError(f"--out: the page is one .html file, got {out}")
    check_output_file(out, force=force)
    m, name = resolve_model(model, resolve_device(device))
    m.eval()
    ds = load_or_generate(task, data, m)
    rows = pick_examples(ds, examples)
    found, note = saved_probes(Path(probes), task, model_hash(m))
    tuned, lens_note = tuned_lens_of(m, model_hash(m), tuned_lens, Path(probes))
    words = lambda i: token_words(m, [i])[0]  # noqa: E731
    shown = []
    for k, r in enumerate(rows):
        shown.append(example_data(m, ds, r, passes, found, words, tuned))
        if progress is not None:
            progress(k + 1, len(rows), f"{task}: row {r}")
    doc = {
        "model": name,
        "task": task,
        "passes": passes,
        "layers": m.cfg.n_layers,
        "heads": m.n_heads,
        "probe_note": note,
        "lens_note": lens_note,
        "examples": shown,
        "alphabet": ALPHABET,
    }
    body = (
        f"<h1>fbt-probe view: {esc(task)} on {esc(name)}</h1>"
        '<div id="controls"></div><div id="app"></div>'
    )
    write_page(out, page(f"fbt-probe view: {task}", body, data=doc, script=SCRIPT.read_text()))
    size = out.stat().st_size / 2**20
    return out, [
        f"wrote {out} ({size:.1f} MB): {task}, rows {', '.join(map(str, rows))}, "
        f"{passes} passes; {note}; {lens_note} ({time.monotonic() - t0:.1f} s)"
    ]

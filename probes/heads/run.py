"""``fbt-probe heads``: attention by pass, per head, on each task's prompts with twins.

Per task, pass, layer and head (``fbt_probe.kernels.heads``):

- ``prev_token``: the weight of each position on the one before it, over the prompt up to the
  read position (the one whose next token is the answer);
- ``label``: the weight of the read position on the label-bearing token (the token where the
  counterfactual twin differs: delayed_memory's bit, done_tracking's count, the last write of
  multi_register's register);
- ``label_next``: its weight on the token after the label-bearing one, whose block-0 input from
  pass 2 on carries the label-bearing token's fed-back state;
- ``induction``: the standard induction score on a random sequence repeated once (no task).

The first two are given for all distractor counts pooled and for each count, with 95 %
intervals from resampling whole groups; induction over the random sequences. One example per
task (the first with the fewest distractors, at least 4 where there is one) is kept whole:
the read position's attention row of every head in every pass (``heads_pattern.csv``).
Writes ``heads.csv``, ``heads_pattern.csv``, ``heads.json`` and two figures per task.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fbt_probe.kernels.heads import head_reads, induction_scores, repeated_tokens
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.device import resolve_device
from probes.analysis import Result
from probes.common.bootstrap import N_BOOT, GroupBootstrap
from probes.common.data import load_or_generate
from probes.common.extract import max_batch_tokens
from probes.common.tables import write_json, write_table
from probes.common.twins import Pairs, batches, pairs_of
from probes.common.work import check_data_work
from probes.heads.options import HeadsOptions
from probes.heads.plot import plot_heads
from tasks import vocab
from tasks.base import POOLED

COLUMNS = [
    "task",
    "metric",
    "pass",
    "layer",
    "head",
    "distractors",
    "value",
    "ci_low",
    "ci_high",
    "n",
]
MEASURES = ("prev_token", "label", "label_next", "induction")
PER_EXAMPLE = MEASURES[:3]
INDUCTION_SEQS, INDUCTION_HALF = 64, 24


def shown_example(counts: np.ndarray) -> int:
    """The pair whose pattern is drawn: the first with the fewest distractors, at least 4
    where there is one (a prompt short enough to read, long enough to have a past)."""
    ok = np.flatnonzero(counts >= 4)
    pool = ok if len(ok) else np.arange(len(counts))
    return int(pool[np.argmin(counts[pool])])


def collect(
    model, pairs: Pairs, passes: int, show: int, batch_size: int, progress=None, task: str = ""
) -> dict:
    """(passes, layers, pairs, heads) of each ``PER_EXAMPLE`` measure, and the shown example's
    rows (passes, layers, heads, key_pos)."""

    device = next(model.parameters()).device
    L, H, n = model.cfg.n_layers, model.n_heads, len(pairs)
    got = {m: np.zeros((passes, L, n, H), np.float32) for m in PER_EXAMPLE}
    bs = batches(pairs, batch_size, device, max_tokens=max_batch_tokens(model))
    row = None
    for k, b in enumerate(bs):
        mine = tuple(np.flatnonzero(b.idx == show))
        r = head_reads(model, b.tokens, b.answer, b.label_pos, passes, mine)
        for m in PER_EXAMPLE:
            got[m][:, :, b.idx] = getattr(r, m).numpy()
        if mine:
            row = r.rows[mine[0]].numpy()
        if progress is not None:
            progress(k + 1, len(bs), f"{task}: attention by pass")
    got["row"] = row
    return got


def summarise(
    task: str, got: dict, pairs: Pairs, counts: np.ndarray, seed: int, n_boot: int = N_BOOT
) -> list[dict]:
    """Rows of ``COLUMNS`` for the per-example measures, pooled and by count."""
    rows = []
    passes, L, n, H = got["label"].shape
    cells = [(POOLED, np.ones(n, bool))] + [(str(int(c)), counts == c) for c in np.unique(counts)]
    for cell, mask in cells:
        boot = GroupBootstrap(pairs.groups[mask], seed, n_boot)
        for measure in PER_EXAMPLE:
            # (examples, passes * layers * heads): every head's interval from the same draws
            v = got[measure][:, :, mask].transpose(2, 0, 1, 3).reshape(int(mask.sum()), -1)
            rows += _rows(task, measure, cell, v, boot, (passes, L, H))
    return rows


def _rows(task, measure, cell, v: np.ndarray, boot: GroupBootstrap, shape) -> list[dict]:
    lo, hi = np.percentile(boot.mean_columns(v), [2.5, 97.5], axis=0)
    mean = v.mean(0)
    out = []
    for j, (k, layer, h) in enumerate(np.ndindex(*shape)):
        out.append(
            {
                "task": task,
                "metric": measure,
                "pass": k + 1,
                "layer": layer,
                "head": h,
                "distractors": cell,
                "value": float(mean[j]),
                "ci_low": float(lo[j]),
                "ci_high": float(hi[j]),
                "n": len(v),
            }
        )
    return out


def induction_rows(model, passes: int, seed: int, n_boot: int = N_BOOT) -> list[dict]:
    """``induction`` rows (task ``-``): ``INDUCTION_SEQS`` random sequences, each its own group."""
    device = next(model.parameters()).device
    enc = getattr(model, "encoding", None)
    if enc is None:
        ids = torch.tensor(
            [i for i in range(len(vocab.TOKENS)) if i not in (vocab.PAD_ID, vocab.BOS_ID)]
        )
        bos = vocab.BOS_ID
    else:
        special = set(enc.tok.all_special_ids)
        ids = torch.tensor(
            [i for i in range(min(len(enc.tok), model.cfg.d_vocab)) if i not in special]
        )
        bos = enc.tok.bos_token_id
    half = min(INDUCTION_HALF, (model.cfg.n_ctx - 1) // 2)
    toks = repeated_tokens(ids, INDUCTION_SEQS, half, bos, seed).to(device)
    s = induction_scores(model, toks, half, passes).numpy()  # (passes, layers, seqs, heads)
    passes_, L, n, H = s.shape
    v = s.transpose(2, 0, 1, 3).reshape(n, -1)
    boot = GroupBootstrap(np.arange(n), seed, n_boot)
    return _rows("-", "induction", "-", v, boot, (passes_, L, H))


def pattern_rows(task: str, model, pairs: Pairs, show: int, row: np.ndarray) -> pd.DataFrame:
    """The shown example's read row, long: one line per pass, layer, head and key position."""
    ids = pairs.tokens[show][: int(pairs.answer[show]) + 1]
    enc = getattr(model, "encoding", None)
    # a tokenizer's pieces as text (its byte-level symbols, such as 'Ġ' for a space, are not)
    words = (
        vocab.decode(ids).split(" ")
        if enc is None
        else [enc.tok.decode([int(i)]).strip() or repr(enc.tok.decode([int(i)])) for i in ids]
    )
    passes, L, H, T = row.shape
    k, layer, h, pos = np.meshgrid(*(np.arange(x) for x in row.shape), indexing="ij")
    return pd.DataFrame(
        {
            "task": task,
            "pass": k.ravel() + 1,
            "layer": layer.ravel(),
            "head": h.ravel(),
            "position": pos.ravel(),
            "token": np.array(words, dtype=object)[pos.ravel()],
            "is_label": pos.ravel() == int(pairs.label_pos[show]),
            "weight": row.ravel(),
        }
    )


def headline(df: pd.DataFrame, task: str) -> str:
    """The head that reads the label (and the token after it) most in each pass, and the
    strongest previous-token and induction heads."""

    def top(measure, t, k):
        g = df[(df.task == t) & (df.metric == measure) & (df["pass"] == k)]
        g = g[g.distractors.isin([POOLED, "-"])]
        r = g.loc[g.value.idxmax()]
        return f"L{r.layer}H{r['head']} {r.value:.3f}"

    passes = sorted(set(df[df.task == task]["pass"]))
    label = ", ".join(f"pass {k} {top('label', task, k)}" for k in passes)
    nxt = ", ".join(f"pass {k} {top('label_next', task, k)}" for k in passes)
    last = passes[-1]
    return (
        f"{task}: the read position's strongest attention to the label token: {label}; "
        f"to the token after it: {nxt}; previous-token head {top('prev_token', task, last)}; "
        f"induction head {top('induction', '-', last)} (pass {last})."
    )


def run(options: HeadsOptions, progress=None) -> Result:
    """``fbt-probe heads`` (see the module docstring), on options checked before any work;
    its table and the lines it reports."""
    o, out, t0 = options, Path(options.out), time.monotonic()
    task_list, data_map = o.tasks_and_data
    m, name = resolve_model(o.model, resolve_device(o.device))
    m.eval()
    if not m.n_heads:
        raise ValueError(f"{name}: its attention layout has no per-head hooks here")
    datasets = {t: load_or_generate(t, (data_map or {}).get(t), m, twins=True) for t in task_list}
    check_data_work(m, datasets.values(), o.passes, 1, "--prefill")  # one run of every example
    rows, patterns, shown = induction_rows(m, o.passes, o.seed), [], {}
    for t, ds in datasets.items():
        pairs = pairs_of(ds)
        counts = ds.n_distractors[pairs.rows]
        show = shown_example(counts)
        got = collect(m, pairs, o.passes, show, o.batch_size, progress, t)
        rows += summarise(t, got, pairs, counts, o.seed)
        patterns.append(pattern_rows(t, m, pairs, show, got["row"]))
        shown[t] = {
            "row": int(pairs.rows[show]),
            "distractors": int(counts[show]),
            "pairs": len(pairs),
        }
    df, lines = _write(
        out,
        pd.DataFrame(rows, columns=COLUMNS),
        pd.concat(patterns, ignore_index=True),
        {
            "model": name,
            "tasks": list(task_list),
            "passes": o.passes,
            "seed": o.seed,
            "shown": shown,
            "induction": {"sequences": INDUCTION_SEQS, "half": INDUCTION_HALF},
            "seconds": time.monotonic() - t0,
        },
        plot_heads,
    )
    return Result({"heads": df}, lines)


def _write(
    out: Path, df: pd.DataFrame, pattern: pd.DataFrame, meta: dict, plot
) -> tuple[pd.DataFrame, list[str]]:
    out.mkdir(parents=True, exist_ok=True)
    write_table(df, out / "heads.csv")
    write_table(pattern, out / "heads_pattern.csv")
    write_json(meta, out / "heads.json")
    lines = []
    for t in meta["tasks"]:
        plot(df, pattern, t, out / "figures")
        lines.append(headline(df, t))
    lines.append(
        f"wrote {out / 'heads.csv'} ({len(df)} rows), heads_pattern.csv and figures in "
        f"{out / 'figures'}"
    )
    return df, lines

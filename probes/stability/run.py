"""The stability experiment behind ``fbt-probe stability``: does the feedback map contract?

For each model, Jacobi passes 1..K over held-out sequences (``fbt_probe.kernels.stability``: state
change, loss, accuracy and local Lipschitz estimates per pass) and a long SOFT decoding from
a short prompt; writes ``stability.csv``, ``soft_decoding.csv`` and their figures.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from fbt_probe.hf import require_tokenizer
from fbt_probe.kernels.stability import (
    heldout_batch,
    jacobi_trajectory,
    long_soft_decoding,
    verdict,
)
from fbt_probe.loading import resolve_model
from fbt_probe.runtime.budget import check_work
from probes.analysis import Result
from probes.common.tables import write_table
from probes.stability.options import StabilityOptions
from probes.stability.plot import plot_soft, plot_stability
from tasks import vocab

# the prompt long SOFT decoding continues: a delayed_memory prompt with one distractor
SOFT_PROMPT = ("<bos>", "SET", "ONE", "the", "cat", ":")
LIPSCHITZ_AT = (2, 3, 5, 10, 30, 100, 1000)  # the passes a local Lipschitz estimate is taken at


def sequences_for(passes: int) -> int:
    """Held-out base instances per task: fewer for long runs (1000 passes over the 30-pass
    set would take an hour)."""
    return 16 if passes <= 30 else 4 if passes <= 100 else 2


def label_of(spec: str, name: str) -> str:
    """A model's short name in the tables: 'default', or its folder's name."""
    if spec == "default":
        return "default"
    return Path(name).parent.name if Path(name).name == "model" else Path(name).name


def verdict_line(label: str, traj: list[dict]) -> str:
    """One line per model: the verdict, the state change and the loss's drift."""
    passes = len(traj)
    if passes == 1:
        return f"{label}: 1 pass only"
    ref = traj[min(2, passes - 1)]  # pass 3, the deepest pass of the paper's recipe
    drift = 100 * (traj[-1]["loss"] / ref["loss"] - 1)
    return (
        f"{label}: feedback map {verdict(traj)}; state change pass 2 "
        f"{traj[1]['delta_mean']:.3g} -> pass {passes} {traj[-1]['delta_mean']:.3g}; "
        f"loss pass {ref['pass']} {ref['loss']:.4f} -> pass {passes} "
        f"{traj[-1]['loss']:.4f} ({drift:+.2f} %)"
    )


def soft_prompt_ids(model) -> list[int]:
    """The long soft decoding's prompt as ``model``'s token ids."""
    enc = getattr(model, "encoding", None)
    return vocab.encode(SOFT_PROMPT) if enc is None else enc.tok(" ".join(SOFT_PROMPT))["input_ids"]


def load_models(specs: tuple[str, ...], decode_tokens: int) -> list[tuple]:
    """(spec, model, name) of each ``--model``, each checked to decode ``decode_tokens``."""
    loaded = [(spec, *resolve_model(spec)) for spec in specs]
    for spec, m, _ in loaded:
        require_tokenizer(m)
        need = len(soft_prompt_ids(m)) + decode_tokens - 1
        if decode_tokens and need > m.cfg.n_ctx:
            raise ValueError(
                f"--decode-tokens {decode_tokens}: the prompt and the decoded tokens "
                f"need {need} positions, more than the context of {spec} "
                f"({m.cfg.n_ctx})"
            )
    return loaded


def heldout_batches(loaded: list[tuple], tasks: tuple[str, ...], passes: int) -> dict:
    """One held-out batch per tokenizer, every model's work priced before any work."""
    batches = {}
    for _, m, _ in loaded:
        enc = getattr(m, "encoding", None)
        key = None if enc is None else enc.fingerprint
        if key not in batches:
            batches[key] = heldout_batch(tasks, sequences_for(passes), encoding=enc)
        tokens = int(batches[key].tokens.numel())  # every pass of the batch, in float64 too
        check_work(m, tokens * passes * 2, "--prefill", f"{passes} passes over {tokens:,} tokens")
    return batches


def run(options: StabilityOptions, progress=None) -> Result:
    """``fbt-probe stability`` (see the module docstring) on each model ``--model`` names,
    on options checked before any work; the lines it reports (a verdict per model, the
    decoding's finiteness)."""
    o, out, passes = options, Path(options.out), options.passes
    loaded = load_models(o.models, o.decode_tokens)
    batches = heldout_batches(loaded, o.tasks, passes)
    rows, soft, lines = [], [], []
    for spec, m, name in loaded:
        label, enc = label_of(spec, name), getattr(m, "encoding", None)
        traj = jacobi_trajectory(
            m,
            batches[None if enc is None else enc.fingerprint],
            passes,
            progress=progress,
            lipschitz_at=tuple(k for k in LIPSCHITZ_AT if k <= passes),
        )
        rows += [{"model": label, **r} for r in traj]
        lines.append(verdict_line(label, traj))
        if o.decode_tokens:
            prompt = torch.tensor([soft_prompt_ids(m)] * 4)
            soft += [{"model": label, **r} for r in long_soft_decoding(m, prompt, o.decode_tokens)]
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    write_table(df, out / "stability.csv")
    plot_stability(df, out)
    if soft:
        sd = pd.DataFrame(soft)
        write_table(sd, out / "soft_decoding.csv")
        plot_soft(sd, out)
        bad = sd[~sd.finite]
        lines.append(
            f"SOFT decoding of {o.decode_tokens} tokens: "
            + ("all states finite" if bad.empty else f"{len(bad)} steps with NaN/inf")
        )
    lines.append(f"wrote {out / 'stability.csv'} and figures in {out}")
    return Result({}, lines)

"""The stability experiment behind ``fbt-probe stability``: does the feedback map contract?

For each model, Jacobi passes 1..K over held-out sequences (``fbt_probe.stability``: state
change, loss, accuracy and local Lipschitz estimates per pass) and a long SOFT decoding from
a short prompt; writes ``stability.csv``, ``soft_decoding.csv`` and their figures.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pandas as pd
import torch

from fbt_probe.budget import check_work
from fbt_probe.hf import require_tokenizer
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import jacobi_passes
from fbt_probe.stability import heldout_batch, jacobi_trajectory, long_soft_decoding, verdict
from probes.analysis import Result
from probes.common.data import one_task
from probes.common.tables import write_table
from probes.stability.plot import plot_soft, plot_stability
from tasks import task_names, vocab
from tasks.safe_files import check_output_dir

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


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    write_table(df, path)


def soft_prompt_ids(model) -> list[int]:
    """The long soft decoding's prompt as ``model``'s token ids."""
    enc = getattr(model, "encoding", None)
    return vocab.encode(SOFT_PROMPT) if enc is None else enc.tok(" ".join(SOFT_PROMPT))["input_ids"]


def stability(
    *,
    models: tuple[str, ...] = ("default",),
    passes: int = 30,
    task: str = "all",
    out: str | Path = "results/stability",
    decode_tokens: int = 1000,
    bars=None,
) -> list[str]:
    """Run the experiment on each model ``models`` names; ``bars(label, total)``, a context
    manager yielding a progress callable, shows each model's passes. Returns the report's
    lines (a verdict per model, the decoding's finiteness)."""

    out = Path(out)
    check_output_dir(out)  # before any work, not after it
    if not 1 <= passes <= 1000:
        raise ValueError("--passes must be in 1..1000")
    if not 0 <= decode_tokens <= 4000:
        raise ValueError("--decode-tokens must be in 0..4000")
    task_list = task_names() if one_task(task, all_too=True) == "all" else (task,)
    loaded = [(spec, *resolve_model(spec)) for spec in models]
    for spec, m, _ in loaded:
        require_tokenizer(m)
        need = len(soft_prompt_ids(m)) + decode_tokens - 1
        if decode_tokens and need > m.cfg.n_ctx:
            raise ValueError(
                f"--decode-tokens {decode_tokens}: the prompt and the decoded tokens "
                f"need {need} positions, more than the context of {spec} "
                f"({m.cfg.n_ctx})"
            )
    batches, rows, soft, lines = {}, [], [], []  # one held-out batch per tokenizer
    for _, m, _ in loaded:  # every model's batch and its work, before any work
        enc = getattr(m, "encoding", None)
        key = None if enc is None else enc.fingerprint
        if key not in batches:
            batches[key] = heldout_batch(task_list, sequences_for(passes), encoding=enc)
        tokens = int(batches[key].tokens.numel())  # every pass of the batch, in float64 too
        check_work(m, tokens * passes * 2, "--prefill", f"{passes} passes over {tokens:,} tokens")
    for spec, m, name in loaded:
        label, enc = label_of(spec, name), getattr(m, "encoding", None)
        key = None if enc is None else enc.fingerprint
        with bars(f"stability {label}", passes) if bars else nullcontext() as bar:
            traj = jacobi_trajectory(
                m,
                batches[key],
                passes,
                progress=bar,
                lipschitz_at=tuple(k for k in LIPSCHITZ_AT if k <= passes),
            )
        rows += [{"model": label, **r} for r in traj]
        lines.append(verdict_line(label, traj))
        if decode_tokens:
            prompt = torch.tensor([soft_prompt_ids(m)] * 4)
            soft += [{"model": label, **r} for r in long_soft_decoding(m, prompt, decode_tokens)]
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    _write_csv(df, out / "stability.csv")
    plot_stability(df, out)
    if soft:
        sd = pd.DataFrame(soft)
        _write_csv(sd, out / "soft_decoding.csv")
        plot_soft(sd, out)
        bad = sd[~sd.finite]
        lines.append(
            f"SOFT decoding of {decode_tokens} tokens: "
            + ("all states finite" if bad.empty else f"{len(bad)} steps with NaN/inf")
        )
    lines.append(f"wrote {out / 'stability.csv'} and figures in {out}")
    return lines


def run(options, progress=None) -> Result:
    """The ``stability`` analysis (``probes.stability.StabilityOptions``): ``progress`` is
    given one bar per model; the library's ``bars`` makes them."""
    o = options
    models = tuple(o.model) if isinstance(o.model, list | tuple) else (o.model,)
    passes = jacobi_passes(o.prefill, 1, 1000)
    lines = stability(
        models=models,
        passes=passes,
        task=o.task,
        out=o.out,
        decode_tokens=o.decode_tokens,
        bars=(lambda label, total: nullcontext(progress)) if progress else None,
    )
    return Result({}, lines)

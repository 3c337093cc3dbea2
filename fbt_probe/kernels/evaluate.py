"""Answer accuracy on held-out data: task x decoding mode x distractor count (``fbt-probe eval``)."""

from __future__ import annotations

import numpy as np
import torch

from fbt_probe.decode import generate_ragged
from fbt_probe.feedback import FeedbackModel
from fbt_probe.hf import require_tokenizer
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import MODES, decode_mode, parse_modes
from fbt_probe.runtime.budget import check_work, prefill_passes
from fbt_probe.runtime.device import resolve_device
from fbt_probe.util.lists import comma_items
from tasks import TASK_NAMES, get_task, task_names, vocab
from tasks.base import DEFAULT_DISTRACTORS, POOLED
from tasks.generate import check_memory

STREAM_HELDOUT = 3  # held-out evaluation: a seed stream of its own, never trained or probed on
EVAL_SEED = 4321


def heldout_examples(
    task: str, n_groups: int, distractors=DEFAULT_DISTRACTORS, seed: int = EVAL_SEED
):
    return get_task(task).generate(n_groups, tuple(distractors), seed, stream=STREAM_HELDOUT)


def encode_for_eval(exs, encoding=None):
    """Prompts (lists of ids), answers (n, longest) padded with -1, and each label's first
    token's index in the answer (n, labels): with the word vocabulary, or a model's
    tokenizer (``tasks.encoding``)."""
    if encoding is None:
        prompts = [vocab.encode(ex.prompt) for ex in exs]
        answers = np.array([vocab.encode(ex.rendered_answer) for ex in exs])
        label_at = np.array([list(ex.label_offsets) for ex in exs])
        return prompts, answers, label_at
    encoding.check_labels(w for ex in exs for w in ex.answer)
    enc = [encoding.encode(ex) for ex in exs]
    prompts = [e.ids[: e.colon_index + 1] for e in enc]
    longest = max(len(e.ids) - e.colon_index - 1 for e in enc)
    answers = np.full((len(enc), longest), -1, dtype=np.int64)
    for i, e in enumerate(enc):
        ans = e.ids[e.colon_index + 1 :]
        answers[i, : len(ans)] = ans
    label_at = np.array([[p - e.colon_index - 1 for p in e.label_positions] for e in enc])
    return prompts, answers, label_at


def unscorable(task: str, encoding, n_groups: int = 8) -> str | None:
    """Why ``task`` cannot be scored through this tokenizer (None: it can)."""
    if encoding is None:
        return None
    try:
        encode_for_eval(heldout_examples(task, n_groups), encoding)
    except ValueError as e:
        return str(e)
    return None


@torch.no_grad()
def evaluate(
    model: FeedbackModel,
    tasks: tuple[str, ...] = TASK_NAMES,
    modes: tuple[str, ...] = tuple(MODES),
    n_groups: int = 48,
    distractors=DEFAULT_DISTRACTORS,
    seed: int = EVAL_SEED,
    progress=None,
) -> tuple[dict, dict]:
    """Greedy decoding of every answer.

    Returns ``(summary, per_register)``: ``summary[task][mode]`` maps "1-256" (pooled over
    counts 1..256) and each count "<n>" to exact-match accuracy (all answer words right);
    ``per_register[task][mode][i]`` is the pooled accuracy of label i (register i's value).
    """
    for m in modes:
        decode_mode(m)
    model.eval()
    summary: dict = {}
    per_reg: dict = {}
    total = len(tasks) * len(modes)
    done = 0
    encoding = getattr(model, "encoding", None)
    for task in tasks:
        exs = heldout_examples(task, n_groups, distractors, seed)
        prompts, answers, label_at = encode_for_eval(exs, encoding)
        counts = np.array([ex.n_distractors for ex in exs])
        summary[task], per_reg[task] = {}, {}
        for mode in modes:
            got = np.array(generate_ragged(model, prompts, mode, answers.shape[1]))
            same = (got == answers) | (answers < 0)  # -1: past a shorter answer's end
            # each label is scored by its first token; the answer by all of its tokens
            word_ok = same[np.arange(len(exs))[:, None], label_at]
            ok = same.all(axis=1)
            pooled = counts >= 1
            row = {POOLED: float(ok[pooled].mean()) if pooled.any() else float("nan")}
            for n in sorted(set(counts.tolist())):
                row[str(n)] = float(ok[counts == n].mean())
            summary[task][mode] = row
            per_reg[task][mode] = (
                [float(x) for x in word_ok[pooled].mean(axis=0)] if pooled.any() else []
            )
            done += 1
            if progress is not None:
                progress(done, total, f"{task} {mode}")
    return summary, per_reg


def check_eval_work(model, tasks, modes, n_groups: int, seed: int) -> float:
    """``eval``'s work priced before it starts (``fbt_probe.runtime.budget``): one group's prompt
    tokens of each task, times ``n_groups``, times each mode's prefill passes (a generated
    answer is a few tokens: left out)."""
    enc = getattr(model, "encoding", None)
    per_group = sum(
        len(p)
        for t in tasks
        for p in encode_for_eval(heldout_examples(t, 1, DEFAULT_DISTRACTORS, seed), enc)[0]
    )
    passes = sum(prefill_passes(decode_mode(m).prefill) for m in modes)
    tokens = per_group * n_groups
    return check_work(
        model,
        tokens * passes,
        "--n-groups, --modes",
        f"{passes:g} passes over {tokens:,} prompt tokens",
    )


def evaluate_model(
    *,
    model: str = "default",
    task: str = "all",
    modes: str = ",".join(MODES),
    n_groups: int = 48,
    seed: int = EVAL_SEED,
    device: str = "cpu",
    progress=None,
):
    """``fbt-probe eval``: the model ``model`` names on ``task`` (a name, a comma-separated list
    or 'all': every task its tokenizer can score) in each decoding mode of ``modes``.
    Returns (model name, summary, per_register, {skipped task: why})."""

    task_list = task_names() if task == "all" else comma_items(task, "--task")
    for t in task_list:
        get_task(t, "--task")
    if n_groups < 5:
        raise ValueError("--n-groups must be at least 5")
    check_memory(n_groups, DEFAULT_DISTRACTORS)  # the held-out set is built whole
    if seed < 0:
        raise ValueError("--seed must be >= 0")
    mode_list = parse_modes(modes)
    m, name = resolve_model(model, resolve_device(device))
    require_tokenizer(m)
    skipped = {}
    if task == "all":  # every task this model's tokenizer can score; the others named
        why = {t: unscorable(t, getattr(m, "encoding", None)) for t in task_list}
        skipped = {t: w for t, w in why.items() if w}
        task_list = tuple(t for t in task_list if not why[t])
        if not task_list:
            raise ValueError("this model's tokenizer can score none of the tasks")
    check_eval_work(m, task_list, mode_list, n_groups, seed)
    summary, per_reg = evaluate(
        m, task_list, mode_list, n_groups=n_groups, seed=seed, progress=progress
    )
    return name, summary, per_reg, skipped


def format_eval(name: str, summary: dict, per_reg: dict) -> str:
    """The table ``fbt-probe eval`` prints: per task, a row per mode, pooled and per count."""
    lines = [f"model: {name}  (exact-match answer accuracy; {POOLED} = pooled over counts 1..256)"]
    for task, by_mode in summary.items():
        counts = [k for k in next(iter(by_mode.values())) if k != POOLED]
        lines += ["", task, "  mode      " + f"{POOLED:<7}" + " ".join(f"{c:>5}" for c in counts)]
        for mode, row in by_mode.items():
            regs = per_reg[task][mode]
            extra = "  per register: " + " ".join(f"{a:.3f}" for a in regs) if len(regs) > 1 else ""
            lines.append(
                f"  {mode:<8} {row[POOLED]:.3f}  "
                + " ".join(f"{row[c]:.3f}"[-5:] for c in counts)
                + extra
            )
    return "\n".join(lines)

"""Answer accuracy on held-out data: task x decoding mode x distractor count (``fbt-probe eval``)."""

from __future__ import annotations

import numpy as np
import torch

from fbt_probe.decode import MODES, generate_ragged
from fbt_probe.model import FBTModel
from tasks import TASK_NAMES, get_task, vocab
from tasks.base import DEFAULT_DISTRACTORS

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
    model: FBTModel,
    tasks: tuple[str, ...] = TASK_NAMES,
    modes: tuple[str, ...] = MODES,
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
        if m not in MODES:
            raise ValueError(f"unknown decoding mode {m!r}; choose from {', '.join(MODES)}")
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
            row = {"1-256": float(ok[pooled].mean()) if pooled.any() else float("nan")}
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

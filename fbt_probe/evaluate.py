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
    for task in tasks:
        exs = heldout_examples(task, n_groups, distractors, seed)
        prompts = [vocab.encode(ex.prompt) for ex in exs]
        answers = np.array([vocab.encode(ex.rendered_answer) for ex in exs])
        label_at = list(exs[0].label_offsets)
        counts = np.array([ex.n_distractors for ex in exs])
        summary[task], per_reg[task] = {}, {}
        for mode in modes:
            got = np.array(generate_ragged(model, prompts, mode, answers.shape[1]))
            word_ok = got == answers
            ok = word_ok.all(axis=1)
            pooled = counts >= 1
            row = {"1-256": float(ok[pooled].mean()) if pooled.any() else float("nan")}
            for n in sorted(set(counts.tolist())):
                row[str(n)] = float(ok[counts == n].mean())
            summary[task][mode] = row
            per_reg[task][mode] = (
                [float(x) for x in word_ok[pooled][:, label_at].mean(axis=0)]
                if pooled.any()
                else []
            )
            done += 1
            if progress is not None:
                progress(done, total, f"{task} {mode}")
    return summary, per_reg

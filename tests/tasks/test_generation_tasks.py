"""The generated-answer tasks: the oracle reads every answer from the prompt alone, twins line
up word for word, and the colon analyses' 'all' leaves them out."""

from __future__ import annotations

import numpy as np
import pytest

from tasks import GENERATION_TASKS, TASK_NAMES, get_task, is_generated, task_names, vocab
from tasks.base import MAX_DISTRACTORS, generate_twins
from tasks.generate import generate_dataset

COUNTS = (0, 1, 7, 64, MAX_DISTRACTORS)


@pytest.mark.parametrize("task", GENERATION_TASKS)
def test_the_oracle_reads_every_answer_from_the_prompt(task):
    mod = get_task(task)
    p = mod.Params()
    for seed in range(3):
        for ex in mod.generate(40, COUNTS, seed, p):
            assert tuple(mod.solve(ex.prompt, p)) == ex.answer
            assert ex.prompt[-1] == vocab.COLON and ex.prompt.count(vocab.COLON) == 1
            assert (
                len(ex.prompt) - len(mod.generate(1, (0,), seed, p)[0].prompt) == ex.n_distractors
            )
    rng = np.random.default_rng(0)
    for _ in range(200):  # the training stream's examples too
        ex = mod.sample(rng, int(rng.integers(0, MAX_DISTRACTORS + 1)), p)
        assert tuple(mod.solve(ex.prompt, p)) == ex.answer


def test_count_steps_answers_and_states():
    mod = get_task("count_steps")
    p = mod.Params(max_count=4)
    ex = mod.render(3, 2, np.random.default_rng(0), p)
    assert ex.answer == ("STEP", "STEP", "STEP", "DONE", "DONE")
    assert mod.step_states(ex.answer) == (3, 2, 1, 0, 0) and mod.answer_length(ex.answer) == 3
    with pytest.raises(ValueError, match="max_count"):
        mod.Params(max_count=1)


@pytest.mark.parametrize("task", GENERATION_TASKS)
def test_twins_line_up_and_change_one_answer_word(task):
    mod = get_task(task)
    p = mod.Params()
    exs = mod.generate(30, COUNTS, 5, p)
    twins = generate_twins(mod, 30, COUNTS, 5, p, 0)
    assert len(twins) == len(exs) and all(t is not None for t in twins)
    for ex, t in zip(exs, twins, strict=True):
        assert len(t.example.tokens) == len(ex.tokens)
        diff = [
            i for i, (a, b) in enumerate(zip(ex.answer, t.example.answer, strict=True)) if a != b
        ]
        assert diff == [t.target]
        assert tuple(mod.solve(t.example.prompt, p)) == t.example.answer


def test_the_colon_analyses_all_leaves_generated_tasks_out():
    assert task_names() == TASK_NAMES
    assert task_names(generated=True) == GENERATION_TASKS
    assert all(is_generated(t) for t in GENERATION_TASKS) and not is_generated("delayed_memory")


def test_generation_commands_refuse_a_colon_task():
    from probes.common.decoding import generation_tasks

    assert generation_tasks("all") == GENERATION_TASKS
    with pytest.raises(ValueError, match="--task delayed_memory: its answer is read at the colon"):
        generation_tasks("delayed_memory")
    with pytest.raises(ValueError, match="--task"):
        generation_tasks("nope")


def test_a_damaged_dataset_is_refused_by_the_oracle(tmp_path):
    from probes.common.decoding import oracle
    from tasks.dataset import load

    path = generate_dataset("recall_bits", tmp_path / "rr.parquet", n_groups=5, distractors=(1, 3))
    ds = load(path)
    assert [tuple(a) for a in oracle(ds)] == [tuple(x) for x in ds.labels]
    ds.labels[2] = tuple(reversed(ds.labels[2])) if len(set(ds.labels[2])) > 1 else ("V9",) * 4
    with pytest.raises(ValueError, match="row 2's answer .* is not the oracle's"):
        oracle(ds)

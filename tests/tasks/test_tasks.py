"""Task generators against an independent oracle, and their invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tasks
from tasks import vocab
from tasks.base import DEFAULT_DISTRACTORS
from tests.oracle import interpret, overwrites

ALL_COUNTS = tuple(range(0, 257))


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_oracle_agrees_at_every_count(task):
    exs = tasks.get_task(task).generate(12, ALL_COUNTS, seed=7)
    assert len(exs) == 12 * 257
    for ex in exs:
        assert interpret(ex.text) == ex.answer, ex.text
        assert ex.prompt.count(vocab.COLON) == 1 and ex.prompt[-1] == vocab.COLON
        n_fill = sum(w in vocab.DISTRACTORS for w in ex.prompt)
        assert n_fill == ex.n_distractors
        if task == "multi_register":
            assert overwrites(ex.text) == ex.overwrites


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_groups_share_label_across_counts(task):
    exs = tasks.get_task(task).generate(40, DEFAULT_DISTRACTORS, seed=3)
    by_group: dict[int, set] = {}
    for ex in exs:
        by_group.setdefault(ex.group, set()).add(ex.answer)
    assert len(by_group) == 40
    assert all(len(v) == 1 for v in by_group.values())
    # fresh distractors: renderings at the same count of two groups differ
    at64 = [ex.text for ex in exs if ex.n_distractors == 64]
    assert len(set(at64)) == len(at64)


@pytest.mark.parametrize("task", ["delayed_memory", "done_tracking"])
def test_binary_labels_are_balanced(task):
    exs = tasks.get_task(task).generate(101, (1,), seed=0)
    ones = sum(ex.answer[0] in ("ONE", "DONE") for ex in exs)
    assert ones in (50, 51)


def test_done_tracking_label_not_given_by_need_or_steps_alone():
    exs = tasks.get_task("done_tracking").generate(4000, (0,), seed=1)
    by_need: dict[str, list[int]] = {}
    by_steps: dict[int, list[int]] = {}
    for ex in exs:
        done = int(ex.answer[0] == "DONE")
        by_need.setdefault(ex.prompt[2], []).append(done)
        by_steps.setdefault(ex.prompt.count("STEP"), []).append(done)
    for need, ys in by_need.items():  # each announced count is balanced
        assert 0.4 < np.mean(ys) < 0.6, need
    mixed = [s for s, ys in by_steps.items() if 0.2 < np.mean(ys) < 0.8]
    assert len(mixed) >= 2  # the step count alone does not decide the label


def test_multi_register_values_balanced_and_overwrites_span_range():
    exs = tasks.get_task("multi_register").generate(2000, (0,), seed=2)
    vals = np.array([[int(v[1:]) for v in ex.answer] for ex in exs])
    for r in range(4):
        freq = np.bincount(vals[:, r], minlength=4) / len(vals)
        assert np.all(np.abs(freq - 0.25) < 0.04)
    ow = np.array([ex.overwrites for ex in exs])
    assert set(np.unique(ow)) == {0, 1, 2, 3}


def _strip_or_shuffle(words: list[str], rng: np.random.Generator, mode: str) -> list[str]:
    colon = words.index(":")
    prompt, rest = words[:colon], words[colon:]
    idx = [i for i, w in enumerate(prompt) if w in vocab.DISTRACTORS]
    if mode == "delete":
        keep = set(rng.choice(idx, size=len(idx) // 2, replace=False).tolist()) if idx else set()
        prompt = [w for i, w in enumerate(prompt) if i not in idx or i in keep]
    else:  # reshuffle the distractor words among their own slots
        vals = [prompt[i] for i in idx]
        rng.shuffle(vals)
        for i, v in zip(idx, vals, strict=True):
            prompt[i] = v
    return prompt + rest


@settings(max_examples=60, deadline=None)
@given(
    task=st.sampled_from(tasks.TASK_NAMES),
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(0, 256),
    mode=st.sampled_from(["delete", "shuffle"]),
)
def test_distractors_never_change_the_label(task, seed, n, mode):
    ex = tasks.get_task(task).generate(1, (n,), seed=seed)[0]
    words = _strip_or_shuffle(list(ex.tokens), np.random.default_rng(seed), mode)
    assert interpret(" ".join(words)) == ex.answer


@settings(max_examples=60, deadline=None)
@given(
    task=st.sampled_from(tasks.TASK_NAMES), seed=st.integers(0, 2**31 - 1), n=st.integers(0, 256)
)
def test_colon_unique_and_after_all_label_information(task, seed, n):
    ex = tasks.get_task(task).generate(1, (n,), seed=seed)[0]
    words = list(ex.tokens)
    assert words.count(":") == 1
    colon = words.index(":")
    assert colon == ex.colon_index
    info = {"SET", "NEED", "STEP"} | set(vocab.COUNTS)
    assert all(w not in info for w in words[colon + 1 :])
    if task == "multi_register":  # after the colon: each register's name, then its value
        after = words[colon + 1 :]
        assert (
            after[0::2] == list(vocab.REGISTERS[: len(ex.answer)])
            and tuple(after[1::2]) == ex.answer
        )
    else:
        assert tuple(words[colon + 1 :]) == ex.answer
    # the answer equals the oracle of the prompt alone
    assert interpret(" ".join(words[: colon + 1])) == ex.answer


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    counts=st.lists(st.integers(0, 256), min_size=1, max_size=5, unique=True),
)
def test_groups_same_label_whatever_counts_are_requested(seed, counts):
    for task in tasks.TASK_NAMES:
        a = tasks.get_task(task).generate(6, tuple(counts), seed=seed)
        b = tasks.get_task(task).generate(6, (counts[0],), seed=seed)
        la = {ex.group: ex.answer for ex in a}
        assert la == {ex.group: ex.answer for ex in b}
        # a rendering depends only on (seed, group, count), not on the other counts
        assert [ex.text for ex in a if ex.n_distractors == counts[0]] == [ex.text for ex in b]


def test_vocab_roundtrip_and_errors():
    text = "<bos> SET ONE the cat : ONE"
    assert vocab.decode(vocab.encode(text)) == text
    with pytest.raises(ValueError, match="unknown token"):
        vocab.encode("SET banana")
    with pytest.raises(ValueError, match="out of range"):
        vocab.decode([vocab.VOCAB_SIZE])


def test_bad_counts_rejected():
    for bad in [(-1,), (257,), ()]:
        with pytest.raises(ValueError):
            tasks.get_task("delayed_memory").generate(2, bad, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.get_task("nope")


def test_done_tracking_need_weights():
    from tasks import done_tracking as dt

    rng = np.random.default_rng(0)
    plain = [dt.draw_base(rng, 1, dt.Params()) for _ in range(200)]
    # uniform k draws exactly as before the option existed (the probe datasets stay the same)
    rng = np.random.default_rng(0)
    assert plain == [dt.draw_base(rng, 1, dt.Params(need_weights=None)) for _ in range(200)]
    p = dt.Params(need_weights=[0, 1, 0, 3])
    assert p.to_dict() == {"max_need": 4, "need_weights": [0.0, 1.0, 0.0, 3.0]}
    assert dt.Params().to_dict() == {"max_need": 4}
    rng = np.random.default_rng(1)
    draws = [dt.draw_base(rng, d % 2, p) for d in range(4000)]
    ks = np.bincount([k for k, _ in draws], minlength=5)
    assert ks[1] == ks[3] == 0 and 0.70 < ks[4] / len(draws) < 0.80
    # the label is still s >= k at the boundary
    assert all((s >= k) == bool(d % 2) for d, (k, s) in enumerate(draws))
    for bad in ([1, 1], [1, -1, 1, 1], [0, 0, 0, 0]):
        with pytest.raises(ValueError, match="need_weights needs 4 non-negative weights"):
            dt.Params(need_weights=bad)

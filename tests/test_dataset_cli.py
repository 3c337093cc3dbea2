"""``fbt-probe generate``: files, schema, determinism, bad input; the training stream."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tasks
from cli import app
from tasks import vocab
from tasks.base import STREAM_PROBE
from tasks.dataset import SCHEMA, load, parse_distractors, sequence_hash
from tasks.sampler import Curriculum, TrainingStream
from tests.oracle import interpret

runner = CliRunner()


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generate_is_byte_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["generate", "--task", "delayed_memory"])
    assert r.exit_code == 0, r.output
    first = sha(tmp_path / "data/delayed_memory.parquet")
    r = runner.invoke(app, ["generate", "--task", "delayed_memory", "--force"])
    assert r.exit_code == 0
    assert sha(tmp_path / "data/delayed_memory.parquet") == first
    r = runner.invoke(
        app, ["generate", "--task", "delayed_memory", "--out", "b.parquet", "--seed", "5"]
    )
    assert sha(tmp_path / "b.parquet") != first


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_file_loads_with_documented_schema(tmp_path, task):
    out = tmp_path / f"{task}.parquet"
    r = runner.invoke(
        app,
        ["generate", "-t", task, "--n-groups", "30", "--distractors", "0,1,16,256", "-o", str(out)],
    )
    assert r.exit_code == 0, r.output
    assert pq.read_schema(out).remove_metadata().equals(SCHEMA)
    ds = load(out)
    assert ds.meta["task"] == task and ds.meta["seed"] == 1234
    assert ds.meta["distractors"] == [0, 1, 16, 256] and ds.meta["n_groups"] == 30
    assert ds.meta["vocab_version"] == vocab.VOCAB_VERSION
    assert len(ds) == 120 and sorted(set(ds.group.tolist())) == list(range(30))
    for i in range(len(ds)):
        ids = ds.token_ids[i]
        assert vocab.decode(ids) == ds.text[i]
        assert ids[ds.colon_index[i]] == vocab.COLON_ID
        assert tuple(ds.labels[i]) == interpret(ds.text[i])
    assert set(ds.n_distractors.tolist()) == {0, 1, 16, 256}


@pytest.mark.parametrize(
    "args, msg",
    [
        (["-t", "nope"], "unknown task"),
        (["-t", "delayed_memory", "--distractors", "-1,4"], "outside"),
        (["-t", "delayed_memory", "--distractors", "0,257"], "outside"),
        (["-t", "delayed_memory", "--distractors", "a-b"], "cannot parse"),
        (["-t", "delayed_memory", "--n-groups", "0"], "at least 1"),
        (["-t", "delayed_memory", "-o", "/proc/nope/x.parquet"], "cannot write"),
    ],
)
def test_bad_input_one_line_no_file(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["generate", *args])
    assert r.exit_code != 0
    err = r.stderr.strip()
    assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1
    assert "Traceback" not in r.output
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "x.parquet"
    out.write_bytes(b"keep me")
    r = runner.invoke(app, ["generate", "-t", "done_tracking", "-o", str(out)])
    assert r.exit_code == 1 and "--force" in r.stderr
    assert out.read_bytes() == b"keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["x.parquet"]  # no temp file left


def test_load_rejects_foreign_files(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match="not a parquet"):
        load(bad)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.parquet")


def test_parse_distractors():
    assert parse_distractors("0,4,1") == (0, 1, 4)
    assert parse_distractors("2-5") == (2, 3, 4, 5)
    assert parse_distractors("default")[-1] == 256
    with pytest.raises(ValueError):
        parse_distractors("5-2")


def test_training_stream_is_seeded_and_disjoint_from_probe_data():
    mix = {"delayed_memory": 1.0, "done_tracking": 1.0, "multi_register": 1.0}
    s = TrainingStream(mix, seed=1234)
    a = [ex.text for ex in s.batch(3, 32, 0.5)]
    assert a == [ex.text for ex in TrainingStream(mix, seed=1234).batch(3, 32, 0.5)]
    assert a != [ex.text for ex in TrainingStream(mix, seed=1235).batch(3, 32, 0.5)]
    train = [ex for i in range(40) for ex in s.batch(i, 64, 1.0)]
    assert {ex.task for ex in train} == set(mix)
    for ex in train:
        assert interpret(ex.text) == ex.answer
    # Content hashes: with the same seed, no training sequence of >= 4 distractors
    # (below that, the space of sequences is tiny and collisions are by chance) is in
    # a probe dataset, because the two use different seed streams.
    train_h = {sequence_hash(vocab.encode(ex.tokens)) for ex in train if ex.n_distractors >= 4}
    for task in tasks.TASK_NAMES:
        probe = tasks.get_task(task).generate(200, (4, 8, 16, 64, 256), 1234, stream=STREAM_PROBE)
        probe_h = {sequence_hash(vocab.encode(ex.tokens)) for ex in probe}
        assert not (train_h & probe_h)
    # the check can fail: a probe sequence slipped into training is caught
    leaked = train_h | {next(iter(probe_h))}
    assert leaked & probe_h


def test_curriculum_ramps():
    c = Curriculum(start=8, end=256, ramp_frac=0.5)
    assert (
        c.n_max(0.0) == 8 and c.n_max(0.25) == 132 and c.n_max(0.5) == 256 and c.n_max(1.0) == 256
    )
    s = TrainingStream({"delayed_memory": 1.0}, seed=0, curriculum=c)
    assert max(ex.n_distractors for ex in s.batch(0, 200, 0.0)) <= 8
    batches = [np.array([ex.n_distractors for ex in s.batch(i, 50, 1.0)]) for i in range(60)]
    assert all(b.max() - b.min() <= 16 for b in batches)  # one count window per batch
    allns = np.concatenate(batches)
    assert allns.max() > 200 and allns.min() < 20  # over batches, counts span [0, n_max]
    mixed = TrainingStream(
        {"delayed_memory": 1.0}, seed=0, curriculum=Curriculum(8, 256, 0.3, "mixed")
    )
    mix = np.concatenate([[ex.n_distractors for ex in mixed.batch(i, 20, 1.0)] for i in range(200)])
    assert (
        np.mean(mix) < np.mean(allns) and mix.max() > 200
    )  # more short sequences, long ones remain
    # a larger log-uniform share: shorter still, on the same batches where both draw uniformly
    more = TrainingStream(
        {"delayed_memory": 1.0}, seed=0, curriculum=Curriculum(8, 256, 0.3, "mixed", 0.9)
    )
    short = np.concatenate(
        [[ex.n_distractors for ex in more.batch(i, 20, 1.0)] for i in range(200)]
    )
    assert np.mean(short) < 0.8 * np.mean(mix) and short.max() > 128
    with pytest.raises(ValueError, match="log_share"):
        Curriculum(dist="mixed", log_share=1.5)
    # a hold: n_max stays at start for the first fraction of training, then the same ramp
    held = Curriculum(start=8, end=256, ramp_frac=0.5, hold_frac=0.2)
    assert [held.n_max(p) for p in (0.0, 0.2, 0.45, 0.7, 1.0)] == [8, 8, 132, 256, 256]
    hs = TrainingStream({"delayed_memory": 1.0}, seed=0, curriculum=held)
    assert max(ex.n_distractors for i in range(20) for ex in hs.batch(i, 20, 0.19)) <= 8
    with pytest.raises(ValueError, match="hold_frac"):
        Curriculum(hold_frac=-0.1)


def test_overwrite_curriculum():
    c = Curriculum(overwrite_ramp=(0.3, 0.9))
    s = TrainingStream({"multi_register": 1.0}, seed=0, curriculum=c)
    # the cap: 0 before the ramp, then 1, 2, 3 over thirds of it, the task's 3 at its end
    assert [c.max_overwrites(p, 3) for p in (0.0, 0.29, 0.3, 0.45, 0.6, 0.8, 0.9, 1.0)] == [
        0, 0, 1, 1, 2, 3, 3, 3,
    ]  # fmt: skip

    def overwrites(progress):
        return np.array([ex.overwrites for i in range(10) for ex in s.batch(i, 20, progress)])

    assert overwrites(0.1).max() == 0
    assert overwrites(0.35).max() == 1
    assert overwrites(1.0).max() == 3
    off = TrainingStream({"multi_register": 1.0}, seed=0)
    assert np.array([ex.overwrites for ex in off.batch(0, 50, 0.0)]).max() == 3
    with pytest.raises(ValueError, match="overwrite_ramp"):
        Curriculum(overwrite_ramp=(0.8, 0.2))


def test_mixture_schedule():
    mix = {"delayed_memory": 1.0, "done_tracking": 3.0, "multi_register": 1.0}
    s = TrainingStream(mix, seed=0, mixture_start={"multi_register": 1.0}, mixture_ramp_frac=0.4)
    np.testing.assert_allclose(s.probs_at(0.0), [0, 0, 1])
    np.testing.assert_allclose(
        s.probs_at(0.2), 0.5 * np.array([0, 0, 1]) + 0.5 * np.array([0.2, 0.6, 0.2])
    )
    np.testing.assert_allclose(s.probs_at(0.4), [0.2, 0.6, 0.2])
    # at the start every example is multi_register; mid-ramp the shares are in between
    assert {ex.task for i in range(5) for ex in s.batch(i, 32, 0.0)} == {"multi_register"}
    mid = [ex.task for i in range(40) for ex in s.batch(i, 32, 0.2)]
    assert 0.5 < mid.count("multi_register") / len(mid) < 0.7
    # once the ramp is over the stream is the plain mixture's, example for example
    plain = TrainingStream(mix, seed=0)
    for p in (0.4, 0.9):
        assert [e.text for e in s.batch(7, 32, p)] == [e.text for e in plain.batch(7, 32, p)]
    with pytest.raises(ValueError, match="not in the mixture: done_tracking"):
        TrainingStream({"delayed_memory": 1.0}, mixture_start={"done_tracking": 1.0})
    with pytest.raises(ValueError, match="mixture_start weights sum to zero"):
        TrainingStream(mix, mixture_start={"multi_register": 0.0})
    with pytest.raises(ValueError, match="mixture_ramp_frac"):
        TrainingStream(mix, mixture_start={"multi_register": 1.0}, mixture_ramp_frac=1.5)


def test_late_mixture():
    mix = {"delayed_memory": 1.0, "done_tracking": 3.0, "multi_register": 1.0}
    late = {"delayed_memory": 1.0, "done_tracking": 8.0, "multi_register": 1.0}
    s = TrainingStream(
        mix,
        seed=0,
        mixture_start={"multi_register": 1.0},
        mixture_ramp_frac=0.2,
        mixture_late=late,
        mixture_late_ramp=(0.5, 0.7),
    )
    main, end = np.array([0.2, 0.6, 0.2]), np.array([0.1, 0.8, 0.1])
    np.testing.assert_allclose(s.probs_at(0.0), [0, 0, 1])  # the start is unchanged
    np.testing.assert_allclose(s.probs_at(0.3), main)
    np.testing.assert_allclose(s.probs_at(0.5), main)
    np.testing.assert_allclose(s.probs_at(0.6), 0.5 * main + 0.5 * end)
    np.testing.assert_allclose(s.probs_at(0.7), end)
    np.testing.assert_allclose(s.probs_at(1.0), end)
    at_end = [ex.task for i in range(40) for ex in s.batch(i, 32, 0.9)]
    assert 0.75 < at_end.count("done_tracking") / len(at_end) < 0.85
    # before the late ramp the stream is the plain mixture's, example for example
    plain = TrainingStream(mix, seed=0)
    assert [e.text for e in s.batch(3, 32, 0.4)] == [e.text for e in plain.batch(3, 32, 0.4)]
    # a step: the late weights from the ramp's start on
    step = TrainingStream(mix, seed=0, mixture_late=late, mixture_late_ramp=(0.5, 0.5))
    np.testing.assert_allclose(step.probs_at(0.49), main)
    np.testing.assert_allclose(step.probs_at(0.5), end)
    with pytest.raises(ValueError, match="mixture_late names tasks not in the mixture"):
        TrainingStream({"delayed_memory": 1.0}, mixture_late={"done_tracking": 1.0})
    with pytest.raises(ValueError, match="mixture_late_ramp needs"):
        TrainingStream(mix, mixture_late=late, mixture_late_ramp=(0.7, 0.5))
    with pytest.raises(ValueError, match="before the first phase and the start ramp"):
        TrainingStream(
            mix,
            mixture_start={"multi_register": 1.0},
            mixture_ramp_frac=0.6,
            mixture_late=late,
            mixture_late_ramp=(0.5, 0.7),
        )


def test_first_phase():
    mix = {"delayed_memory": 1.0, "done_tracking": 3.0, "multi_register": 1.0}
    s = TrainingStream(
        mix,
        seed=0,
        mixture_first={"done_tracking": 1.0},
        mixture_first_frac=0.1,
        mixture_start={"multi_register": 1.0},
        mixture_ramp_frac=0.2,
        mixture_late={"done_tracking": 1.0},
        mixture_late_ramp=(0.4, 0.5),
    )
    main = np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(s.probs_at(0.0), [0, 1, 0])  # the first phase, alone
    np.testing.assert_allclose(s.probs_at(0.099), [0, 1, 0])
    np.testing.assert_allclose(s.probs_at(0.1), [0, 0, 1])  # the start ramp begins after it
    np.testing.assert_allclose(s.probs_at(0.2), 0.5 * np.array([0, 0, 1]) + 0.5 * main)
    np.testing.assert_allclose(s.probs_at(0.3), main)
    np.testing.assert_allclose(s.probs_at(0.5), [0, 1, 0])
    first = [ex.task for i in range(10) for ex in s.batch(i, 32, 0.05)]
    assert set(first) == {"done_tracking"}
    # once the ramp has reached the mixture the stream is the plain mixture's
    plain = TrainingStream(mix, seed=0)
    assert [e.text for e in s.batch(3, 32, 0.35)] == [e.text for e in plain.batch(3, 32, 0.35)]
    with pytest.raises(ValueError, match="mixture_first and mixture_first_frac > 0 go together"):
        TrainingStream(mix, mixture_first={"done_tracking": 1.0})
    with pytest.raises(ValueError, match="mixture_first and mixture_first_frac > 0 go together"):
        TrainingStream(mix, mixture_first_frac=0.2)
    with pytest.raises(ValueError, match="mixture_first names tasks not in the mixture"):
        TrainingStream({"delayed_memory": 1.0}, mixture_first={"nope": 1.0}, mixture_first_frac=0.1)
    with pytest.raises(ValueError, match=r"start ramp have reached the mixture \(0.3\)"):
        TrainingStream(
            mix,
            mixture_first={"done_tracking": 1.0},
            mixture_first_frac=0.1,
            mixture_start={"multi_register": 1.0},
            mixture_ramp_frac=0.2,
            mixture_late={"done_tracking": 1.0},
            mixture_late_ramp=(0.25, 0.5),
        )


def test_mixture_hold():
    mix = {"delayed_memory": 1.0, "done_tracking": 3.0, "multi_register": 1.0}
    s = TrainingStream(
        mix,
        mixture_first={"done_tracking": 1.0},
        mixture_first_frac=0.1,
        mixture_start={"multi_register": 1.0},
        mixture_hold_frac=0.2,
        mixture_ramp_frac=0.2,
    )
    main = np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(s.probs_at(0.05), [0, 1, 0])
    np.testing.assert_allclose(s.probs_at(0.1), [0, 0, 1])  # the start weights hold ...
    np.testing.assert_allclose(s.probs_at(0.29), [0, 0, 1])
    np.testing.assert_allclose(
        s.probs_at(0.4), 0.5 * np.array([0, 0, 1]) + 0.5 * main
    )  # ... then ramp
    np.testing.assert_allclose(s.probs_at(0.5), main)
    # a hold with no ramp switches at its end
    s = TrainingStream(mix, mixture_start={"multi_register": 1.0}, mixture_hold_frac=0.3)
    np.testing.assert_allclose(s.probs_at(0.29), [0, 0, 1])
    np.testing.assert_allclose(s.probs_at(0.3), main)
    with pytest.raises(ValueError, match="mixture_hold_frac > 0 needs mixture_start"):
        TrainingStream(mix, mixture_hold_frac=0.3)
    with pytest.raises(ValueError, match="mixture_hold_frac must be in"):
        TrainingStream(mix, mixture_start={"multi_register": 1.0}, mixture_hold_frac=2)

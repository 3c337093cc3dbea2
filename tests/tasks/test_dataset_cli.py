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
from tasks.sampler import TrainingStream
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
        (["-t", "delayed_memory", "--distractors", "a-b"], "--distractors 'a-b': use a list"),
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
    names = ["delayed_memory", "done_tracking", "multi_register"]
    eq = np.full(3, 1 / 3)
    s = TrainingStream(names, seed=1234)
    a = [ex.text for ex in s.batch(3, 32, eq, 128)]
    assert a == [ex.text for ex in TrainingStream(names, seed=1234).batch(3, 32, eq, 128)]
    assert a != [ex.text for ex in TrainingStream(names, seed=1235).batch(3, 32, eq, 128)]
    train = [ex for i in range(40) for ex in s.batch(i, 64, eq, 256)]
    assert {ex.task for ex in train} == set(names)
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


def test_stream_counts_shares_and_overwrite_cap():
    one = [1.0]
    s = TrainingStream(["delayed_memory"], seed=0)
    assert max(ex.n_distractors for ex in s.batch(0, 200, one, 8)) <= 8
    batches = [np.array([ex.n_distractors for ex in s.batch(i, 50, one, 256)]) for i in range(60)]
    assert all(b.max() - b.min() <= 16 for b in batches)  # one count window per batch
    allns = np.concatenate(batches)
    assert allns.max() > 200 and allns.min() < 20  # over batches, counts span [0, n_max]
    mixed = TrainingStream(["delayed_memory"], seed=0, dist="mixed")
    mix = np.concatenate(
        [[ex.n_distractors for ex in mixed.batch(i, 20, one, 256)] for i in range(200)]
    )
    assert np.mean(mix) < np.mean(allns) and mix.max() > 200  # more short ones, long ones remain
    # a larger log-uniform share: shorter still
    more = TrainingStream(["delayed_memory"], seed=0, dist="mixed", log_share=0.9)
    short = np.concatenate(
        [[ex.n_distractors for ex in more.batch(i, 20, one, 256)] for i in range(200)]
    )
    assert np.mean(short) < 0.8 * np.mean(mix) and short.max() > 128
    with pytest.raises(ValueError, match="log_share"):
        TrainingStream(["delayed_memory"], dist="mixed", log_share=1.5)
    with pytest.raises(ValueError, match="count distribution"):
        TrainingStream(["delayed_memory"], dist="normal")
    # the shares pick the tasks, in the stream's task order
    two = TrainingStream(["delayed_memory", "done_tracking"], seed=0)
    picked = {ex.task for i in range(5) for ex in two.batch(i, 20, [0.0, 1.0], 16)}
    assert picked == {"done_tracking"}
    got = [ex.task for i in range(40) for ex in two.batch(i, 20, [0.25, 0.75], 16)]
    assert 0.7 < got.count("done_tracking") / len(got) < 0.8
    # multi_register's overwrites: capped by the schedule, never above the task's own limit
    mr = TrainingStream(
        ["multi_register"], seed=0, params={"multi_register": {"max_overwrites": 2}}
    )

    def overwrites(cap):
        return np.array([ex.overwrites for i in range(10) for ex in mr.batch(i, 20, one, 16, cap)])

    assert overwrites(0).max() == 0 and overwrites(1).max() == 1
    assert overwrites(None).max() == 2 and overwrites(3).max() == 2
    with pytest.raises(ValueError, match="task_params names tasks not trained on"):
        TrainingStream(["delayed_memory"], params={"multi_register": {}})
    with pytest.raises(ValueError, match="task_params.multi_register"):
        TrainingStream(["multi_register"], params={"multi_register": {"colour": 1}})

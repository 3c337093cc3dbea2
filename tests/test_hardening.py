"""Bad input through the command line: one line on stderr naming the culprit, a non-zero
exit, no traceback, nothing new in the output folder."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from fbt_probe.checkpoint import save_model
from fbt_probe.config import build_cfg
from fbt_probe.model import FBTModel
from tasks.generate import generate_dataset


def one_line_error(r, *needles):
    err = r.stderr.strip()
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output and len(err.splitlines()) == 1, r.output
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, err


def files_under(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture
def model_dir(tmp_path):
    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), tmp_path / "m")
    return tmp_path / "m"


def edit_json(path, fn):
    d = json.loads(path.read_text())
    path.write_text(json.dumps(fn(d)))


EVAL = ["eval", "--json", "--n-groups", "5", "--task", "delayed_memory", "--model"]


@pytest.mark.parametrize(
    "field,value",
    [("n_heads", 8), ("positional", "none"), ("depth_scaling", False), ("jitter", 0.3)],
)
def test_an_edited_model_config_is_refused(model_dir, field, value):
    # n_heads 4 -> 8 or positional -> none change no tensor shape: only the config's hash
    # in meta.json shows the edit
    edit_json(model_dir / "config.json", lambda d: {**d, field: value})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "changed after the model was saved")


def test_a_mistyped_model_config_names_the_field(model_dir):
    # a folder written before configs were hashed: the type check still names the field
    edit_json(
        model_dir / "meta.json", lambda d: {k: v for k, v in d.items() if k != "config_sha256"}
    )
    edit_json(model_dir / "config.json", lambda d: {**d, "depth_scaling": "false"})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "depth_scaling must be true or false, got 'false'")


@pytest.mark.parametrize(
    "text,msg", [("[1, 2]", "must hold a JSON object"), ("{oops", "is not valid JSON")]
)
def test_a_broken_meta_json_is_refused(model_dir, text, msg):
    (model_dir / "meta.json").write_text(text)
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "meta.json", msg)


def test_small_option_checks(tmp_path, model_dir):
    out = tmp_path / "out"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--distractors",
            "",
            "--out",
            str(out / "d.parquet"),
        ],
    )
    one_line_error(r, "--distractors is empty")
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--passes", "5000", "--out", str(out)]
    )
    one_line_error(r, "--passes must be in 1..1000")
    assert files_under(out) == []


def test_a_prefill_named_twice_is_fitted_once(tmp_path, model_dir):
    data = generate_dataset(
        "delayed_memory", tmp_path / "d.parquet", n_groups=10, distractors=(1, 4), seed=2
    )
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "--out",
            str(out),
            "-p",
            "standard,standard",
            "--no-controls",
        ],
    )
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "probe_results.json").read_text())
    assert meta["prefills"] == ["standard"]


# ---- output paths: never replace what is not a regular file; check before the work -------
@pytest.fixture
def odd_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target.parquet"
    target.write_text("keep me")
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    folder = tmp_path / "folder"
    folder.mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("a file")
    return {"fifo": fifo, "link": link, "folder": folder, "plain": plain, "target": target}


@pytest.mark.parametrize(
    "which,kind", [("fifo", "a FIFO"), ("link", "a symlink"), ("folder", "a directory")]
)
def test_generate_force_never_replaces_what_is_not_a_regular_file(odd_paths, which, kind):
    path = odd_paths[which]
    r = CliRunner().invoke(
        app,
        ["generate", "--task", "delayed_memory", "--out", str(path), "--force", "--n-groups", "4"],
    )
    one_line_error(r, str(path), kind, "refusing to replace it")
    assert odd_paths["target"].read_text() == "keep me"  # the symlink's target is untouched
    assert os.path.islink(odd_paths["link"]) and stat.S_ISFIFO(os.lstat(odd_paths["fifo"]).st_mode)


@pytest.mark.parametrize(
    "cmd",
    [
        ["fit", "--task", "delayed_memory"],
        ["stability", "--passes", "2", "--decode-tokens", "0"],
        ["plot", "--results", "{plain}"],
        ["train", "-c", "tiny"],
    ],
)
@pytest.mark.parametrize("which", ["plain", "fifo"])
def test_an_out_folder_that_is_a_file_fails_before_the_work(odd_paths, cmd, which):
    cmd = [c.format(plain=odd_paths["plain"]) for c in cmd]
    before = files_under(odd_paths["folder"].parent)
    r = CliRunner().invoke(app, [*cmd, "--out", str(odd_paths[which])])
    one_line_error(r, str(odd_paths[which]), "not a folder")
    assert files_under(odd_paths["folder"].parent) == before


def test_sigterm_removes_the_partial_file(tmp_path):
    # generate killed while it writes: no hidden temp file stays behind
    import subprocess
    import sys
    import time

    out = tmp_path / "big.parquet"
    cmd = [sys.executable, "-c", "import cli; cli.main()", "generate", "--task", "multi_register",
           "--n-groups", "6000", "--out", str(out)]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=Path(__file__).parents[1], stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not any(tmp_path.iterdir()) and p.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.005)  # until the temporary file appears
    assert p.poll() is None, "the run ended before it started writing"
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "error: aborted"
    assert list(tmp_path.iterdir()) == []


# ---- datasets, caches, results tables, checkpoints, verdicts --------------------------------
def _dataset(tmp_path):
    return generate_dataset(
        "delayed_memory", tmp_path / "d.parquet", n_groups=6, distractors=(1, 4), seed=2
    )


def _rewrite(path, fn):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    pq.write_table(fn(t), path)


@pytest.mark.parametrize("what", ["zero rows", "colon outside", "metadata shape"])
def test_a_broken_dataset_is_refused_with_its_name(tmp_path, model_dir, what):
    import pyarrow as pa

    from tasks.dataset import META_KEY

    data = _dataset(tmp_path)
    if what == "zero rows":
        _rewrite(data, lambda t: t.slice(0, 0))
        msg = "holds no examples"
    elif what == "colon outside":

        def shift(t):
            col = pa.array([999] * t.num_rows, pa.int32())
            return t.set_column(t.schema.get_field_index("colon_index"), "colon_index", col)

        _rewrite(data, shift)
        msg = "has no colon at its colon_index"
    else:

        def meta(t):
            m = json.loads(
                t.schema.metadata[META_KEY.encode() if isinstance(META_KEY, str) else META_KEY]
            )
            m["task"] = ["delayed_memory"]
            return t.replace_schema_metadata({META_KEY: json.dumps(m).encode()})

        _rewrite(data, meta)
        msg = "no task name"
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--data", str(data), "--out", str(out)]
    )
    one_line_error(r, str(data), msg)
    assert files_under(out) == []


def test_a_cache_entry_of_the_wrong_shape_is_recomputed(tmp_path, model_dir):
    import numpy as np

    from fbt_probe.checkpoint import load_model
    from probes.extract import extract_cached
    from tasks.dataset import load

    ds, m = load(_dataset(tmp_path)), load_model(model_dir)
    f, _ = extract_cached(m, ds, "standard", tmp_path / "c")
    (entry,) = (tmp_path / "c").glob("*.npy")
    np.save(entry, np.zeros((3, 2), dtype=np.float32))
    again, hit = extract_cached(m, ds, "standard", tmp_path / "c")
    assert not hit and np.array_equal(again, f)


@pytest.mark.parametrize(
    "content,msg",
    [
        ("task,target,model\n", "lacks columns"),
        (None, "has a header but no rows"),
        ("\x00\x01\x02binary\xff", "not a probe results table"),
        ("bad", "holds values that are not numbers"),
    ],
)
def test_plot_refuses_a_broken_results_table(tmp_path, content, msg):
    res = tmp_path / "res"
    res.mkdir()
    head = "task,target,model,prefill,depth,distractors,overwrites,accuracy,chance\n"
    if content is None:
        content = head
    elif content == "bad":
        content = head + "delayed_memory,label,trained,standard,0,1-256,all,high,0.5\n"
    (res / "probe_results.csv").write_bytes(content.encode("latin-1"))
    r = CliRunner().invoke(app, ["plot", "--results", str(res)])
    one_line_error(r, "probe_results.csv", msg)
    assert not (res / "figures").exists() or files_under(res / "figures") == []


def test_resume_from_a_truncated_checkpoint_or_config(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--set", "steps=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    state = out / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    r = CliRunner().invoke(app, ["train", "--out", str(out), "--resume"])
    one_line_error(r, "state.pt", "cannot be read", "truncated")
    (out / "train_config.json").write_text("{oops")
    r = CliRunner().invoke(
        app, ["train", "--config", "tiny", "--set", "steps=2", "--out", str(out), "--resume"]
    )
    one_line_error(r, "train_config.json", "not valid JSON")


def test_stability_with_too_few_passes_is_inconclusive():
    from fbt_probe.stability import verdict

    rows = [{"delta_mean": float("nan")}, {"delta_mean": 0.2}, {"delta_mean": 0.3}]
    assert verdict(rows) == "inconclusive"
    assert verdict(rows[:1]) == "inconclusive"
    assert verdict([*rows, {"delta_mean": float("inf")}]) == "diverging"


def test_seeds_and_a_huge_dataset_are_refused_before_the_work(tmp_path, model_dir):
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app, ["generate", "--task", "delayed_memory", "--seed", "-1", "--out", str(out)]
    )
    one_line_error(r, "--seed must be >= 0")
    r = CliRunner().invoke(
        app, ["generate", "--task", "multi_register", "--n-groups", "100000000", "--out", str(out)]
    )
    one_line_error(r, "--n-groups 100000000 would need about", "GiB")
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--seed", "-2", "--out", str(tmp_path / "r")]
    )
    one_line_error(r, "--seed must be >= 0")
    assert files_under(tmp_path) == [
        Path("m"),
        *sorted(Path("m") / p.name for p in model_dir.iterdir()),
    ]


def test_a_failed_figure_write_leaves_nothing(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from probes.plot import save_figure

    fig = plt.figure()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fig, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_figure(fig, tmp_path / "figs", "x")
    assert files_under(tmp_path / "figs") == []

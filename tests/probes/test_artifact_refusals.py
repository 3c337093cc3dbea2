"""Artifacts read back and refused by name: a damaged dataset, cache entry or results table,
and a figure whose write fails."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli import app
from tests.refusals import files_under, one_line_error, small_dataset


def _rewrite(path, fn):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    pq.write_table(fn(t), path)


@pytest.mark.parametrize(
    "what", ["zero rows", "colon outside", "metadata shape", "metadata JSON", "metadata list"]
)
def test_a_broken_dataset_is_refused_with_its_name(tmp_path, model_dir, what):
    import pyarrow as pa

    from tasks.dataset import META_KEY

    data = small_dataset(tmp_path)
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

        if what == "metadata shape":
            _rewrite(data, meta)
            msg = "no task name"
        else:
            text = b"{oops" if what == "metadata JSON" else b"[1, 2]"
            _rewrite(data, lambda t: t.replace_schema_metadata({META_KEY: text}))
            msg = "not valid JSON" if what == "metadata JSON" else "must be a JSON object"
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--data", str(data), "--out", str(out)]
    )
    one_line_error(r, str(data), msg)
    assert files_under(out) == []


def test_a_cache_entry_of_the_wrong_shape_is_recomputed(tmp_path, model_dir):
    import numpy as np

    from fbt_probe.checkpoint import load_model
    from probes.common.extract import extract_cached
    from tasks.dataset import load

    ds, m = load(small_dataset(tmp_path)), load_model(model_dir)
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


def test_stability_with_too_few_passes_is_inconclusive():
    from fbt_probe.kernels.stability import verdict

    rows = [{"delta_mean": float("nan")}, {"delta_mean": 0.2}, {"delta_mean": 0.3}]
    assert verdict(rows) == "inconclusive"
    assert verdict(rows[:1]) == "inconclusive"
    assert verdict([*rows, {"delta_mean": float("inf")}]) == "diverging"


def test_a_failed_figure_write_leaves_nothing(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from probes.fit.plot import save_figure

    fig = plt.figure()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fig, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_figure(fig, tmp_path / "figs", "x")
    assert files_under(tmp_path / "figs") == []

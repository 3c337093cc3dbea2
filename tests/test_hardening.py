"""Bad input through the command line: one line on stderr naming the culprit, a non-zero
exit, no traceback, nothing new in the output folder."""

from __future__ import annotations

import json

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

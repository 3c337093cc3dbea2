"""A new task is one module that registers itself: this file writes one (with tokens of its
own) and runs generate -> fit -> plot on it with a tiny model, touching no other file."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

import tasks
from cli import app
from fbt_probe.checkpoint import load_model, save_model
from fbt_probe.config import build_cfg
from fbt_probe.stack import FBTModel
from probes.common.probe_results import load_results
from tasks import vocab
from tasks.base import (
    STREAM_PROBE,
    Example,
    balanced_bits,
    distractor_words,
    generate_groups,
    rng_for,
)
from tasks.dataset import load
from tasks.generate import generate_dataset


def make_toy_task():
    """``<bos> KEEP x d_1 .. d_n : x`` with x one of two words of the task's own."""
    mod = types.ModuleType("toy_keep")
    mod.NAME = "toy_keep"
    mod.TOKENS = ("KEEP", "TOY_X", "TOY_Y")
    labels = ("TOY_X", "TOY_Y")

    @dataclass(frozen=True)
    class Params:
        def to_dict(self):
            return {}

    def draw_bases(n_groups, seed, params, stream):
        return [int(b) for b in balanced_bits(rng_for(seed, mod.NAME, stream), n_groups)]

    def render(bit, n, rng, params, group=0):
        prompt = (vocab.BOS, "KEEP", labels[bit], *distractor_words(rng, n), vocab.COLON)
        return Example(mod.NAME, group, n, prompt, (labels[bit],))

    def generate(n_groups, distractors, seed, params=Params(), stream=STREAM_PROBE):
        return generate_groups(mod, n_groups, distractors, seed, params, stream)

    def sample(rng, n, params=Params()):
        return render(int(rng.integers(0, 2)), n, rng, params, group=-1)

    mod.Params, mod.draw_bases, mod.render = Params, draw_bases, render
    mod.generate, mod.sample = generate, sample
    return mod


@pytest.fixture
def toy(tmp_path):
    old = FBTModel(build_cfg(), seed=0)  # a model folder written before the task existed
    save_model(old, tmp_path / "old_model")
    builtin = generate_dataset(
        "delayed_memory", tmp_path / "dm_before.parquet", n_groups=6, distractors=(1, 4)
    )
    mod = make_toy_task()
    sys.modules[mod.NAME] = mod
    tasks.register_task(mod)
    try:
        yield mod, builtin
    finally:
        tasks.TASKS.remove(mod.NAME)
        sys.modules.pop(mod.NAME, None)


def test_a_registered_task_runs_generate_fit_and_plot(toy, tmp_path):
    mod, builtin = toy
    n0 = vocab.BASE_SIZE
    # its tokens were appended: every existing id is unchanged
    assert [vocab.TOKEN_TO_ID[t] for t in mod.TOKENS] == list(range(n0, n0 + 3))
    # existing checkpoints and datasets still load, and built-in datasets are byte-identical
    load_model(tmp_path / "old_model")
    again = generate_dataset(
        "delayed_memory", tmp_path / "dm_after.parquet", n_groups=6, distractors=(1, 4)
    )
    assert again.read_bytes() == builtin.read_bytes()
    assert "toy_keep" in tasks.task_names() and tasks.target_names("toy_keep") == ("label",)

    data = tmp_path / "toy.parquet"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "toy_keep",
            "--n-groups",
            "20",
            "--distractors",
            "0,1,8",
            "--out",
            str(data),
        ],
    )
    assert r.exit_code == 0, r.output
    ds = load(data)
    assert ds.task == "toy_keep" and len(ds) == 60
    assert ds.meta["vocab"] == list(vocab.TOKENS[: n0 + 3])
    assert {lab[0] for lab in ds.labels} == {"TOY_X", "TOY_Y"}

    model = FBTModel(build_cfg(d_vocab=vocab.VOCAB_SIZE, n_ctx=64), seed=1).eval()
    save_model(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "meta.json").read_text())["vocab"][-3:] == list(mod.TOKENS)
    res = tmp_path / "res"
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(tmp_path / "m"),
            "--data",
            str(data),
            "--out",
            str(res),
            "-p",
            "standard,recurrent",
        ],
    )
    assert r.exit_code == 0, r.output
    df = load_results(res)
    assert set(df.task) == {"toy_keep"} and set(df.target) == {"label"}
    pooled = df[(df.model == "trained") & (df.distractors == "1-256") & (df.depth == 0)]
    std = pooled[pooled.prefill == "standard"].iloc[0]
    assert std.accuracy == pytest.approx(std.chance)  # depth 0 at the colon: its embedding only
    r = CliRunner().invoke(app, ["plot", "--results", str(res)])
    assert r.exit_code == 0, r.output
    for stem in ("heatmap_toy_keep_prefill_by_depth", "lines_toy_keep"):
        assert (res / "figures" / f"{stem}.png").stat().st_size > 1000
    # draws of a new task come from a seed stream of its own
    a = [e.text for e in mod.generate(4, (3,), seed=0)]
    assert a == [e.text for e in mod.generate(4, (3,), seed=0)] and len(set(a)) > 1


def test_a_dataset_of_an_unregistered_task_says_what_is_missing(toy, tmp_path):
    mod, *_ = toy
    data = generate_dataset("toy_keep", tmp_path / "toy.parquet", n_groups=4, distractors=(1,))
    meta_vocab = load(data).meta["vocab"]
    vocab.check_prefix(meta_vocab, "ok")
    with pytest.raises(ValueError, match=r"another vocabulary \(tokens \['KEEP2'\] unknown"):
        vocab.check_prefix(meta_vocab[: vocab.BASE_SIZE] + ["KEEP2"], "a dataset")
    with pytest.raises(ValueError, match="needs a NAME"):
        tasks.register_task(types.SimpleNamespace(NAME="not an identifier"))
    with pytest.raises(ValueError, match="lacks draw_bases"):
        tasks.register_task(types.SimpleNamespace(NAME="half", Params=object))


def test_a_task_gets_twins_by_defining_twin(toy, tmp_path):
    mod, _ = toy
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            mod.NAME,
            "--twins",
            "--n-groups",
            "6",
            "--distractors",
            "1,4",
            "--out",
            str(tmp_path / "t.parquet"),
        ],
    )
    assert r.exit_code == 1 and "defines no twins" in r.stderr
    assert not (tmp_path / "t.parquet").exists()
    mod.twin = lambda bit, params, group=0: (1 - bit, 0)
    try:
        path = generate_dataset(
            mod.NAME, tmp_path / "t.parquet", n_groups=6, distractors=(1, 4), twins=True
        )
        ds = load(path)
        assert (ds.twin_target == 0).all() and (ds.twin_position == 2).all()
        assert all(a != b for a, b in zip(ds.labels, ds.twin_labels, strict=True))
    finally:
        del mod.twin

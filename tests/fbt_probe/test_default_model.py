"""The shipped default model: it loads, solves delayed_memory, and its feedback carries the bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fbt_probe.kernels.evaluate import evaluate
from fbt_probe.loading import DEFAULT_MODEL_DIR, resolve_model
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.recipes import named_config
from probes.common.cv import cross_validate, grouped_splits
from probes.common.extract import extract_features
from tasks.dataset import load
from tasks.generate import generate_dataset

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL_DIR / "model.safetensors").is_file(), reason="no default model"
)


def test_default_model_loads_with_its_provenance():
    model, name = resolve_model(None)
    assert name == "default" and model.cfg.fusion == "gated"
    meta = json.loads((DEFAULT_MODEL_DIR / "meta.json").read_text())
    cfg = json.loads((DEFAULT_MODEL_DIR / "train_config.json").read_text())
    assert meta["train_config"] == cfg and meta["steps_done"] == cfg["steps"]
    assert (DEFAULT_MODEL_DIR / "metrics.json").is_file()


def test_default_model_is_what_train_with_no_arguments_makes():
    # `fbt-probe train --as-default` trains the default recipe: the shipped model must match it
    cfg = json.loads((DEFAULT_MODEL_DIR / "train_config.json").read_text())
    assert TrainConfig.from_dict(cfg) == named_config("default")


@pytest.mark.parametrize("task", ["delayed_memory", "done_tracking"])
def test_default_model_feedback_carries_the_state(tmp_path, task):
    model, _ = resolve_model("default")
    path = generate_dataset(
        task, tmp_path / "d.parquet", n_groups=60, distractors=(1, 16, 128), seed=5
    )
    ds = load(path)
    y = np.array([lab[0] for lab in ds.labels])
    splits = grouped_splits(y, ds.group, 5, seed=0)
    std = extract_features(model, ds, "standard")[:, 0]
    rec = extract_features(model, ds, "recurrent")[:, 0]
    r_std = cross_validate(std, y, splits, groups=ds.group, C=1.0)
    r_rec = cross_validate(rec, y, splits, groups=ds.group, C=1.0)
    assert r_std.accuracy == pytest.approx(r_std.chance, abs=1e-9)  # a constant vector at the colon
    assert r_rec.accuracy >= 0.97


@pytest.mark.parametrize(
    "task,floor", [("delayed_memory", 0.95), ("done_tracking", 0.95), ("multi_register", 0.9)]
)
def test_default_model_answers(task, floor):
    # 30 prompts per task and mode: the floors sit a few errors below the targets of
    # docs/training.md, which `fbt-probe eval` measures on 432 (48 groups x counts 1..256)
    model, _ = resolve_model("default")
    summary, _ = evaluate(
        model, (task,), ("standard", "fused"), n_groups=10, distractors=(1, 64, 256)
    )
    assert summary[task]["standard"]["1-256"] >= floor
    assert summary[task]["fused"]["1-256"] >= floor

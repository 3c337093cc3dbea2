"""The fixtures several test files share: the default model, a tiny Llama folder, a small
fitted results folder, a hand-made results table, a small saved model folder and a training
run stopped halfway."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from fbt_probe.checkpoint import save_model
from fbt_probe.config import build_cfg
from fbt_probe.loading import resolve_model
from fbt_probe.stack import FBTModel
from probes.fit.run import COLUMNS
from tasks.generate import generate_dataset


@pytest.fixture(scope="session")
def default_model():
    return resolve_model("default")[0].eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from fbt_probe.hf.tiny import model_folder

    return model_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="session")
def fitted(tmp_path_factory):
    """The default model, a small delayed_memory set and its saved probes (two prefills)."""
    from fbt_probe.loading import resolve_model
    from probes.fit.run import fit_protocol

    tmp = tmp_path_factory.mktemp("view")
    model, name = resolve_model("default")
    data = generate_dataset(
        "delayed_memory", tmp / "dm.parquet", n_groups=12, distractors=(1, 6), seed=3
    )
    fit_protocol(
        model,
        name,
        ("delayed_memory",),
        ("standard", "recurrent"),
        {"delayed_memory": data},
        tmp / "fit",
        controls=False,
        per_count=False,
        cache_dir=tmp / "c",
    )
    return model, tmp, data


@pytest.fixture
def results(tmp_path):
    rows = []
    rng = np.random.default_rng(0)
    tasks = {"delayed_memory": ["label"], "multi_register": ["RA", "RB"]}
    for task, targets in tasks.items():
        for target, model, prefill, depth in itertools.product(
            targets,
            ["trained", "random_init", "permuted"],
            ["standard", "recurrent", "full"],
            range(3),
        ):
            counts = ["1-256"] + (["1", "16", "256"] if model == "trained" else [])
            for c in counts:
                acc = round(float(rng.uniform(0.5, 1.0)), 4)
                rows.append(
                    {
                        "task": task,
                        "target": target,
                        "model": model,
                        "prefill": prefill,
                        "depth": depth,
                        "distractors": c,
                        "overwrites": "all",
                        "accuracy": acc,
                        "ci_low": acc - 0.05,
                        "ci_high": min(1.0, acc + 0.05),
                        "chance": 0.5 if task != "multi_register" else 0.25,
                        "majority": 0.5,
                        "n_examples": 100,
                        "n_groups": 20,
                        "C": 1.0,
                    }
                )
            if task == "multi_register" and model == "trained":
                for k in range(3):
                    acc = round(float(rng.uniform(0.3, 1.0)), 4)
                    rows.append(
                        {
                            "task": task,
                            "target": target,
                            "model": model,
                            "prefill": prefill,
                            "depth": depth,
                            "distractors": "1-256",
                            "overwrites": str(k),
                            "accuracy": acc,
                            "ci_low": acc,
                            "ci_high": acc,
                            "chance": 0.25,
                            "majority": 0.3,
                            "n_examples": 30,
                            "n_groups": 10,
                            "C": 1.0,
                        }
                    )
    df = pd.DataFrame(rows).assign(probe="logistic", site="resid")[COLUMNS]
    res = tmp_path / "res"
    res.mkdir()
    df.to_csv(res / "probe_results.csv", index=False)
    return res, df


@pytest.fixture
def model_dir(tmp_path):
    save_model(FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0), tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run stopped at step 2 of 4: a checkpoint, its recipe and a model folder."""
    out = tmp_path_factory.mktemp("resume") / "run"
    args = ["train", "-c", "tiny", "--set", "steps=4", "--set", "run.checkpoint_every=2"]
    r = CliRunner().invoke(app, [*args, "--out", str(out), "--stop-after", "2"])
    assert r.exit_code == 0, r.output
    return out

"""The verified feature cache (``probes.common.cache``): one dataset never gets another's
features, and every kind of damaged entry is discarded with one line and computed again."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fbt_probe.checkpoint import save_model
from fbt_probe.config import build_cfg
from fbt_probe.stack import FBTModel
from probes.common.extract import extract_cached, extract_features
from tasks.dataset import load
from tasks.generate import generate_dataset


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    model = FBTModel(build_cfg(n_heads=4, n_ctx=320), seed=0).eval()
    save_model(model, d / "m")
    generate_dataset("delayed_memory", d / "a.parquet", n_groups=6, distractors=(1, 4), seed=2)
    generate_dataset("delayed_memory", d / "b.parquet", n_groups=6, distractors=(1, 4), seed=3)
    return model, load(d / "a.parquet"), d / "a.parquet", d / "b.parquet"


def test_a_dataset_never_gets_anothers_features(setup, tmp_path):
    """Two files of other seeds whose metadata claim the same content hash (a copied or
    edited metadata block) are two cache entries, each with its own rows' features."""
    model, ds_a, a, b = setup
    fa, _ = extract_cached(model, ds_a, "recurrent", tmp_path)
    ds_b = load(b)
    ds_b.meta["content_hash"] = ds_a.content_hash  # the same claim as a's
    fb, hit = extract_cached(model, ds_b, "recurrent", tmp_path)
    assert not hit
    assert np.array_equal(fb, extract_features(model, ds_b, "recurrent"))
    assert not np.array_equal(fa, fb)
    assert len(list(tmp_path.glob("*.npy"))) == 2


def _damage(kind, entry):
    feats = np.load(entry)
    rec_path = entry.with_suffix(".json")
    if kind == "truncated":
        entry.write_bytes(entry.read_bytes()[:100])
    elif kind == "float64":
        np.save(entry, feats.astype(np.float64))
    elif kind == "inner shape":
        np.save(entry, feats[:, :-1])
    elif kind == "rows":
        np.save(entry, feats[:-1])
    elif kind == "nan":
        feats[0, 0, 0] = np.nan
        np.save(entry, feats)
    elif kind == "changed values":
        np.save(entry, feats + 1e-3)
    elif kind == "no record":
        rec_path.unlink()
    elif kind == "bad record":
        rec_path.write_text("{oops")
    elif kind == "other inputs":
        rec = json.loads(rec_path.read_text())
        rec["prefill"] = "standard"
        rec_path.write_text(json.dumps(rec))


KINDS = [
    "truncated",
    "float64",
    "inner shape",
    "rows",
    "nan",
    "changed values",
    "no record",
    "bad record",
    "other inputs",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_entry_is_discarded_with_one_line_and_recomputed(setup, tmp_path, kind, capfd):
    model, ds, *_ = setup
    fresh, hit = extract_cached(model, ds, "recurrent", tmp_path)
    assert not hit
    capfd.readouterr()
    (entry,) = tmp_path.glob("*.npy")
    _damage(kind, entry)
    again, hit = extract_cached(model, ds, "recurrent", tmp_path)
    err = capfd.readouterr().err.strip().splitlines()
    assert not hit and np.array_equal(again, fresh) and again.dtype == np.float32
    assert len(err) == 1 and err[0].startswith(f"cache entry {entry} discarded"), err
    # the entry is whole again: the next read is a verified hit, without a word
    third, hit = extract_cached(model, ds, "recurrent", tmp_path)
    assert hit and np.array_equal(third, fresh) and capfd.readouterr().err == ""

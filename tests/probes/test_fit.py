"""Probes: equality with sklearn, leakage safety, controls, and the fit command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.model_selection import KFold, StratifiedGroupKFold, cross_val_score
from typer.testing import CliRunner

from cli import app
from fbt_probe.checkpoint import save_model
from fbt_probe.config import FBTConfig
from fbt_probe.stack import FBTModel
from probes.common.bootstrap import bootstrap_ci
from probes.common.cv import cross_validate, grouped_splits, make_probe, permute_by_group
from probes.common.extract import extract_cached, extract_features
from probes.common.probe_results import layer0_table, load_results
from tasks.dataset import load
from tasks.generate import generate_dataset


def toy(n_groups=60, per=5, d=16, signal=1.0, seed=0):
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_groups), per)
    y = np.repeat(rng.integers(0, 2, n_groups), per)
    X = rng.normal(size=(len(y), d))
    X[:, 0] += signal * (2 * y - 1)
    return X, y, groups


def test_grouped_cv_equals_sklearn_cross_val_score():
    X, y, g = toy()
    splits = grouped_splits(y, g, 5, seed=3)
    ours = cross_validate(X, y, splits, groups=g, C=0.3)
    ref = cross_val_score(
        make_probe(0.3), X, y, groups=g, cv=StratifiedGroupKFold(5, shuffle=True, random_state=3)
    )
    np.testing.assert_allclose(ours.fold_accuracies, ref, atol=1e-12)
    assert ours.accuracy == pytest.approx(ref.mean(), abs=1e-12)
    # nested selection: same as sklearn with the C each fold chose
    nested = cross_validate(X, y, splits, groups=g)
    for (tr, te), c, acc in zip(splits, nested.Cs, nested.fold_accuracies, strict=True):
        assert make_probe(c).fit(X[tr], y[tr]).score(X[te], y[te]) == pytest.approx(acc)


def test_folds_never_split_a_group():
    X, y, g = toy()
    for tr, te in grouped_splits(y, g, 5, seed=0):
        assert not set(g[tr]) & set(g[te])


def test_group_id_features_score_chance():
    # Features that encode only the group id (one-hot): perfect memorisation in-sample,
    # but grouped folds never test on a trained group, so the probe lands at chance.
    rng = np.random.default_rng(1)
    n_groups, per = 400, 3
    g = np.repeat(np.arange(n_groups), per)
    y = np.repeat(rng.integers(0, 2, n_groups), per)
    X = np.eye(n_groups)[g] + 0.01 * rng.normal(size=(len(g), n_groups))
    res = cross_validate(X, y, grouped_splits(y, g, 5, 0), groups=g)
    se = np.sqrt(0.25 / n_groups)  # groups are the independent units
    assert abs(res.accuracy - res.chance) < 3 * se
    # ... while an ungrouped split (the leak) would look far better than chance
    leak = cross_val_score(make_probe(1.0), X, y, cv=KFold(5, shuffle=True, random_state=0)).mean()
    assert leak > 0.9


def test_signal_is_found_and_permutation_lands_at_chance():
    X, y, g = toy(n_groups=100, signal=2.0)
    res = cross_validate(X, y, grouped_splits(y, g, 5, 0), groups=g)
    assert res.accuracy > 0.9
    yp = permute_by_group(y, g, seed=5)
    for grp in np.unique(g):
        assert len(set(yp[g == grp])) == 1
    perm = cross_validate(X, yp, grouped_splits(yp, g, 5, 0), groups=g)
    assert abs(perm.accuracy - perm.chance) < 0.12
    lo, hi = bootstrap_ci(res.correct, g, seed=0)
    assert lo <= res.correct.mean() <= hi and hi - lo < 0.15


def test_constant_features_give_the_chance_column():
    X, y, g = toy()
    splits = grouped_splits(y, g, 5, 0)
    const = cross_validate(np.ones((len(y), 3)), y, splits, groups=g, C=1.0)
    assert const.accuracy == pytest.approx(const.chance)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    model = FBTModel(
        FBTConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, n_ctx=320), seed=5
    ).eval()
    save_model(model, root / "m")
    for task in ("delayed_memory", "multi_register"):
        generate_dataset(task, root / f"{task}.parquet", n_groups=20, distractors=(0, 1, 8), seed=9)
    return root, model


def test_extraction_is_cached_and_consistent(tiny_setup, tmp_path):
    root, model = tiny_setup
    ds = load(root / "delayed_memory.parquet")
    f1, hit1 = extract_cached(model, ds, "recurrent", tmp_path)
    f2, hit2 = extract_cached(model, ds, "recurrent", tmp_path)
    assert (hit1, hit2) == (False, True) and np.array_equal(f1, f2)
    assert f1.shape == (len(ds), 3, 32)
    # recurrent depth 0 at the colon is the fused feedback; standard depth 0 is the colon's embedding
    std = extract_features(model, ds, "standard")
    assert np.allclose(std[:, 0], std[0, 0])  # constant: rotary adds no position to the stream
    assert not np.allclose(f1[:, 0], f1[0, 0])
    k1 = extract_features(model, ds, "k1")
    assert np.allclose(k1, std)


def test_fit_command_writes_results(tiny_setup, tmp_path):
    root, _ = tiny_setup
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(root / "m"),
            "--data",
            str(root / "multi_register.parquet"),
            "--out",
            str(tmp_path / "res"),
            "--prefill",
            "standard,recurrent",
        ],
    )
    assert r.exit_code == 0, r.output
    df = load_results(tmp_path / "res")
    need = {
        "task",
        "target",
        "model",
        "prefill",
        "depth",
        "distractors",
        "accuracy",
        "ci_low",
        "ci_high",
        "chance",
        "majority",
        "n_examples",
        "n_groups",
    }
    assert need <= set(df.columns)
    assert set(df.model) == {"trained", "random_init", "permuted"}
    assert set(df.target) == {"RA", "RB", "RC", "RD"}
    assert set(df.depth) == {0, 1, 2}
    assert {"1-256", "0", "1", "8"} <= set(df.distractors)
    assert (df.ci_low <= df.accuracy + 1e-9).all() and (df.accuracy <= df.ci_high + 1e-9).all()
    pooled = df[(df.distractors == "1-256") & (df.overwrites == "all")]
    assert (pooled.n_groups == 20).all() and (pooled.n_examples == 40).all()
    assert set(df.overwrites) - {"all"}  # per-overwrite rows exist
    meta = json.loads((tmp_path / "res" / "probe_results.json").read_text())
    assert (
        meta["folds"] == 5
        and len(meta["model_hash"]) == 16
        and "multi_register" in meta["datasets"]
    )
    assert "layer 0" in r.output
    t0 = layer0_table(df)
    assert len(t0) == 8  # 4 registers x 2 prefills


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--prefill", "sideways"], "unknown prefill"),
        (["--task", "nope"], "unknown task"),
        (["--model", "/nonexistent"], "not found"),
        (["--folds", "1"], "at least 2"),
    ],
)
def test_fit_bad_input(tiny_setup, tmp_path, args, msg):
    root, _ = tiny_setup
    base = [
        "fit",
        "--model",
        str(root / "m"),
        "--data",
        str(root / "delayed_memory.parquet"),
        "--out",
        str(tmp_path / "r"),
    ]
    if "--model" in args:
        base = ["fit", "--out", str(tmp_path / "r")]
    if "--task" in args:
        base = ["fit", "--model", str(root / "m"), "--out", str(tmp_path / "r")]
    r = CliRunner().invoke(app, base + args)
    assert r.exit_code != 0 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "probe_results.csv").exists()


# ---- probe types, sites and saved probes ---------------------------------------------------
def test_logistic_probe_is_the_sklearn_pipeline_and_a_registered_probe_plugs_in():
    from probes.common.probe import PROBES, LogisticProbe, register_probe

    X, y, g = toy()
    ref = make_probe(0.1).fit(X, y)
    ours = LogisticProbe(0.1).fit(X, y)
    assert np.array_equal(ours.predict(X), ref.predict(X))
    # the direction, in raw feature space, is where the signal is (feature 0)
    assert np.argmax(np.abs(ours.direction()[0])) == 0

    @register_probe
    class Centroid:  # nearest class mean: a probe written in the test, used by name
        name, grid = "centroid-test", (0.0,)

        def __init__(self, reg=0.0):
            pass

        def fit(self, X, y):
            self.classes = np.unique(y)
            self.means = np.stack([X[y == c].mean(0) for c in self.classes])
            return self

        def predict(self, X):
            d = ((X[:, None, :] - self.means[None]) ** 2).sum(-1)
            return self.classes[d.argmin(1)]

    try:
        res = cross_validate(X, y, grouped_splits(y, g, 5, 0), groups=g, probe="centroid-test")
        assert res.accuracy > 0.8 and res.Cs == [0.0] * 5
    finally:
        PROBES.remove("centroid-test")
    with pytest.raises(ValueError, match="unknown probe 'nope'"):
        cross_validate(X, y, grouped_splits(y, g, 5, 0), groups=g, probe="nope")


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_fit_with_the_mlp_probe_and_saved_probes_predict_as_in_the_fit(tiny_setup, tmp_path):
    from probes.common.artifacts import find, load_probes

    root, model = tiny_setup
    out = tmp_path / "res"
    args = ["fit", "--model", str(root / "m"), "--data", str(root / "delayed_memory.parquet")]
    # three folds: each cell fits the MLP 15 times (3 x (2 values of reg x 2 inner folds + 1))
    r = CliRunner().invoke(
        app, [*args, "--out", str(out), "--probe", "mlp", "-p", "recurrent", "--folds", "3"]
    )
    assert r.exit_code == 0, r.output
    df = load_results(out)
    assert set(df.probe) == {"mlp"} and set(df.site) == {"resid"}
    assert set(df.depth) == {0, 1, 2} and set(df.model) == {"trained", "random_init", "permuted"}
    saved = load_probes(out)
    assert len(saved) == 3 and {p.meta["probe"] for p in saved} == {"mlp"}
    meta = json.loads((out / "probe_results.json").read_text())
    ds = load(root / "delayed_memory.parquet")
    feats = extract_features(model, ds, "recurrent")
    keep = ds.n_distractors >= 1
    y = np.array([lab[0] for lab in ds.labels])[keep]
    for p in saved:
        assert (
            p.meta["model_hash"] == meta["model_hash"] and p.meta["dataset_hash"] == ds.content_hash
        )
        X = feats[keep, p.meta["depth"]]
        # refit in memory exactly as the fit did: the saved one predicts the same labels
        from probes.common.probe import MLPProbe

        again = MLPProbe(p.meta["reg"]).fit(X, y)
        assert np.array_equal(p.predict(X), again.predict(X))
        assert p.direction() is None
    # the logistic default: saved with its direction
    r = CliRunner().invoke(
        app, [*args, "--out", str(tmp_path / "lin"), "-p", "recurrent", "--no-controls"]
    )
    assert r.exit_code == 0, r.output
    p0 = find(load_probes(tmp_path / "lin"), depth=0, prefill="recurrent")
    from probes.common.probe import LogisticProbe

    ref = LogisticProbe(p0.meta["reg"]).fit(feats[keep, 0], y)
    assert np.array_equal(p0.predict(feats[keep, 0]), ref.predict(feats[keep, 0]))
    np.testing.assert_allclose(p0.direction(), ref.direction(), rtol=1e-12)


def test_fit_at_a_hook_site_and_before_the_colon(tiny_setup, tmp_path):
    root, model = tiny_setup
    args = [
        "fit",
        "--model",
        str(root / "m"),
        "--data",
        str(root / "delayed_memory.parquet"),
        "--no-controls",
    ]
    r = CliRunner().invoke(
        app, [*args, "--out", str(tmp_path / "a"), "--site", "fusion.hook_state"]
    )
    assert r.exit_code == 0, r.output
    df = load_results(tmp_path / "a")
    # the fed-back state does not exist in pass 1: standard prefill is left out, and said so
    assert set(df.site) == {"fusion.hook_state"} and set(df.prefill) == {"recurrent", "full"}
    meta = json.loads((tmp_path / "a" / "probe_results.json").read_text())
    assert meta["skipped"] == ["fusion.hook_state under standard prefill (does not fire)"]
    # the state fed back at the colon is pass 1's top state one position earlier
    ds = load(root / "delayed_memory.parquet")
    state = extract_features(model, ds, "recurrent", site="fusion.hook_state")
    top_before = extract_features(model, ds, "standard", site="ln_final.hook_normalized@colon-1")
    np.testing.assert_allclose(state, top_before, atol=1e-6)
    for bad, msg in (
        (["--site", "blocks.9.hook_resid_pre"], "unknown site"),
        (["--site", "resid@colon+1"], "invalid position"),
        (["--site", "fusion.hook_state", "-p", "standard"], "fires under none"),
        (["--probe", "svm"], "unknown probe"),
    ):
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), *bad])
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_task_declared_position(tiny_setup, tmp_path):
    # delayed_memory declares 'bit', the position of the stored bit: depth 0 there under
    # standard prefill is that token's embedding, so even an untrained model's probe is exact
    from probes.common.extract import site_positions

    root, model = tiny_setup
    ds = load(root / "delayed_memory.parquet")
    assert (site_positions(ds, "resid@bit") == 2).all()
    args = ["fit", "--model", str(root / "m"), "--data", str(root / "delayed_memory.parquet")]
    r = CliRunner().invoke(
        app,
        [
            *args,
            "--out",
            str(tmp_path / "r"),
            "--site",
            "resid@bit",
            "-p",
            "standard",
            "--no-controls",
        ],
    )
    assert r.exit_code == 0, r.output
    df = load_results(tmp_path / "r")
    row = df[(df.depth == 0) & (df.distractors == "1-256")].iloc[0]
    assert row.site == "resid@bit" and row.accuracy == 1.0
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "s"), "--site", "resid@need"])
    assert r.exit_code == 1 and "declares no position 'need'; it declares bit" in r.stderr


def test_extraction_batches_keep_under_a_token_budget():
    from types import SimpleNamespace

    from fbt_probe.loading import resolve_model
    from probes.common.extract import length_batches, max_batch_tokens

    lengths = np.array([5, 3, 9, 4, 8, 2, 7])
    groups = [g.tolist() for g in length_batches(lengths, batch_size=3, max_tokens=16)]
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        assert len(g) <= 3 and len(g) * lengths[g].max() <= 16
    assert groups == [[5, 1, 3], [0, 6], [4], [2]]  # lengths 2 3 4 | 5 7 | 8 | 9
    # no budget: batch_size examples at a time, as before
    assert [len(g) for g in length_batches(lengths, 3)] == [3, 3, 1]
    # the built-in model's longest prompts fit 128 at a time; a 30-layer, 576-wide one does not
    model, _ = resolve_model("default")
    assert max_batch_tokens(model) >= 128 * 300
    wide = SimpleNamespace(cfg=SimpleNamespace(d_model=576, n_layers=30))
    assert 16 * 263 > max_batch_tokens(wide) > 8 * 263

"""Counterfactual twins and causal interventions, against exact references."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fbt_probe.config import FBTConfig
from fbt_probe.kernels.patching import STATE_HOOK, clean_run, patched_run, replace_where
from fbt_probe.prefill import Prefill
from fbt_probe.recurrence import run_recurrence
from fbt_probe.stack import FBTModel
from probes.common.metrics import COLUMNS, Key, summarise
from probes.common.twins import batches, pairs_of, window_mask
from probes.intervene.erasers import fit_leace
from probes.intervene.plot import depth_of
from probes.intervene.registry import REGISTRY
from probes.intervene.run import run_battery
from tasks import delayed_memory, done_tracking, get_task, multi_register, vocab
from tasks.base import STREAM_PROBE, generate_groups, generate_twins
from tasks.dataset import load
from tasks.generate import generate_dataset
from tests.oracle import interpret

TASKS = ("delayed_memory", "done_tracking", "multi_register")
# the kinds that need no erasers or probe directions (no grouped folds)
UNDIRECTED = tuple(k for k, v in REGISTRY.items() if not v.directions)


def _twins(task, n_groups=24, counts=(0, 3, 17)):
    mod = get_task(task)
    p = mod.Params()
    exs = generate_groups(mod, n_groups, counts, 7, p, STREAM_PROBE)
    return exs, generate_twins(mod, n_groups, counts, 7, p, STREAM_PROBE)


@pytest.mark.parametrize("task", TASKS)
def test_every_twin_flips_its_label_and_keeps_every_other_word(task):
    exs, twins = _twins(task)
    assert any(t is not None for t in twins)
    for ex, tw in zip(exs, twins, strict=True):
        if tw is None:
            continue
        clean, other = ex.tokens, tw.example.tokens
        assert len(clean) == len(other) and ex.colon_index == tw.example.colon_index
        diff = [
            i for i, (a, b) in enumerate(zip(ex.prompt, tw.example.prompt, strict=True)) if a != b
        ]
        assert diff == [tw.position]  # one prompt word, the label-bearing one
        # the independent oracle reads the twin's label from its text
        assert interpret(tw.example.text) == tw.example.answer
        assert interpret(ex.text) == ex.answer
        assert tw.example.answer[tw.target] != ex.answer[tw.target]
        assert all(
            a == b
            for i, (a, b) in enumerate(zip(ex.answer, tw.example.answer, strict=True))
            if i != tw.target
        )


def test_done_tracking_twins_move_the_count_across_the_threshold_within_range():
    exs, twins = _twins("done_tracking", n_groups=64, counts=(5,))
    max_need = done_tracking.Params().max_need
    for ex, tw in zip(exs, twins, strict=True):
        k, s = int(ex.prompt[2][1:]), ex.prompt.count(vocab.STEP)
        has = (s + 1 <= max_need) if s >= k else s >= 1
        assert (tw is not None) == has
        if tw is not None:
            k2 = int(tw.example.prompt[2][1:])
            assert 1 <= k2 <= max_need and (s >= k) != (s >= k2) and tw.position == 2
            assert tw.example.prompt.count(vocab.STEP) == s


def test_multi_register_twin_changes_the_last_write_of_one_register():
    exs, twins = _twins("multi_register", n_groups=8, counts=(4,))
    for ex, tw in zip(exs, twins, strict=True):
        r = tw.target
        assert r == ex.group % multi_register.Params().n_registers
        name = vocab.REGISTERS[r]
        last = max(i for i, w in enumerate(ex.prompt) if w == name)
        assert tw.position == last + 1  # the value of that register's last write


def test_twin_dataset_keeps_the_rows_and_their_hash(tmp_path):
    plain = generate_dataset(
        "done_tracking", tmp_path / "a.parquet", n_groups=12, distractors=(1, 8), seed=3
    )
    with_twins = generate_dataset(
        "done_tracking", tmp_path / "b.parquet", n_groups=12, distractors=(1, 8), seed=3, twins=True
    )
    a, b = load(plain), load(with_twins)
    assert not a.has_twins and b.has_twins
    assert a.content_hash == b.content_hash and a.text == b.text
    assert b.meta["twins"]["n_twins"] == int((b.twin_target >= 0).sum()) > 0
    for i in np.flatnonzero(b.twin_target >= 0):
        assert interpret(vocab.decode(b.twin_token_ids[i])) == b.twin_labels[i]
    # the same arguments give the same bytes
    again = generate_dataset(
        "done_tracking", tmp_path / "c.parquet", n_groups=12, distractors=(1, 8), seed=3, twins=True
    )
    assert Path(again).read_bytes() == Path(with_twins).read_bytes()


def _model(fusion="gated", seed=5):
    cfg = FBTConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, n_ctx=320, fusion=fusion)
    return FBTModel(cfg, seed=seed).eval()


def _batch(task="delayed_memory", n_groups=6, counts=(2, 5), tmp=None):
    path = generate_dataset(
        task,
        tmp / f"{task}.parquet",
        n_groups=n_groups,
        distractors=counts,
        seed=11,
        twins=True,
        force=True,
    )
    ds = load(path)
    pairs = pairs_of(ds)
    return ds, pairs, batches(pairs, 64, "cpu")[0]


def _at_answer(logits, b, start=0):
    return logits[torch.arange(len(b.idx)), b.answer - start]


@pytest.mark.parametrize("passes", [2, None])
def test_self_patch_changes_nothing(tmp_path, passes):
    m = _model()
    _, _, b = _batch("done_tracking", tmp=tmp_path)
    c = clean_run(m, b.tokens, Prefill(passes))
    for window in ("all", "last4"):
        mask = window_mask(window, b)
        s = int(mask.any(0).nonzero()[0])
        lg = patched_run(m, c, s, [(STATE_HOOK, replace_where(mask, c.fed))])
        torch.testing.assert_close(lg, c.logits[:, s:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("passes", [2, None])
def test_interchanging_every_state_and_token_gives_the_twin(tmp_path, passes):
    m = _model()
    _, _, b = _batch("multi_register", counts=(3,), tmp=tmp_path)
    c = clean_run(m, b.tokens, Prefill(passes))
    w = clean_run(m, b.twin_tokens, Prefill(passes), keep_cache=False)
    every = torch.ones_like(b.tokens, dtype=torch.bool)
    lg = patched_run(m, c, 0, [(STATE_HOOK, replace_where(every, w.fed))], emb=w.emb)
    torch.testing.assert_close(lg, w.logits, atol=1e-5, rtol=0)
    # and the states alone do not: the label token still differs
    lg_state = patched_run(m, c, 0, [(STATE_HOOK, replace_where(every, w.fed))])
    assert (lg_state - w.logits).abs().max() > 1e-4


def test_a_recurrence_patch_at_t_leaves_earlier_positions_bit_identical(tmp_path):
    m = _model()
    _, _, b = _batch("delayed_memory", counts=(12,), tmp=tmp_path)
    t = 9
    clean = run_recurrence(m, b.tokens)
    mask = torch.zeros_like(b.tokens, dtype=torch.bool)
    mask[:, t] = True
    with m.hooks(fwd_hooks=[(STATE_HOOK, replace_where(mask, torch.zeros(*b.tokens.shape, 32)))]):
        patched = run_recurrence(m, b.tokens)
    assert torch.equal(patched.logits[:, :t], clean.logits[:, :t])
    assert torch.equal(patched.states[:, :t], clean.states[:, :t])
    # ... and propagates to every later step
    later = (patched.states[:, t:] - clean.states[:, t:]).abs().amax(dim=(0, 2))
    assert bool((later > 0).all())
    # the resumed run from t gives the same patched logits as the whole recurrence
    c = clean_run(m, b.tokens, Prefill(None))
    lg = patched_run(m, c, t, [(STATE_HOOK, replace_where(mask, torch.zeros(*b.tokens.shape, 32)))])
    torch.testing.assert_close(lg, patched.logits[:, t:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefill", ["recurrent", "full"])
def test_without_fusion_every_state_intervention_has_exactly_no_effect(tmp_path, prefill):
    m = _model(fusion="none")
    path = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=10,
        distractors=(2, 6),
        seed=11,
        twins=True,
    )
    rec, pairs, _ = run_battery(m, load(path), prefill, cache_dir=None, kinds=UNDIRECTED)
    c, f, ld = rec.hits[Key("clean", "", "")]
    state = [k for k in rec.hits if k.site.startswith(STATE_HOOK)]
    assert len(state) == 1 + 4 * 6 + 1 + (1 if prefill == "full" else 0)
    for k in state:
        kc, kf, kld = rec.hits[k]
        assert np.array_equal(kc, c) and np.array_equal(kf, f)
        np.testing.assert_allclose(kld, ld, atol=1e-5, rtol=0)
    df = summarise(rec, pairs, "delayed_memory", prefill, 0)
    st = df[df.site.str.startswith(STATE_HOOK) & (df.metric == "logit_diff")]
    np.testing.assert_allclose(st.value, 1.0, atol=1e-5)


def test_leace_leaves_the_probe_at_chance_on_held_out_features():
    from probes.common.probe import LogisticProbe
    from probes.intervene.erasers import erase

    rng = np.random.default_rng(0)
    n, d = 600, 24
    y = rng.integers(0, 2, n)
    X = rng.normal(size=(n, d)) + np.outer(y * 2 - 1, rng.normal(size=d)) * 1.5
    X[:, 3] += 0.8 * (y * 2 - 1)  # a second, axis-aligned trace of the label
    tr, te = np.arange(400), np.arange(400, n)
    before = np.mean(LogisticProbe(1.0).fit(X[tr], y[tr]).predict(X[te]) == y[te])
    onehot = np.eye(2)[y]
    left, right, bias = fit_leace(X[tr], onehot[tr])
    E = erase(torch.from_numpy(X)[None].double(), left[None], right[None], bias[None])[0].numpy()
    after = np.mean(LogisticProbe(1.0).fit(E[tr], y[tr]).predict(E[te]) == y[te])
    assert before > 0.95
    assert abs(after - 0.5) < 0.08  # chance, within sampling noise on 200 held-out examples


def test_battery_on_a_tiny_model_reports_every_intervention(tmp_path):
    m = _model()
    path = generate_dataset(
        "done_tracking",
        tmp_path / "dt.parquet",
        n_groups=16,
        distractors=(1, 4),
        seed=11,
        twins=True,
    )
    ds = load(path)
    rec, pairs, info = run_battery(m, ds, "full", cache_dir=tmp_path / "cache")
    df = summarise(rec, pairs, "done_tracking", "full", 0)
    assert list(df.columns) == COLUMNS
    assert set(df.intervention) == set(REGISTRY)
    assert (df.ci_low <= df.value + 1e-9).all() and (df.value <= df.ci_high + 1e-9).all()
    rates = df[df.metric != "logit_diff"]
    assert rates.value.between(0, 1).all()
    self_rows = df[df.intervention == "self"].set_index("metric").value
    c, _, _ = rec.hits[Key("clean", "", "")]
    assert self_rows["accuracy"] == pytest.approx(c.mean())
    assert self_rows["logit_diff"] == pytest.approx(1.0, abs=1e-5)
    # steering at alpha 0 is the clean run
    zero = df[(df.intervention == "steer_probe") & (df.alpha == 0) & (df.metric == "logit_diff")]
    np.testing.assert_allclose(zero.value, 1.0, atol=1e-5)
    assert info["patched_runs"] > 0 and len(pairs) == df.n.iloc[0]


def test_steering_moves_the_projection_by_alpha_sigmas(tmp_path):
    from probes.intervene.erasers import depth_tools

    path = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=20,
        distractors=(1, 3),
        seed=11,
        twins=True,
    )
    ds = load(path)
    pairs = pairs_of(ds)
    feats = np.random.default_rng(1).normal(size=(len(pairs), 32))
    feats[:, 0] += (pairs.labels[:, 0] == vocab.ONE) * 3.0
    held = [np.arange(len(pairs))[i::5] for i in range(5)]
    tl = depth_tools(feats, pairs, {0: [vocab.ONE, vocab.ZERO]}, held, None, 0, 0)
    u, sigma = tl.unit.double().numpy(), tl.sigma.double().numpy()
    np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, atol=1e-6)
    # the direction points from the clean label to the twin's: mostly along feature 0
    sign = np.where(pairs.labels[:, 0] == vocab.ONE, -1.0, 1.0)
    assert (np.sign(u[:, 0]) == sign).all()
    assert (sigma > 0).all()


class _Result:
    def __init__(self, r):
        self.returncode, self.stdout, self.stderr = r.exit_code, r.stdout, r.stderr


def _cli(*args, cwd):
    import os

    from typer.testing import CliRunner

    from cli import app

    here = os.getcwd()
    os.chdir(cwd)
    try:
        return _Result(CliRunner().invoke(app, list(args)))
    finally:
        os.chdir(here)


def test_intervene_command_on_the_default_model(tmp_path):
    data = tmp_path / "dm.parquet"
    r = _cli(
        "generate",
        "--task",
        "delayed_memory",
        "--n-groups",
        "10",
        "--distractors",
        "1,6",
        "--twins",
        "--out",
        str(data),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "iv"
    r = _cli(
        "intervene",
        "--task",
        "delayed_memory",
        "--prefill",
        "recurrent",
        "--data",
        str(data),
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(out / "interventions.csv")
    assert list(df.columns) == COLUMNS and set(df.intervention) == set(REGISTRY)
    meta = json.loads((out / "interventions.json").read_text())
    assert meta["runs"][0]["n_pairs"] == 20 and meta["runs"][0]["clean_accuracy"] == 1.0
    for stem in ("interchange_delayed_memory", "depth_delayed_memory", "steering_delayed_memory"):
        assert (out / "figures" / f"{stem}.png").stat().st_size > 0
    assert "relies on" in r.stdout


def test_intervene_refuses_a_dataset_without_twins(tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=6, distractors=(1,), seed=1)
    r = _cli("intervene", "--data", str(data), "--out", str(tmp_path / "iv"), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {data} has no twins: generate it with 'fbt-probe generate --twins'"
    ]
    assert not (tmp_path / "iv" / "interventions.csv").exists()
    r = _cli("intervene", "--prefill", "sideways", "--out", str(tmp_path / "iv"), cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.startswith("error: unknown prefill 'sideways'")
    r = _cli(
        "intervene",
        "--probes",
        str(tmp_path / "nowhere"),
        "--out",
        str(tmp_path / "iv"),
        cwd=tmp_path,
    )
    assert r.returncode == 1 and r.stderr.startswith("error: no saved probes in")
    few = tmp_path / "few.parquet"
    generate_dataset("delayed_memory", few, n_groups=3, distractors=(1,), seed=1, twins=True)
    r = _cli("intervene", "--data", str(few), "--out", str(tmp_path / "iv"), cwd=tmp_path)
    assert r.returncode == 1 and "too few for 5 grouped folds" in r.stderr
    assert (
        len(r.stderr.strip().splitlines()) == 1
        and not (tmp_path / "iv" / "interventions.csv").exists()
    )


def test_depths_pick_where_the_depth_interventions_act(tmp_path):
    from probes.intervene.run import pick_depths

    assert pick_depths(None, 5) == (0, 1, 2, 3, 4)  # the built-in model: every depth
    assert pick_depths(None, 31) == (0, 8, 15, 22, 30)  # a 30-layer model: 5 of them
    assert pick_depths("all", 31) == tuple(range(31))
    assert pick_depths(" 2,0", 3) == (0, 2)
    for bad in ("", "3", "-1", "one", "1,,x", "2,0,2"):
        with pytest.raises(ValueError, match="--depths"):
            pick_depths(bad, 3)
    m = FBTModel(FBTConfig(d_model=32, n_layers=7, n_heads=2, d_mlp=64, n_ctx=320), seed=5)
    ds = load(
        generate_dataset(
            "delayed_memory",
            tmp_path / "dm.parquet",
            n_groups=6,
            distractors=(1, 4),
            seed=11,
            twins=True,
        )
    )
    kinds = ("erase_probe", "steer_probe")
    for spec, want in ((None, {0, 2, 4, 5, 7}), ("1,5", {1, 5})):
        rec, _, info = run_battery(
            m, ds, "recurrent", cache_dir=None, kinds=kinds, folds=3, depths=spec
        )
        sites = {k.site for k in rec.hits if k.intervention in kinds}
        assert {depth_of(s) for s in sites} == want and info["depths"] == sorted(want)
        assert info["patched_runs"] == len(want) * (1 + 9) * info["n_batches"]  # 9 alphas
    r = _cli("intervene", "--depths", "9", "--out", str(tmp_path / "iv"), cwd=tmp_path)
    assert r.returncode == 1 and not (tmp_path / "iv").exists()
    assert r.stderr.strip().splitlines() == [
        "error: --depths '9': give 'all' or depths between 0 and 4, comma-separated"
    ]


def test_delayed_memory_twin_is_the_other_bit():
    assert delayed_memory.twin(0, delayed_memory.Params()) == (1, 0)
    assert delayed_memory.twin(1, delayed_memory.Params()) == (0, 0)


def test_leace_erases_the_default_models_layer0_state(tmp_path):
    # on real features: delayed_memory's bit at depth 0 of the colon under recurrent prefill is
    # decodable (probe ~1.0); after LEACE fitted on the training folds a fresh probe trained
    # and tested on erased features is at chance
    from fbt_probe.loading import resolve_model
    from probes.common.cv import grouped_splits
    from probes.common.extract import extract_features
    from probes.common.probe import LogisticProbe
    from probes.intervene.erasers import erase

    model, _ = resolve_model("default")
    path = generate_dataset(
        "delayed_memory", tmp_path / "dm.parquet", n_groups=40, distractors=(1, 4, 16), seed=5
    )
    ds = load(path)
    X = extract_features(model, ds, "recurrent")[:, 0].astype(np.float64)
    y = np.array([lab[0] for lab in ds.labels])
    (tr, te), *_ = grouped_splits(y, ds.group, 4, 0)
    before = np.mean(LogisticProbe(1.0).fit(X[tr], y[tr]).predict(X[te]) == y[te])
    onehot = (y[:, None] == np.array([vocab.ZERO, vocab.ONE])[None]).astype(float)
    left, right, bias = fit_leace(X[tr], onehot[tr])
    E = erase(torch.from_numpy(X)[None], left[None], right[None], bias[None])[0].numpy()
    after = np.mean(LogisticProbe(1.0).fit(E[tr], y[tr]).predict(E[te]) == y[te])
    assert before > 0.95
    assert after < 0.65  # chance is 0.5; 30 held-out examples


@pytest.mark.parametrize("passes", [1, 2, None])
def test_a_run_from_a_depth_equals_the_whole_pass(tmp_path, passes):
    # a patch at depth d re-runs only the blocks from d up; it must give what re-running every
    # block gives (the recurrence: with the answer at the colon, nothing after it is read)
    m = _model()
    _, _, b = _batch("delayed_memory", counts=(5,), tmp=tmp_path)
    c = clean_run(m, b.tokens, Prefill(passes))
    colon = b.positions() == b.colon[:, None]
    s = int(b.colon.min())
    push = torch.randn(32, generator=torch.Generator().manual_seed(0))
    for d, hook in enumerate(
        ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    ):
        hooks = [(hook, replace_where(colon, lambda x: x + push))]
        whole = patched_run(m, c, s, hooks)
        part = patched_run(m, c, s, hooks, from_layer=min(d, 1))
        torch.testing.assert_close(part, whole, atol=1e-5, rtol=0)
        assert (whole - c.logits[:, s:]).abs().max() > 1e-3  # the patch did something


def test_steering_uses_a_fits_saved_probes(tmp_path):
    from fbt_probe.loading import resolve_model
    from probes.common.artifacts import find, load_probes
    from probes.fit.run import fit_protocol
    from probes.intervene.erasers import class_vectors
    from probes.intervene.run import intervene_battery

    model, name = resolve_model("default")
    data = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=12,
        distractors=(1, 6),
        seed=2,
        twins=True,
    )
    fit_protocol(
        model,
        name,
        ("delayed_memory",),
        ("recurrent",),
        {"delayed_memory": data},
        tmp_path / "fit",
        controls=False,
        per_count=False,
        cache_dir=tmp_path / "c",
    )
    df = intervene_battery(
        model,
        name,
        [("delayed_memory", "recurrent")],
        tmp_path / "iv",
        data={"delayed_memory": data},
        probes_dir=tmp_path / "fit",
        cache_dir=tmp_path / "c",
    )
    meta = json.loads((tmp_path / "iv" / "interventions.json").read_text())
    assert meta["runs"][0]["directions"] == "saved probes"
    assert meta["probes"] == str(tmp_path / "fit")
    # a binary probe's direction towards its second class is its weight vector
    p = find(load_probes(tmp_path / "fit"), prefill="recurrent", depth=0)
    first, second = p.meta["classes"]
    vec = class_vectors(p.direction(), p.meta["classes"])
    np.testing.assert_allclose(vec[second] - vec[first], p.direction()[0])
    assert set(df.intervention) == set(REGISTRY)


def test_an_eleventh_intervention_registered_here_runs_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    import probes.intervene.registry as I
    from cli import app

    def double_state(ctx, where):  # every fed-back state twice as long, in the window 'all'
        if where.kind != "window" or where.name != "all" or not ctx.feedback:
            return []
        m = window_mask(where.name, ctx.b)
        return [ctx.state_patch("double_state", where.name, m, 2 * ctx.clean.fed)]

    I.register_intervention("double_state", double_state)
    try:
        assert list(I.REGISTRY)[:10] == [
            "interchange_state",
            "zero_state",
            "mean_state",
            "resample_state",
            "interchange_token",
            "erase_probe",
            "erase_random",
            "steer_probe",
            "steer_random",
            "self",
        ]
        data = tmp_path / "dm.parquet"
        r = CliRunner().invoke(
            app,
            [
                "generate",
                "-t",
                "delayed_memory",
                "--n-groups",
                "8",
                "--distractors",
                "1,5",
                "--twins",
                "--out",
                str(data),
            ],
        )
        assert r.exit_code == 0, r.output
        out = tmp_path / "iv"
        r = CliRunner().invoke(
            app,
            [
                "intervene",
                "--data",
                str(data),
                "--out",
                str(out),
                "--intervention",
                "double_state,self",
            ],
        )
        assert r.exit_code == 0, r.output
        df = pd.read_csv(out / "interventions.csv")
        assert list(dict.fromkeys(df.intervention)) == ["self", "double_state"]
        assert set(df.positions[df.intervention == "double_state"]) == {"all"}
        acc = df[df.metric == "accuracy"].set_index("intervention").value
        assert acc["self"] == 1.0  # the exact check: the default model answers all of these
        assert json.loads((out / "interventions.json").read_text())["interventions"] == [
            "double_state",
            "self",
        ]
        r = CliRunner().invoke(
            app,
            [
                "intervene",
                "--data",
                str(data),
                "--out",
                str(out),
                "--intervention",
                "nope",
                "--force",
            ],
        )
        assert r.exit_code == 1
        assert r.stderr.strip().splitlines() == [
            "error: unknown intervention 'nope'; choose from " + ", ".join(I.REGISTRY)
        ]
    finally:
        I.REGISTRY.remove("double_state")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A fit's probes on the default model (delayed_memory, recurrent), linear and MLP."""
    from typer.testing import CliRunner

    from cli import app

    d = tmp_path_factory.mktemp("use")
    data = generate_dataset(
        "delayed_memory", d / "dm.parquet", n_groups=10, distractors=(1, 5), seed=2, twins=True
    )
    for kind in ("logistic", "mlp"):
        r = CliRunner().invoke(
            app,
            [
                "fit",
                "--data",
                str(data),
                "--prefill",
                "recurrent",
                "--no-controls",
                "--probe",
                kind,
                "--out",
                str(d / kind),
            ],
        )
        assert r.exit_code == 0, r.output
    return d, data


def _edit_index(folder, fn):
    path = folder / "probes" / "probes.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _nan_weights(folder):
    from safetensors.numpy import load_file, save_file

    path = folder / "probes" / "probes.safetensors"
    arrays = load_file(str(path))
    key = next(k for k in arrays if k.endswith("coef"))
    arrays[key][0, 0] = np.nan
    save_file(arrays, str(path))


USES = {
    "another prefill": (
        (),
        ["--prefill", "standard"],
        "has no probe of delayed_memory under prefill standard",
    ),
    "another task": (("task",), ["--prefill", "recurrent"], "has no probe of delayed_memory"),
    "the mlp kind": ("mlp", ["--prefill", "recurrent"], "are mlp probes, which have no direction"),
    "a missing depth": (
        ("depth",),
        ["--prefill", "recurrent"],
        "has no linear probe of delayed_memory under recurrent at depth",
    ),
    "a broken entry": (("classes",), ["--prefill", "recurrent"], "probe 0 has no valid 'classes'"),
    "NaN weights": ("nan", ["--prefill", "recurrent"], "holds NaN or infinite values"),
    "no kind reads them": (
        (),
        ["--prefill", "recurrent", "-i", "interchange_state"],
        "--probes: none of the interventions",
    ),
    "another model": ((), ["--prefill", "recurrent", "--random-init"], "--random-init"),
}


@pytest.mark.parametrize("case", list(USES))
def test_saved_probes_are_checked_against_their_use(fitted, tmp_path, case):
    """Probes fitted for something else, or damaged, are refused in one line naming the file
    (or the option) before any work: never silently refitted."""
    import shutil

    from typer.testing import CliRunner

    from cli import app

    d, data = fitted
    edit, args, msg = USES[case]
    folder = tmp_path / "fit"
    shutil.copytree(d / ("mlp" if edit == "mlp" else "logistic"), folder)
    if edit == "nan":
        _nan_weights(folder)
    elif edit == ("task",):
        _edit_index(folder, lambda doc: [p.update(task="done_tracking") for p in doc["probes"]])
    elif edit == ("depth",):
        _edit_index(
            folder, lambda doc: doc.update(probes=[p for p in doc["probes"] if p["depth"] != 0])
        )
    elif edit == ("classes",):
        _edit_index(folder, lambda doc: doc["probes"][0].update(classes="ZERO"))
    out = tmp_path / "iv"
    r = CliRunner().invoke(
        app, ["intervene", "--data", str(data), "--probes", str(folder), "--out", str(out), *args]
    )
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], lines
    assert not out.exists()

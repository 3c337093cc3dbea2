"""Feedback designs: where the fed-back state comes from (``feedback_source``), where it enters
(``feedback_target``) and how it is fused (``fusion``, ``replace`` included), through the
Jacobi forward, the exact recurrence and decoding."""

from __future__ import annotations

import json

import pytest
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.config import TOP, build_cfg
from fbt_probe.decode import generate_tokens
from fbt_probe.recurrence import run_recurrence
from fbt_probe.stack import FBTModel

T = 10


def model_of(**kw) -> FBTModel:
    return FBTModel(build_cfg(n_layers=4, **kw), seed=1).eval()


def tokens(batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, 60, (batch, T), generator=g)


def test_the_papers_design_is_the_default_and_its_config_hash_is_unchanged():
    from fbt_probe.loading import DEFAULT_MODEL_DIR, resolve_model

    m, _ = resolve_model("default")
    assert m.cfg.feedback_source == TOP and m.cfg.feedback_target == 0
    assert "feedback_source" not in m.cfg.to_dict() and "feedback_target" not in m.cfg.to_dict()
    # its config and weights hash as the code before the designs computed it (extraction
    # caches and saved probes are keyed by it)
    assert model_hash(m) == "047fbdeb59c5458e"
    saved = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert not {"feedback_source", "feedback_target"} & set(saved)


def test_target_0_from_the_top_is_the_fusion_in_front_of_the_whole_stack():
    m = model_of()
    x = tokens()
    with torch.no_grad():
        out = m(x, passes=2)
        # by hand: pass 2's block-0 input is fuse(h_{t-1}, e_t), then every block, the norm
        e = m.embed(x)
        h1 = out.passes[0].states
        prev = torch.cat([torch.zeros_like(h1[:, :1]), h1[:, :-1]], dim=1)
        plain = m.plain_mask(x.shape[0], T, None, x.device)
        r = m.fuse(prev, e, plain)
        for block in m.blocks:
            r = block(r, m.rope)
        h2 = m.ln_final(r)
    assert torch.equal(out.passes[1].states, h2) and torch.equal(out.logits, h2 @ m.W_E.T)


DESIGNS = [
    {"feedback_target": 2},  # top -> block 2 (T2MLR-like)
    {"feedback_source": 2, "feedback_target": 1},  # block 2's output -> block 1
    {"feedback_source": 1, "feedback_target": 2},  # b = a + 1: still causal
    {"feedback_source": 3, "feedback_target": 0},
    {"fusion": "replace"},
    {"fusion": "replace", "feedback_target": 3},
    {"fusion": "additive", "feedback_source": 2, "feedback_target": 2},
]


@pytest.mark.parametrize(
    "design", DESIGNS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items())
)
def test_the_recurrence_is_the_jacobi_fixed_point(design):
    m = model_of(**design)
    x = tokens()
    with torch.no_grad():
        rec = run_recurrence(m, x, prefix_len=2)
        jac = m(x, passes=T + 1, prefix_len=2, keep_all=False)  # exact after T passes
    torch.testing.assert_close(rec.states, jac.states, atol=1e-5, rtol=0)
    torch.testing.assert_close(rec.logits, jac.logits, atol=1e-5, rtol=0)
    # and the feedback is there: two passes differ from one
    assert (m(x, passes=2).logits - m(x, passes=1).logits).abs().max() > 1e-4


def test_a_source_blocks_output_is_what_is_fed_back():
    m = model_of(feedback_source=1, feedback_target=0)
    x = tokens()
    seen = {}

    def keep(t, hook):
        seen[hook.ctx["pass_number"] - 1] = t.detach().clone()

    with torch.no_grad():
        out = m.run_with_hooks(x, passes=2, fwd_hooks=[("blocks.1.hook_resid_post", keep)])
        fused = m.run_with_hooks(x, passes=2, fwd_hooks=[("fusion.hook_state", keep)])
    assert torch.equal(out.passes[0].states, seen[0])
    assert torch.equal(fused.passes[0].states[:, :-1], seen[1][:, 1:])  # shifted by one


def test_decoding_continues_the_recurrence_of_a_design():
    m = model_of(feedback_source=2, feedback_target=1)
    x = tokens(2)
    with torch.no_grad():
        new, states = generate_tokens(m, x[:, :6], "full", max_new_tokens=4, return_states=True)
        whole = run_recurrence(m, torch.cat([x[:, :6], new[:, :3]], dim=1))
    torch.testing.assert_close(states[:, :3], whole.states[:, 5:8], atol=1e-5, rtol=0)


@pytest.mark.parametrize("target", [0, 1, 3])
def test_without_fusion_every_state_intervention_is_a_no_op(target):
    m = model_of(fusion="none", feedback_target=target)
    x = tokens()

    def scramble(t, hook):
        return torch.randn_like(t) * 100

    hooks = [(f"fusion.hook_{n}", scramble) for n in ("state", "gate", "fused")]
    with torch.no_grad():
        clean = m(x, passes=3)
        hit = m.run_with_hooks(x, passes=3, fwd_hooks=hooks)
        rec, rec_hit = run_recurrence(m, x), None
        with m.hooks(fwd_hooks=hooks):
            rec_hit = run_recurrence(m, x)
    assert torch.equal(clean.logits, hit.logits) and torch.equal(rec.logits, rec_hit.logits)
    assert torch.equal(clean.logits, m(x, passes=1).logits)  # every pass is pass 1


def test_replace_feeds_the_state_instead_of_the_token():
    m = model_of(fusion="replace")
    assert m.fusion.W_G is None
    x = tokens()
    got = {}
    with torch.no_grad():
        m.run_with_hooks(
            x,
            passes=2,
            fwd_hooks=[
                (
                    "blocks.0.hook_resid_pre",
                    lambda t, hook: got.setdefault(hook.ctx["pass_number"] - 1, t),
                )
            ],
        )
        h1 = m(x, passes=1).states
        want = m.fusion.norm(h1[:, :-1] @ m.fusion.W_U.T)
    assert torch.equal(got[1][:, 0], m.embed(x)[:, 0])  # no state before the first position
    torch.testing.assert_close(got[1][:, 1:], want, atol=1e-6, rtol=0)
    # the token at t enters only through the state of t-1: change it, the input at t stays
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % 60
    with torch.no_grad():
        h1y = m(y, passes=1).states
    assert torch.equal(h1y[:, :5], h1[:, :5])


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"feedback_target": 4}, "feedback_target must be a block 0..3"),
        ({"feedback_source": 4}, "feedback_source must be -1"),
        ({"feedback_source": 0, "feedback_target": 2}, "above feedback_source 0 \\+ 1: not causal"),
        ({"fusion": "sum"}, "fusion must be one of"),
    ],
)
def test_designs_that_cannot_run_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        build_cfg(n_layers=4, **kw)


STATE_KINDS = ("interchange_state", "zero_state", "mean_state", "resample_state")


@pytest.mark.parametrize("target", [0, 1, 3])
def test_the_battery_without_fusion_moves_nothing_through_the_state(tmp_path, target):
    from probes.common.metrics import summarise
    from probes.intervene.run import run_battery
    from tasks.dataset import load
    from tasks.generate import generate_dataset

    m = model_of(fusion="none", feedback_target=target)
    path = generate_dataset(
        "done_tracking",
        tmp_path / "dt.parquet",
        n_groups=8,
        distractors=(1, 4),
        seed=11,
        twins=True,
    )
    rec, pairs, _ = run_battery(m, load(path), "recurrent", kinds=STATE_KINDS, cache_dir=None)
    df = summarise(rec, pairs, "done_tracking", "recurrent", 0)
    rows = df[df.intervention.isin(STATE_KINDS)]
    assert set(rows.intervention) == set(STATE_KINDS)
    # a patched state that never enters leaves every answer as it was: no flips, and the
    # whole clean logit difference kept, at every site and window
    flips, kept = rows[rows.metric == "flip_rate"], rows[rows.metric == "logit_diff"]
    assert len(flips) >= 4 and (flips.value == 0).all()
    assert len(kept) >= 4 and ((kept.value - 1.0).abs() < 1e-6).all()


def test_the_battery_runs_on_a_design_that_feeds_a_middle_block(tmp_path):
    from probes.common.metrics import summarise
    from probes.intervene.run import run_battery
    from tasks.dataset import load
    from tasks.generate import generate_dataset

    m = model_of(feedback_source=3, feedback_target=2)
    path = generate_dataset(
        "done_tracking",
        tmp_path / "dt.parquet",
        n_groups=8,
        distractors=(1, 4),
        seed=11,
        twins=True,
    )
    for prefill in ("recurrent", "full"):
        rec, pairs, info = run_battery(m, load(path), prefill, kinds=STATE_KINDS, cache_dir=None)
        df = summarise(rec, pairs, "done_tracking", prefill, 0)
        assert set(df.intervention) >= set(STATE_KINDS) and info["patched_runs"] > 0


def test_training_a_design_and_refusing_it_on_a_hugging_face_model(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from fbt_probe.hf.tiny import model_folder
    from fbt_probe.loading import resolve_model

    args = [
        "train",
        "-c",
        "tiny",
        "--set",
        "steps=4",
        "--set",
        "model.feedback_target=1",
        "--set",
        "model.fusion=replace",
    ]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    m, _ = resolve_model(str(tmp_path / "run"))
    assert (m.cfg.feedback_target, m.cfg.fusion) == (1, "replace")
    base = model_folder(tmp_path / "llama", "llama")
    r = CliRunner().invoke(app, [*args, "--init-from", str(base), "--out", str(tmp_path / "hf")])
    assert r.exit_code == 1 and not (tmp_path / "hf").exists()
    assert r.stderr.strip().splitlines() == [
        "error: model.feedback_source and model.feedback_target: a Hugging Face model feeds its "
        "top state into its embeddings only"
    ]


def test_fit_reads_the_probe_at_the_designs_entry_depth(tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from cli import app
    from fbt_probe.checkpoint import save_model
    from probes.common.probe_results import layer0_table
    from probes.report.markdown import write_report
    from tasks.generate import generate_dataset

    cfg = build_cfg(n_layers=3, n_heads=2, d_model=32, n_ctx=320, feedback_target=1)
    save_model(FBTModel(cfg, seed=2), tmp_path / "m")
    data = generate_dataset(
        "delayed_memory", tmp_path / "d.parquet", n_groups=12, distractors=(1, 4), seed=3
    )
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(tmp_path / "m"),
            "--data",
            str(data),
            "--out",
            str(out),
            "-p",
            "standard,recurrent",
            "--folds",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "depth 1 (block 1's input, where the feedback enters) at the colon" in r.output
    assert json.loads((out / "probe_results.json").read_text())["entry_depth"] == 1
    df = pd.read_csv(out / "probe_results.csv")
    table = layer0_table(df, 1)
    row = table[table.prefill == "recurrent"].iloc[0]
    want = df[
        (df.depth == 1)
        & (df.prefill == "recurrent")
        & (df.model == "trained")
        & (df.distractors == "1-256")
    ].accuracy.iloc[0]
    assert row.accuracy == want and row.paper == ""  # the paper's numbers are layer 0's
    text = write_report(out).read_text()
    assert "## Depth 1 at the colon, where this design's feedback enters" in text


def test_stability_of_a_model_without_feedback_is_a_constant_map():
    from fbt_probe.kernels.stability import heldout_batch, jacobi_trajectory

    m = FBTModel(build_cfg(n_layers=2, n_ctx=320, fusion="none"), seed=0).eval()
    batch = heldout_batch(("delayed_memory",), 4)
    rows = jacobi_trajectory(m, batch, 3, lipschitz_at=(2, 3))
    assert rows[1]["lipschitz"] == 0.0  # the map from states to states reads no state
    assert all(r["delta_mean"] == 0 for r in rows[1:])  # every pass is pass 1

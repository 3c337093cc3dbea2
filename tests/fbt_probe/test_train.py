"""Training: the multi-pass objective, schedules, resumption, divergence, eval."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fbt_probe.train.objective as O
import fbt_probe.train.state as T
import fbt_probe.train.steps as S
from cli import app
from fbt_probe.batch import make_batch
from fbt_probe.checkpoint import load_model
from fbt_probe.kernels.evaluate import evaluate
from fbt_probe.runtime.device import resolve_device
from fbt_probe.stack import FBTModel
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.loop import train
from fbt_probe.train.objective import multipass_loss
from fbt_probe.train.recipes import named_config
from fbt_probe.train.steps import lr_at, plan_of
from tasks import get_task

TASKS3 = {"delayed_memory": 1.0, "done_tracking": 1.0, "multi_register": 1.0}


def tiny(**kw):
    """The tiny recipe with changes; ``group__key`` stands for ``group.key``."""
    return named_config("tiny").with_overrides({k.replace("__", "."): v for k, v in kw.items()})


def one_phase(passes=(0.3, 0.5, 0.2), **more):
    """A schedule of one phase: these pass weights, all three tasks, counts up to 64."""
    return [{"until": 1.0, "tasks": TASKS3, "passes": list(passes), "n_max": 64, **more}]


def test_learning_rate_schedule():
    cfg = TrainConfig.from_dict(
        {"steps": 1000, "optim": {"warmup_steps": 100, "lr": 1e-3, "min_lr_frac": 0.1}}
    )
    assert lr_at(cfg, 0) == pytest.approx(1e-5) and lr_at(cfg, 99) == pytest.approx(1e-3)
    assert lr_at(cfg, 999) == pytest.approx(1e-4, rel=1e-3)


def test_deep_pass_batches_draw_long_counts():
    from fbt_probe.train.steps import step_examples

    cfg = TrainConfig.from_dict({"deep_batches": {"passes": 4, "batch_size": 8, "n_min": 100}})
    s = cfg.stream()
    step = int(0.9 * cfg.steps)
    plan = plan_of(cfg, step)
    width = s.width
    for passes in (1, 2, 3):  # shallow: the plain batch
        got = step_examples(cfg, s, step, plan, passes, 0)
        assert [e.prompt for e in got] == [
            e.prompt for e in s.batch(step, cfg.data.batch_size, plan.tasks, plan.n_max)
        ]
    counts = []
    for i in range(40):
        deep = step_examples(cfg, s, step + i % 50, plan, 4 + i % 9, 0)
        assert len(deep) == 8
        n = [e.n_distractors for e in deep]
        assert 100 - width // 2 <= min(n) and max(n) <= 256 and max(n) - min(n) <= width
        counts += n
    assert np.mean(counts) > 150  # about uniform on [100, 256]; plain batches' mean is ~128
    # n_min above n_max: the count is n_max's neighbourhood, never above
    small = cfg.with_overrides({"schedule.0.n_max": 8})
    early = [e.n_distractors for e in step_examples(small, s, 0, plan_of(small, 0), 6, 0)]
    assert max(early) <= 8
    off = cfg.with_overrides({"deep_batches.passes": 0})
    assert len(step_examples(off, s, step, plan, 12, 0)) == cfg.data.batch_size
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    for bad in ({"deep_batches.passes": -1}, {"deep_batches.batch_size": 0}):
        with pytest.raises(ValueError, match="deep_batches"):
            cfg.with_overrides(bad)


def test_fixed_point_batches():
    from fbt_probe.stack import FBTModel
    from fbt_probe.train.objective import warm_states
    from fbt_probe.train.steps import fixed_point_draw

    sched = [
        {"until": 0.5, "tasks": TASKS3, "passes": [1.0], "n_max": 16},
        {"until": 1.0, "fixed_point": 0.3},
    ]
    cfg = tiny(steps=400, schedule=sched, fixed_point__warm=[3, 6], fixed_point__passes=2)
    draws = [fixed_point_draw(cfg, s, plan_of(cfg, s).fixed_point) for s in range(cfg.steps)]
    assert not any(draws[:200])  # none in the first phase
    late = [d for d in draws[200:] if d]
    assert 0.2 < len(late) / 200 < 0.4 and set(late) == {3, 4, 5, 6}
    assert draws == [fixed_point_draw(cfg, s, plan_of(cfg, s).fixed_point) for s in range(400)]
    assert not any(fixed_point_draw(cfg, s, 0.0) for s in range(400))
    # the loss: passes 4 and 5 of a 5-pass forward, weighted as passes 4 and 5, with no
    # gradient into the three warm passes
    cfg = cfg.with_overrides({"objective.answer_weight": [2.0, 3.0, 5.0, 7.0, 11.0]})
    model = FBTModel(replace(cfg.model, jitter=0.0), seed=0).train()
    b = make_batch(get_task("done_tracking").generate(4, (3, 9), seed=0))
    init = warm_states(model, b, 3)
    assert model.training and not init.requires_grad
    total, stats = multipass_loss(model, b, 2, cfg, None, init, first_pass=3)
    out = model(b.tokens, passes=5, lengths=b.lengths)
    valid = (b.targets != -100).float()
    ref = 0.0
    for k in (3, 4):
        ce = torch.nn.functional.cross_entropy(
            out.passes[k].logits.flatten(0, 1), b.targets.flatten().clamp(min=0), reduction="none"
        ).view_as(b.targets)
        w = valid + b.answer.float() * (cfg.objective.answer_weight[k] - 1.0)
        ref += float((ce * w).sum().detach() / w.sum())
    assert total.item() == pytest.approx(ref, rel=1e-5) and len(stats) == 2
    # the gradient stops at the warm passes: it equals that of a loss on detached states
    total.backward()
    g = model.W_E.grad.clone()
    model.zero_grad()
    again, _ = multipass_loss(model, b, 2, cfg, None, init.detach().clone(), first_pass=3)
    again.backward()
    torch.testing.assert_close(model.W_E.grad, g)
    # exact warm states: the sequential recurrence, which T Jacobi passes reach too
    T = b.tokens.shape[1]
    exact = warm_states(model, b, 3, exact=True)
    torch.testing.assert_close(exact, warm_states(model, b, T), atol=2e-5, rtol=1e-4)
    assert (exact - init).abs().max() > 1e-3  # three passes are not there yet
    for bad in (
        {"schedule.1.fixed_point": 1.5},
        {"fixed_point.warm": [0, 3]},
        {"fixed_point.warm": [5, 2]},
        {"fixed_point.passes": 0},
    ):
        with pytest.raises(ValueError, match="fixed_point"):
            cfg.with_overrides(bad)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_training_with_fixed_point_batches_records_them(tmp_path):
    sched = [
        {"until": 0.25, "tasks": TASKS3, "passes": [0.5, 0.5], "n_max": 16},
        {"until": 1.0, "fixed_point": 0.5},
    ]
    cfg = tiny(
        steps=12,
        schedule=sched,
        fixed_point__warm=[2, 4],
        fixed_point__exact=False,
        run__checkpoint_every=6,
    )
    exact = cfg.with_overrides({"steps": 6, "fixed_point.exact": True})
    exact = train(exact, tmp_path / "exact", argv=["test"])
    assert {h.get("fp_warm") for h in exact["history"][2:]} >= {"recurrence"}
    with torch_threads(2):
        train(cfg, tmp_path / "full", argv=["test"])
        train(cfg, tmp_path / "part", stop_after=7, argv=["test"])
        train(cfg, tmp_path / "part", resume=True, argv=["test"])
    hist = json.loads((tmp_path / "full" / "metrics.json").read_text())["history"]
    fp = [h for h in hist if "fp_warm" in h]
    assert fp and all(h["step"] > 3 and 2 <= h["fp_warm"] <= 4 for h in fp)
    assert all(h["passes"] == 2 and "fp/answer_acc" in h and "pass1/loss" not in h for h in fp)
    a = load_model(tmp_path / "full" / "model").state_dict()
    b = load_model(tmp_path / "part" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loss_is_sum_of_per_pass_next_token_losses():
    from fbt_probe.stack import FBTModel

    cfg = tiny(objective__answer_weight=[1.0, 1.0])
    model = FBTModel(cfg.model, seed=0).eval()
    exs = get_task("delayed_memory").generate(4, (3,), seed=0)
    b = make_batch(exs)
    total, stats = multipass_loss(model, b, 2, cfg)
    out = model(b.tokens, passes=2, lengths=b.lengths)
    ref = 0.0
    for p in out.passes:
        ref += torch.nn.functional.cross_entropy(
            p.logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100
        )
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    # the answer target sits right after the colon
    for i, ex in enumerate(exs):
        assert b.answer[i].nonzero().flatten().tolist() == [ex.colon_index]


def test_answer_weight_by_pass():
    # pass k's answer tokens weigh answer_weight[k-1]; the last weight holds for deeper passes
    from fbt_probe.stack import FBTModel

    cfg = tiny(objective__answer_weight=[2.0, 5.0, 9.0])
    model = FBTModel(cfg.model, seed=0).eval()
    b = make_batch(get_task("done_tracking").generate(4, (3, 9), seed=0))
    total, _ = multipass_loss(model, b, 4, cfg)
    out = model(b.tokens, passes=4, lengths=b.lengths)
    valid = (b.targets != -100).float()
    ref = 0.0
    for k, p in enumerate(out.passes):
        ce = torch.nn.functional.cross_entropy(
            p.logits.flatten(0, 1), b.targets.flatten().clamp(min=0), reduction="none"
        ).view_as(b.targets)
        w = valid + b.answer.float() * ((2.0, 5.0, 9.0, 9.0)[k] - 1.0)
        ref += float((ce * w).sum().detach() / w.sum())
    assert total.item() == pytest.approx(ref, rel=1e-5)
    # the two-weight form keeps its meaning: pass 1, then every pass >= 2
    two, _ = multipass_loss(model, b, 4, tiny(objective__answer_weight=[2.0, 5.0]))
    three, _ = multipass_loss(model, b, 4, tiny(objective__answer_weight=[2.0, 5.0, 5.0, 5.0]))
    assert two.item() == pytest.approx(three.item(), rel=1e-6)
    for bad in ([], [1.0, -2.0]):
        with pytest.raises(ValueError, match="answer_weight"):
            tiny(objective__answer_weight=bad)


def test_resume_reaches_the_same_weights(tmp_path):
    cfg = tiny(
        steps=12,
        run__checkpoint_every=4,
        run__eval_every=6,
        objective__prefix_mixin=True,
        schedule=one_phase((0.3, 0.5, 0.2)),
    )
    with torch_threads(2):
        train(cfg, tmp_path / "full", argv=["test"])
        train(cfg, tmp_path / "part", stop_after=5, argv=["test"])
        assert json.loads((tmp_path / "part" / "metrics.json").read_text())["steps_done"] == 5
        train(cfg, tmp_path / "part", resume=True, argv=["test"])
    a = load_model(tmp_path / "full" / "model").state_dict()
    b = load_model(tmp_path / "part" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise, not merely close
    m = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert (
        m["finished"]
        and len(m["history"]) == 12
        and {h["passes"] for h in m["history"]} == {1, 2, 3}
    )
    for f in ("train_config.json", "command.txt", "model/config.json", "model/meta.json"):
        assert (tmp_path / "full" / f).is_file()
    assert "git_revision" in m and m["seed"] == 0
    assert m["threads"] == 2 and m["torch_version"] == torch.__version__


def test_a_smear_held_at_zero_leaves_the_smear_weights_alone_and_resume_keeps_the_ramp(tmp_path):
    cfg = tiny(
        steps=12,
        run__checkpoint_every=3,
        model__smear_keys=True,
        model__smear_spread=2.0,
        schedule=[
            {**one_phase()[0], "until": 0.25, "smear": 0.0},  # steps 0-2: keys plain
            {"until": 1.0, "smear": 1.0, "soft": 0.5, "ramp": ["smear"]},
        ],
    )
    init = FBTModel(cfg.model, seed=0).state_dict()
    with torch_threads(2):
        train(cfg, tmp_path / "early", stop_after=3, argv=["test"])
        train(cfg, tmp_path / "full", argv=["test"])
        train(cfg, tmp_path / "part", stop_after=5, argv=["test"])  # mid-ramp
        train(cfg, tmp_path / "part", resume=True, argv=["test"])
    early = load_model(tmp_path / "early" / "model").state_dict()
    smear = [k for k in init if k.endswith(".smear")]
    assert smear and all(torch.equal(early[k], init[k]) for k in smear)  # no gradient at 0
    assert not torch.equal(early["blocks.0.attn.W_K"], init["blocks.0.attn.W_K"])
    a = load_model(tmp_path / "full" / "model").state_dict()
    b = load_model(tmp_path / "part" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the share comes from the step's plan
    assert not all(torch.equal(a[k], init[k]) for k in smear)


@contextmanager
def torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_training_step_is_bitwise_deterministic_on_two_threads():
    """The same batch, passes, prefixes and jitter seed give bitwise the same loss and
    gradients, again and again, with two threads. W_E[tokens]'s backward (index_put_ with
    accumulate) broke this: W_E's gradient differed in the last bits from call to call, and
    two runs of the default recipe ended as different models (docs/history/training-log.md)."""
    cfg = named_config("default")  # the default model's size
    model = FBTModel(cfg.model, seed=0)
    plan = plan_of(cfg, 1600)
    batch = make_batch(cfg.stream().batch(1500, 32, plan.tasks, plan.n_max))
    prefix = torch.arange(32) * 3

    def grads(passes):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss, _ = multipass_loss(model, batch, passes, cfg, prefix)
        loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), g

    with torch_threads(2):
        for passes in (1, 3):
            loss0, g0 = grads(passes)
            assert "W_E" in g0 and (passes == 1 or "fusion.W_U" in g0)
            for _ in range(4):
                loss, g = grads(passes)
                assert torch.equal(loss, loss0)
                assert [n for n in g0 if not torch.equal(g[n], g0[n])] == []


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = tiny(steps=10, run__checkpoint_every=3)
    real = O.multipass_loss
    calls = {"n": 0}

    def poisoned(model, batch, passes, cfg, prefix_len=None, *args, **kwargs):
        calls["n"] += 1
        loss, stats = real(model, batch, passes, cfg, prefix_len, *args, **kwargs)
        return (loss * float("nan") if calls["n"] == 7 else loss), stats

    monkeypatch.setattr(O, "multipass_loss", poisoned)
    with pytest.raises(T.Divergence, match="step 6"):
        train(cfg, tmp_path / "r", argv=["test"])
    st = torch.load(tmp_path / "r" / "state.pt", weights_only=False)
    assert st["step"] == 6 and all(torch.isfinite(v).all() for v in st["model"].values())


def test_divergence_is_judged_per_pass():
    recent = [1.8] * 60
    # a 12-pass batch whose passes are each ordinary (summed loss 12 x 3.3 = 40) is no divergence
    assert not T.diverged(40.0 / 12, recent)
    assert T.diverged(40.0, recent) and T.diverged(float("nan"), recent)
    assert not T.diverged(40.0, recent[:10])  # too little history to judge
    assert not T.diverged(4.0, [0.1] * 60)  # 40x the median but below 5 nats


def test_train_cli_tiny_and_eval_json(tmp_path):
    r = CliRunner().invoke(
        app, ["train", "--config", "tiny", "--out", str(tmp_path / "run"), "--set", "steps=6"]
    )
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(app, ["train", "--config", "tiny", "--out", str(tmp_path / "run")])
    assert r2.exit_code == 1 and "--resume" in r2.stderr
    r3 = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tmp_path / "run"),
            "--json",
            "--n-groups",
            "5",
            "--task",
            "delayed_memory,multi_register",
        ],
    )
    assert r3.exit_code == 0, r3.output
    res = json.loads(r3.stdout)
    assert set(res) == {"delayed_memory", "multi_register"}
    assert set(res["delayed_memory"]) == {"standard", "soft", "fused", "full"}
    row = res["delayed_memory"]["standard"]
    assert "1-256" in row and "256" in row and all(0.0 <= v <= 1.0 for v in row.values())
    # --seed draws another held-out sample: the CLI's numbers are evaluate()'s on that seed
    from fbt_probe.kernels.evaluate import heldout_examples

    assert [e.prompt for e in heldout_examples("multi_register", 5, seed=7)] != [
        e.prompt for e in heldout_examples("multi_register", 5)
    ]
    args = [
        "eval",
        "-m",
        str(tmp_path / "run"),
        "--json",
        "--n-groups",
        "5",
        "-t",
        "multi_register",
    ]
    r4 = CliRunner().invoke(app, [*args, "--modes", "standard", "--seed", "7"])
    assert r4.exit_code == 0, r4.output
    want, _ = evaluate(
        load_model(tmp_path / "run" / "model"), ("multi_register",), ("standard",), 5, seed=7
    )
    assert json.loads(r4.stdout) == want
    r5 = CliRunner().invoke(app, [*args, "--seed", "-1"])
    assert r5.exit_code == 1 and r5.stderr.strip() == "error: --seed must be >= 0"


def test_train_cli_stop_after_then_resume(tmp_path):
    # --stop-after ends a run early with a model; --resume finishes it bitwise as if never stopped
    tiny6 = ["train", "--config", "tiny", "--set", "steps=6"]
    with torch_threads(2):
        r = CliRunner().invoke(app, [*tiny6, "--out", str(tmp_path / "whole")])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, [*tiny6, "--out", str(tmp_path / "p"), "--stop-after", "3"])
        assert r.exit_code == 0 and "trained 3/6 steps" in r.stdout, r.output
        m = json.loads((tmp_path / "p" / "metrics.json").read_text())
        assert m["steps_done"] == 3 and not m["finished"] and len(m["history"]) == 3
        load_model(tmp_path / "p" / "model")  # the stopped run has a usable model
        r = CliRunner().invoke(app, [*tiny6, "--out", str(tmp_path / "p"), "--resume"])
        assert r.exit_code == 0, r.output
    a = load_model(tmp_path / "whole" / "model").state_dict()
    b = load_model(tmp_path / "p" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "p" / "metrics.json").read_text())["finished"]
    assert len((tmp_path / "p" / "command.txt").read_text().splitlines()) == 2
    # a part of a run is never installed as the default; bad values are one line
    r = CliRunner().invoke(
        app, [*tiny6, "--out", str(tmp_path / "q"), "--stop-after", "3", "--as-default"]
    )
    assert r.exit_code == 1 and r.stderr.strip().startswith("error: --as-default needs")
    assert not (tmp_path / "q").exists()
    r = CliRunner().invoke(app, [*tiny6, "--out", str(tmp_path / "q"), "--stop-after", "0"])
    assert r.exit_code != 0 and not (tmp_path / "q").exists()


def test_eval_matches_teacher_forced_pass_logits():
    # standard and fused decoding of a one-word answer equal the argmax of pass 1 / pass 2
    from fbt_probe.stack import FBTModel
    from tasks import vocab

    model = FBTModel(tiny().model, seed=1).eval()
    summary, _ = evaluate(
        model, ("delayed_memory",), ("standard", "fused"), n_groups=6, distractors=(2, 5)
    )
    from fbt_probe.kernels.evaluate import heldout_examples

    exs = heldout_examples("delayed_memory", 6, (2, 5))
    for mode, passes in (("standard", 1), ("fused", 2)):
        ok = []
        for ex in exs:
            x = torch.tensor([vocab.encode(ex.prompt)])
            with torch.no_grad():
                pred = model(x, passes=passes).logits[0, -1].argmax().item()
            ok.append(pred == vocab.TOKEN_TO_ID[ex.answer[0]])
        assert summary["delayed_memory"][mode]["1-256"] == pytest.approx(np.mean(ok))


@pytest.mark.parametrize(
    "bad",
    [
        ["--config", "nope"],
        ["--set", "steps"],
        ["--set", "optim.lr=-1"],
        ["--set", "optim.lr=fast"],
        ["--set", "optim.nope=1"],
        ["--set", "nope=1"],
        ["--set", "lr=0.1"],  # a flat-format key is not a --set key
        ["--set", "schedule.99.n_max=8"],
        ["--set", "schedule.2.until=0.01"],
        ["--set", 'schedule.0.tasks={"nope":1}'],
        ["--set", "data.log_share=2"],
        ["--set", "schedule.0.tasks={}"],
        ["--set", 'data.task_params={"done_tracking":{"need_weights":[1]}}'],
        ["--set", 'schedule.0.frozen=["nope."]'],
        ["--set", 'schedule.0.frozen="blocks.0."'],
        ["--set", 'schedule.0.ramp=["frozen"]'],
        ["--set", "init_from=/no/such/model"],
        ["--set", "deep_batches.batch_size=0"],
        ["--set", "objective.answer_weight=[]"],
        ["--set", 'model.depth_scaling="false"'],
        ["--config", "missing.json"],
        ["--config", "tiny", "--set", "init_from=default"],  # the default is 4 x 128, tiny is not
    ],
)
def test_train_bad_input(tmp_path, bad):
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "x"), *bad])
    assert (
        r.exit_code != 0
        and r.stderr.startswith("error:")
        and len(r.stderr.strip().splitlines()) == 1
    )


def test_init_from_and_freeze(tmp_path):
    base = tiny(steps=6, schedule=one_phase(), run__eval_every=6, run__checkpoint_every=3)
    train(base, tmp_path / "a", argv=["test"])
    a = load_model(tmp_path / "a" / "model").state_dict()
    frozen = ("blocks.0.", "W_E")

    def freeze(*windows):  # phases: (until, frozen?) in order
        return [
            {**one_phase()[0], "until": u, "frozen": list(frozen) if f else []} for u, f in windows
        ]

    # frozen from the start: those weights stay exactly the initial model's, the rest train
    cfg = base.with_overrides(
        {"run.seed": 1, "init_from": str(tmp_path / "a"), "schedule": freeze((1.0, True))}
    )
    train(cfg, tmp_path / "b", argv=["test"])
    b = load_model(tmp_path / "b" / "model").state_dict()
    assert (
        TrainConfig.from_dict(json.loads((tmp_path / "b" / "train_config.json").read_text())) == cfg
    )
    for k in a:
        if k.startswith(frozen):
            assert torch.equal(a[k], b[k]), k
        elif k.endswith(("W_Q", "W_in", "W_U")):
            assert not torch.allclose(a[k], b[k]), k
    # frozen from half-way: trained for steps 0-2, then fixed
    cfg = cfg.with_overrides({"schedule": freeze((0.5, False), (1.0, True))})
    train(cfg, tmp_path / "c", argv=["test"], stop_after=3)
    mid = load_model(tmp_path / "c" / "model").state_dict()
    train(cfg, tmp_path / "c", argv=["test"], resume=True)
    end = load_model(tmp_path / "c" / "model").state_dict()
    assert not torch.allclose(mid["blocks.0.attn.W_Q"], a["blocks.0.attn.W_Q"])
    for k in a:
        assert torch.equal(mid[k], end[k]) == k.startswith(frozen), k
    # frozen for the first half only: fixed through steps 0-2, trained after
    cfg = cfg.with_overrides({"schedule": freeze((0.5, True), (1.0, False))})
    train(cfg, tmp_path / "d", argv=["test"], stop_after=3)
    mid = load_model(tmp_path / "d" / "model").state_dict()
    train(cfg, tmp_path / "d", argv=["test"], resume=True)
    end = load_model(tmp_path / "d" / "model").state_dict()
    for k in a:
        assert torch.equal(mid[k], a[k]) == k.startswith(frozen), k
        assert not torch.equal(mid[k], end[k]), k


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad, msg in (("tpu", "unknown device"), ("meta", "unsupported device"), ("cuda:99", "GPU")):
        with pytest.raises(ValueError, match=msg):
            resolve_device(bad)


def test_train_and_eval_cli_refuse_a_missing_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for cmd in (["train", "--config", "tiny", "--out", str(tmp_path / "run")], ["eval"], ["fit"]):
        r = CliRunner().invoke(app, [*cmd, "--device", "cuda"])
        assert r.exit_code == 1 and r.output.strip().count("\n") == 0
        assert "sees no CUDA GPU" in r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_training_matches_cpu(tmp_path):
    """The same tiny run on the GPU and the CPU: same data and initial weights, so the
    losses agree up to floating-point differences, and the run folder loads on the CPU."""
    # no jitter: its noise comes from the device's own generator, so it differs across devices
    cfg = tiny(steps=12, run__eval_every=6, run__checkpoint_every=6, model__jitter=0.0)
    a = train(cfg, tmp_path / "cpu", device="cpu")
    b = train(cfg, tmp_path / "gpu", device="cuda")
    assert b["device"].startswith("cuda") and a["device"] == "cpu"
    la = [h["loss"] for h in a["history"]]
    lb = [h["loss"] for h in b["history"]]
    np.testing.assert_allclose(lb, la, rtol=2e-3)
    m = load_model(tmp_path / "gpu" / "model")
    assert next(m.parameters()).device.type == "cpu"
    b = make_batch(get_task("done_tracking").generate(4, (0, 5, 40), seed=0))
    with torch.no_grad():
        cpu = m(b.tokens, passes=3, lengths=b.lengths)
        gpu = m.to("cuda")(b.tokens.cuda(), passes=3, lengths=b.lengths.cuda())
    for pc, pg in zip(cpu.passes, gpu.passes, strict=True):
        torch.testing.assert_close(pg.logits.cpu(), pc.logits, atol=2e-3, rtol=1e-3)
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tmp_path / "gpu"),
            "--json",
            "--device",
            "cuda",
            "--n-groups",
            "5",
            "--modes",
            "standard,fused",
        ],
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert set(got) == {"delayed_memory", "done_tracking", "multi_register"}
    assert all(set(v) == {"standard", "fused"} for v in got.values())


def test_length_buckets_partition_the_rows_and_cut_the_padding():
    lengths = [12, 250, 14, 240, 13, 120, 11, 118, 245, 15]
    parts = S.length_buckets(lengths)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all([lengths[i] for i in p] == sorted(lengths[i] for i in p) for p in parts)
    padded = sum(len(p) * max(lengths[i] for i in p) for p in parts)
    assert 1 < len(parts) < len(lengths) and padded < 0.6 * len(lengths) * max(lengths)
    assert S.length_buckets([40] * 8) == [list(range(8))]  # equal lengths: one batch


def _step_grads(cfg, draw):
    from fbt_probe.train.distributed import World

    model = FBTModel(cfg.model, seed=0).train()
    loss, stats, tokens = O.train_step(model, model, draw, cfg, World(), torch.device("cpu"))
    return loss, stats, tokens, {n: p.grad for n, p in model.named_parameters()}


def test_a_length_bucketed_step_equals_the_whole_batch_step():
    """Buckets change only the layout: the loss, the per-pass stats and every gradient are
    those of the step's batch run as one (jitter on: each row keeps its own noise), for a
    plain multi-pass step and for a fixed-point step with exact warm states."""
    cfg = named_config("default")
    stream = cfg.stream()
    plain = S.draw_step(cfg, stream, 1610)  # long counts, two passes
    fixed = next(
        d
        for s in range(2000, 2300)
        if (d := S.draw_step(cfg, stream, s)).warm
        and len(S.length_buckets([len(ex.tokens) for ex in d.examples])) > 1
    )
    whole = cfg.with_overrides({"run.length_buckets": False})
    for draw in (plain, fixed):
        lengths = [len(ex.tokens) for ex in draw.examples]
        assert len(S.length_buckets(lengths)) > 1
        l0, s0, n0, g0 = _step_grads(whole, draw)
        l1, s1, n1, g1 = _step_grads(cfg, draw)
        assert n0 == n1 == sum(lengths)
        assert abs(l1 - l0) <= 1e-5 * abs(l0)
        for a, b in zip(s0, s1, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 for k in a)
        assert g0.keys() == g1.keys()
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-4)


def test_jitter_noise_depends_on_the_row_not_on_the_split():
    from fbt_probe.train.steps import JitterNoise

    a, b = JitterNoise(7, 20, 4), JitterNoise(7, 20, 4)
    whole = a.take(1, torch.arange(6), 20)
    assert torch.equal(b.take(1, torch.tensor([4, 1]), 9), whole[[4, 1], :9])
    assert not torch.equal(a.take(0, torch.arange(6), 20), whole)  # each pass its own noise
    assert not torch.equal(JitterNoise(8, 20, 4).take(1, torch.arange(6), 20), whole)

"""Recipes as data: the schedule of phases, recipe files, partial files, the flat-format
migration, and the training stream of every shipped recipe, step by step."""

from __future__ import annotations

import functools
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from fbt_probe.train.config import TrainConfig
from fbt_probe.train.recipes import load_recipe, named_config, recipe_names
from fbt_probe.train.schedule import Phase, plan_at, table, validate
from fbt_probe.train.steps import plan_of, stream_digest

DATA = Path(__file__).parents[1] / "data"
DIGESTS = json.loads((DATA / "stream_digests.json").read_text())
T3 = {"delayed_memory": 1.0, "done_tracking": 1.0, "multi_register": 1.0}


def phases(*dicts):
    return TrainConfig.from_dict({"schedule": list(dicts)}).schedule


# ---- the schedule ------------------------------------------------------------------------
def test_sharp_and_ramped_values_and_ramps_across_phases():
    s = phases(
        {"until": 0.1, "tasks": {"delayed_memory": 1.0}, "passes": [1], "n_max": 8},
        {"until": 0.3, "tasks": {"done_tracking": 1.0}, "frozen": ["W_E"]},  # sharp
        {"until": 0.5, "passes": [0.5, 0.5], "ramp": True},  # ramps from 0.1 across two phases
        {"until": 0.6, "n_max": 8},  # marks where the next ramp starts
        {"until": 1.0, "n_max": 208, "overwrites": 2, "fixed_point": 0.2, "ramp": ["n_max"]},
    )
    at = lambda f: plan_at(s, f)  # noqa: E731
    assert at(0.0).phase == 0 and at(0.0999).phase == 0 and at(0.1).phase == 1
    np.testing.assert_allclose(at(0.05).tasks, [1, 0])  # tasks in sorted order
    np.testing.assert_allclose(at(0.1).tasks, [0, 1])  # sharp at the phase's start
    assert at(0.05).frozen == () and at(0.1).frozen == ("W_E",) and at(0.7).frozen == ("W_E",)
    np.testing.assert_allclose(at(0.05).passes, [1, 0])
    np.testing.assert_allclose(at(0.2).passes, [0.875, 0.125])  # a quarter of the way
    np.testing.assert_allclose(at(0.5).passes, [0.5, 0.5])
    assert [at(f).n_max for f in (0.0, 0.55, 0.6, 0.8, 0.9)] == [8, 8, 8, 108, 158]
    # a value set without ramp starts sharply; before any phase sets it, it is unset
    assert at(0.59).overwrites is None and at(0.6).overwrites == 2
    assert at(0.59).fixed_point == 0.0 and at(0.6).fixed_point == 0.2


def test_overwrites_ramp_one_by_one_and_zero_length_phases():
    s = phases(
        {"until": 0.0, "overwrites": 0, "n_max": 0},  # no steps: where the ramps start
        {
            "until": 0.3,
            "tasks": T3,
            "passes": [1],
            "overwrites": 3,
            "n_max": 30,
            "ramp": ["overwrites", "n_max"],
        },
        {"until": 1.0},
    )
    got = [plan_at(s, f).overwrites for f in (0.0, 0.09, 0.1, 0.19, 0.2, 0.29, 0.3, 0.9)]
    assert got == [1, 1, 2, 2, 3, 3, 3, 3]  # equal thirds, each new value at its start
    assert [plan_at(s, f).n_max for f in (0.0, 0.15, 0.3)] == [0, 15, 30]
    assert plan_at(s, 0.0).phase == 1  # the zero-length phase is never active


def test_soft_and_smear_ramp_and_the_soft_share_plains_whole_prompts():
    sched = [
        {"until": 0.2, "tasks": T3, "passes": [0, 1], "n_max": 8, "smear": 0.0},
        {"until": 0.4, "smear": 1.0, "ramp": ["smear"]},
        {"until": 0.5, "soft": 0.0},
        {"until": 1.0, "soft": 0.6, "ramp": ["soft"]},
    ]
    cfg = TrainConfig.from_dict(
        {
            "steps": 200,
            "model": {"smear_keys": True},
            "objective": {"prefix_mixin": False},
            "schedule": sched,
        }
    )
    s = cfg.schedule
    at = lambda f: plan_at(s, f)  # noqa: E731
    assert [at(f).smear for f in (0.0, 0.19, 0.2, 0.3, 0.5)] == pytest.approx([0, 0, 0, 0.5, 1])
    assert [at(f).soft for f in (0.0, 0.49, 0.5, 0.75)] == pytest.approx([0, 0, 0, 0.3])
    # before any phase sets them: no soft examples, the smear as learned
    bare = phases({"until": 1.0, "tasks": T3, "passes": [1], "n_max": 8})
    assert (plan_at(bare, 0.5).soft, plan_at(bare, 0.5).smear) == (0.0, 1.0)
    from fbt_probe.train.steps import draw_step

    stream, whole, plain, n = cfg.stream(), 0, 0, 0
    for step in range(200):
        d = draw_step(cfg, stream, step)
        if step < 100:  # soft 0 until 0.5: nothing drawn
            assert d.prefix is None
            continue
        colon = np.array([ex.colon_index + 1 for ex in d.examples])
        prefix = np.zeros(len(colon), int) if d.prefix is None else d.prefix  # soft 0 at 0.5
        assert set(np.unique(prefix)) <= {0} | set(colon)  # the whole prompt, or nothing
        whole += int((prefix == colon).sum())
        plain += int((prefix == 0).sum())
        n += len(colon)
    # the share rises from 0 to 0.6 over the second half: 0.3 on average
    assert whole + plain == n and 0.25 < whole / n < 0.35
    with pytest.raises(ValueError, match="sets smear, which needs model.smear_keys = true"):
        TrainConfig.from_dict({"schedule": sched})


@pytest.mark.parametrize(
    "bad,msg",
    [
        ([], "at least one phase"),
        (
            [{"until": 1.0, "tasks": T3, "passes": [1], "n_max": 8, "soft": 1.5}],
            r"schedule\[0\].soft is a share in \[0, 1\]",
        ),
        (
            [
                {"until": 0.5, "tasks": T3, "passes": [1], "n_max": 8, "smear": 0.0},
                {"until": 1.0, "smear": 0.5, "ramp": ["smear"]},
            ],
            "smear must end at 1",
        ),
        ([{"until": 0.5, "tasks": T3, "passes": [1], "n_max": 8}], "last phase must end at 1"),
        (
            [{"until": 0.5, "tasks": T3, "passes": [1], "n_max": 8}, {"until": 0.4}],
            r"schedule\[1\].until must be in \[0.5, 1\]",
        ),
        ([{"until": 1.0, "tasks": T3, "passes": [1]}], "sets 'n_max'"),
        (
            [{"until": 1.0, "tasks": T3, "passes": [1], "n_max": 8, "ramp": True}],
            "no earlier phase sets",
        ),
        (
            [{"until": 1.0, "tasks": T3, "passes": [1], "n_max": 300}],
            r"schedule\[0\].n_max must be in 0..256",
        ),
        ([{"until": 1.0, "tasks": T3, "passes": [0, 0], "n_max": 8}], "passes needs"),
        (
            [{"until": 1.0, "tasks": T3, "passes": [1], "n_max": 8, "ramp": ["frozen"]}],
            "only tasks, passes",
        ),
        (
            [{"until": 1.0, "tasks": T3, "passes": [1], "n_max": 8, "colour": 1}],
            r"unknown key 'schedule\[0\].colour'",
        ),
        (
            [{"until": 1.0, "tasks": {"nope": 1}, "passes": [1], "n_max": 8}],
            "unknown task 'nope'",
        ),
        (
            [{"until": 1.0, "tasks": {"done_tracking": "x"}, "passes": [1], "n_max": 8}],
            r"schedule\[0\].tasks.done_tracking must be a number",
        ),
        (
            [{"until": "late", "tasks": T3, "passes": [1], "n_max": 8}],
            r"schedule\[0\].until must be a number",
        ),
    ],
)
def test_bad_schedules_are_one_line_errors_that_name_the_phase(bad, msg):
    with pytest.raises(ValueError, match=msg) as e:
        TrainConfig.from_dict({"schedule": bad})
    assert "\n" not in str(e.value)


def test_the_default_schedule_reads_as_phases():
    cfg = named_config("default")
    assert len(fields(TrainConfig)) <= 12
    assert all(isinstance(p, Phase) for p in cfg.schedule) and len(cfg.schedule) >= 5
    validate(cfg.schedule)
    # what the phases say: done_tracking first with blocks 1-3 and W_E frozen, multi_register
    # at short counts, then the mixture and long counts, less multi_register at the end
    first, late = plan_of(cfg, 0), plan_of(cfg, cfg.steps - 1)
    assert cfg.tasks == ["delayed_memory", "done_tracking", "multi_register"]
    np.testing.assert_allclose(first.tasks, np.array([0.5, 3.0, 0.0]) / 3.5)
    assert first.frozen == ("blocks.1.", "blocks.2.", "blocks.3.", "W_E") and first.n_max == 8
    assert plan_of(cfg, int(0.11 * cfg.steps)).frozen == ()
    np.testing.assert_allclose(
        plan_of(cfg, int(0.3 * cfg.steps)).tasks, np.array([0.4, 0.1, 1.0]) / 1.5
    )
    np.testing.assert_allclose(late.tasks, np.array([0.5, 3.0, 0.35]) / 3.85)
    assert late.n_max == 256 and late.fixed_point == 0.3 and plan_of(cfg, 1200).fixed_point == 0.0
    assert first.passes[0] == 1.0 and plan_of(cfg, int(0.25 * cfg.steps)).passes[0] > 0.5
    assert [plan_of(cfg, int(f * cfg.steps)).overwrites for f in (0.19, 0.41)] == [0, 3]
    # the printed table is the config itself: one row a phase, every why in it
    t = table(cfg.schedule)
    assert len(t.splitlines()) == len(cfg.schedule) + 2
    assert all(p.why in t for p in cfg.schedule)


# ---- the training stream of every recipe, step by step -----------------------------------
@functools.cache
def _digest(cfg_json: str) -> dict:
    return stream_digest(TrainConfig.from_dict(json.loads(cfg_json)))


def digest_of(cfg: TrainConfig) -> dict:
    """``stream_digest(cfg)``, drawn once per distinct configuration in a test session (the
    shipped model's config is the default recipe's: its stream is drawn once, not twice)."""
    return _digest(json.dumps(cfg.to_dict(), sort_keys=True))


@pytest.mark.parametrize("name", sorted(DIGESTS))
def test_recipe_files_draw_the_recorded_training_stream(name):
    # recorded from the flat-format trainer before the schedule became phases: the batches,
    # pass counts, prefix lengths, frozen set, fixed-point steps, jitter seeds and learning rate
    # of every step
    got = digest_of(named_config(name))
    assert got["per_100_steps"] == DIGESTS[name]["per_100_steps"]
    assert got["digest"] == DIGESTS[name]["digest"]


def test_a_flat_config_of_version_0_1_gets_one_line_saying_what_to_do(tmp_path):
    flat = {"name": "old", "steps": 100, "pass_mix": [0.75, 0.22, 0.03], "lr": 2e-3}
    with pytest.raises(ValueError, match=r"flat format of fbt-probe 0.1 \(pass_mix, ...\)"):
        TrainConfig.from_dict(flat)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(flat))
    r = CliRunner().invoke(app, ["recipe", str(path)])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "error: recipe old is in the flat format of fbt-probe 0.1 (pass_mix, ...), which "
        "fbt-probe 0.2 no longer reads: write it as a recipe of groups and phases "
        "(docs/training.md)"
    ]


def test_the_shipped_default_model_folder_loads_its_config():
    from fbt_probe.loading import DEFAULT_MODEL_DIR

    d = json.loads((DEFAULT_MODEL_DIR / "train_config.json").read_text())
    cfg = TrainConfig.from_dict(d)
    assert digest_of(cfg)["digest"] == DIGESTS["default"]["digest"]


# ---- recipe files ------------------------------------------------------------------------
def test_builtin_recipes_and_the_neutral_code_defaults():
    assert recipe_names()[0] == "default"
    assert set(recipe_names()) == {
        "default",
        "D",
        "paper",
        "no-three-pass",
        "additive",
        "three-tasks",
        "tiny",
        "paper-1b",
        "upcycle",
        "single-pass-window",
        "smeared-keys",
        "upcycle-smollm2",
        "upcycle-smollm2-lora",
        "generation",
        *(f"design-{d}" for d in ("paper", "top-to-2", "2-to-1", "replace", "additive", "none")),
    }
    for n in recipe_names():
        assert named_config(n).name == n
    # the generation model's recipe trains the generated-answer tasks only
    gen = named_config("generation").to_dict()
    assert set(gen["schedule"][0]["tasks"]) == {"count_steps", "recall_bits"}
    # the design comparison: one schedule, seed and budget; only the feedback differs
    designs = {n: named_config(n).to_dict() for n in recipe_names() if n.startswith("design-")}
    feedback = ("fusion", "feedback_source", "feedback_target")
    rest = [
        {**d, "name": "", "model": {k: v for k, v in d["model"].items() if k not in feedback}}
        for d in designs.values()
    ]
    assert all(r == rest[0] for r in rest) and designs["design-paper"]["steps"] == 600
    assert len({tuple(d["model"][k] for k in feedback) for d in designs.values()}) == 6
    # the code defaults: the paper's objective, one phase, no tuned mechanism
    c = TrainConfig()
    assert len(c.schedule) == 1 and tuple(c.schedule[0].passes) == (0.75, 0.22, 0.03)
    assert c.objective.prefix_mixin and c.objective.answer_weight == (1.0,)
    assert c.deep_batches.passes == 0 and plan_at(c.schedule, 0.9).fixed_point == 0.0
    assert c.model.jitter == 0.02 and c.model.n_heads == 4
    # paper, no-three-pass, additive are D with one change each
    d, paper = named_config("D"), named_config("paper")
    assert paper.schedule[2].passes == (0.75, 0.22, 0.03) and paper.objective.prefix_mixin
    assert (
        paper.with_overrides(
            {
                "name": "D",
                "schedule.2.passes": list(d.schedule[2].passes),
                "objective.prefix_mixin": False,
            }
        )
        == d
    )
    assert named_config("additive").model.fusion == "additive"


def test_a_partial_file_changes_its_base_and_switches_nothing_off(tmp_path):
    f = tmp_path / "short.json"
    f.write_text('{"steps": 500}')
    cfg = load_recipe(str(f))
    default = named_config("default")
    assert cfg.name == "short" and cfg.steps == 500
    assert cfg.with_overrides({"name": "default", "steps": default.steps}) == default
    assert cfg.deep_batches.passes == 4 and plan_of(cfg, 499).fixed_point == 0.3
    # TOML, another base, a group merged key by key, a dotted key into one phase
    t = tmp_path / "mine.toml"
    t.write_text(
        'base = "D"\nname = "mine"\n"schedule.3.n_max" = 64\n[optim]\nlr = 1e-3  # slower\n'
    )
    mine = load_recipe(str(t))
    d = named_config("D")
    assert mine.optim.lr == 1e-3 and mine.optim.warmup_steps == d.optim.warmup_steps
    assert plan_of(mine, mine.steps - 1).n_max == 64 and mine.schedule[:3] == d.schedule[:3]
    # a base that is a file
    (tmp_path / "on_mine.toml").write_text(f'base = "{t}"\nsteps = 10\n')
    assert load_recipe(str(tmp_path / "on_mine.toml")).optim.lr == 1e-3


@pytest.mark.parametrize(
    "text,msg",
    [
        ('{"stepz": 5}', "unknown key 'stepz'"),
        ('{"optim": {"lr": "fast"}}', "optim.lr must be a number, got 'fast'"),
        ('{"model": {"depth_scaling": "false"}}', "model.depth_scaling must be true or false"),
        ('{"base": "nope"}', "unknown config 'nope'"),
        ('{"steps": 5', "is not valid JSON"),
        ("[1, 2]", "must hold an object"),
        ('{"schedule": {"until": 1}}', "schedule must be a list of phases"),
        ('{"run": 3}', "run must be an object"),
    ],
)
def test_bad_recipe_files_are_one_line_errors(tmp_path, text, msg):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        load_recipe(str(f))
    assert "\n" not in str(e.value)


def test_a_cycle_of_bases_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text(f'base = "{tmp_path / "b.toml"}"\n')
    (tmp_path / "b.toml").write_text(f'base = "{tmp_path / "a.toml"}"\n')
    with pytest.raises(ValueError, match="cycle"):
        load_recipe(str(tmp_path / "a.toml"))


# ---- the command line --------------------------------------------------------------------
def test_train_cli_with_a_recipe_file_and_dotted_set(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('base = "tiny"\nsteps = 4\n[run]\neval_every = 2\n')
    out = tmp_path / "run"
    r = CliRunner().invoke(
        app, ["train", "--config", str(f), "--set", "optim.lr=1e-3", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    saved = TrainConfig.from_dict(json.loads((out / "train_config.json").read_text()))
    assert saved.optim.lr == 1e-3 and saved.steps == 4 and saved.name == "r"
    assert saved == load_recipe(str(f)).with_overrides({"optim.lr": 1e-3})
    m = json.loads((out / "metrics.json").read_text())
    assert m["finished"] and m["max_minutes"] == 0.0
    # the run folder's own config resumes it, named or not
    r = CliRunner().invoke(
        app, ["train", "--config", str(out / "train_config.json"), "--out", str(out), "--resume"]
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["train", "--out", str(out), "--resume"])
    assert r.exit_code == 0 and "trained 4/4 steps" in r.stdout, r.output
    # another recipe, or nothing to resume, is a one-line error that leaves nothing behind
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out), "--resume"])
    assert r.exit_code == 1 and "different config" in r.stderr
    fresh = tmp_path / "fresh"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(fresh), "--resume"])
    assert (
        r.exit_code == 1
        and r.stderr.strip() == f"error: nothing to resume: {fresh} has no checkpoint (state.pt)"
    )
    assert not fresh.exists()


def test_train_cli_tiny_out_and_show(tmp_path):
    out = tmp_path / "X"
    r = CliRunner().invoke(app, ["train", "--config", "tiny", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "metrics.json").read_text())["steps_done"] == 40
    shown_out = tmp_path / "shown"
    r = CliRunner().invoke(app, ["recipe", "--set", "schedule.0.n_max=16"])
    assert r.exit_code == 0 and not shown_out.exists(), r.output
    shown = json.loads(r.stdout[: r.stdout.index("\n\n| phase")])
    assert shown["schedule"][0]["n_max"] == 16 and "| phase | until |" in r.stdout
    # the wall-clock cap belongs to the run: a cap this small stops after the first step
    r = CliRunner().invoke(
        app, ["train", "-c", "tiny", "--out", str(tmp_path / "cap"), "--max-minutes", "1e-9"]
    )
    assert r.exit_code == 0 and "trained 1/40 steps" in r.stdout, r.output
    r = CliRunner().invoke(
        app, ["train", "-c", "tiny", "--out", str(tmp_path / "y"), "--max-minutes", "-1"]
    )
    assert r.exit_code != 0 and not (tmp_path / "y").exists()


# ---- the documentation is the config, printed --------------------------------------------
def test_training_guide_shows_the_default_schedule_and_a_working_example(tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    assert len(doc.splitlines()) <= 250 and "session" not in doc.lower()
    start = doc.index("<!-- the default schedule")
    shown = doc[doc.index("\n", start) + 1 : doc.index("<!-- end of the default schedule")]
    assert shown.strip() == table(named_config("default").schedule)
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "short_lr.toml").write_text(example)
    cfg = load_recipe(str(tmp_path / "short_lr.toml"))
    assert cfg.steps == 1200 and cfg.optim.lr == 1e-3 and plan_of(cfg, 1199).n_max == 128


def test_smeared_keys_is_the_default_with_smeared_keys():
    sk, d = named_config("smeared-keys"), named_config("default")
    over = {"name": "smeared-keys", "model.smear_keys": True, "model.smear_spread": 6.0}
    assert sk == d.with_overrides(over)
    assert not d.model.smear_keys and sk.model.jitter == d.model.jitter == 0.5
    assert all(sk.model.smears(i) for i in range(4)) and not d.model.smears(0)


def test_single_pass_window_is_the_default_with_single_pass_batches_until_0_4():
    spw, d = named_config("single-pass-window"), named_config("default")
    changes = {"name": "single-pass-window", "schedule.2.passes": [1], "schedule.3.passes": [1]}
    assert spw == d.with_overrides(changes)
    for f in (0.05, 0.15, 0.3, 0.399):
        assert np.asarray(plan_at(spw.schedule, f).passes)[0] == 1.0
        assert np.asarray(plan_at(d.schedule, f).passes)[0] < 1.0 or f < 0.11
    mid = np.asarray(plan_at(spw.schedule, 0.42).passes)  # ramping to the default's mix
    assert 0.15 < mid[0] < 1.0
    for f in (0.44, 0.6, 0.9):
        assert np.array_equal(plan_at(spw.schedule, f).passes, plan_at(d.schedule, f).passes)

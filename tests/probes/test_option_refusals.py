"""Options refused before any work, on every verb: one line naming the option, a non-zero exit,
no traceback, nothing new in the output folder."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from tasks.generate import generate_dataset
from tests.refusals import console, files_under, one_line_error, small_dataset, snapshot


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
        app, ["fit", "--model", str(model_dir), "--prefill", "k5000", "--out", str(out)]
    )
    one_line_error(r, "unknown prefill 'k5000'")
    assert files_under(out) == []


# every list option goes through one parser (fbt_probe.util.lists): an item named twice is refused in
# one line naming the option, before any work
@pytest.mark.parametrize(
    "argv,culprit",
    [
        (
            ["fit", "-p", "standard,standard", "--task", "delayed_memory"],
            "--prefill 'standard,standard': standard is named twice",
        ),
        (
            ["fit", "--task", "delayed_memory,delayed_memory"],
            "--task 'delayed_memory,delayed_memory': delayed_memory is named twice",
        ),
        (["eval", "--modes", "soft,soft"], "--modes 'soft,soft': soft is named twice"),
        (["eval", "--task", "done_tracking, done_tracking"], "done_tracking is named twice"),
        (
            ["intervene", "--intervention", "self,self"],
            "--intervention 'self,self': self is named twice",
        ),
        (["intervene", "--depths", "0,1,0"], "--depths '0,1,0': 0 is named twice"),
        (["patch", "--kinds", "resid,resid"], "--kinds 'resid,resid': resid is named twice"),
        (["patch", "--depths", "1,1"], "--depths '1,1': 1 is named twice"),
        (
            ["attribute", "--kinds", "head,state,head"],
            "--kinds 'head,state,head': head is named twice",
        ),
        (["lens", "--task", "done_tracking,done_tracking"], "done_tracking is named twice"),
        (
            ["trajectory", "--task", "multi_register,multi_register"],
            "multi_register is named twice",
        ),
        (
            ["generate", "--task", "delayed_memory", "--distractors", "0-8,4"],
            "--distractors '0-8,4': 4 is named twice",
        ),
        (["seeds", "run", "--seeds", "0-2,1"], "--seeds '0-2,1': 1 is named twice"),
        (["view", "--examples", "3,3"], "--examples '3,3': 3 is named twice"),
        (["patch", "--kinds", "resid,,head"], "--kinds 'resid,,head': an empty item"),
    ],
)
def test_an_item_named_twice_in_any_list_option_is_refused_before_any_work(
    tmp_path, monkeypatch, argv, culprit
):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, argv)
    one_line_error(r, culprit)
    assert files_under(tmp_path) == []


# an option's bounds are checked once, by its options dataclass: on the command line and in
# the library call alike, before any work
SEEDED = ["fit", "intervene", "lens", "trajectory", "patch", "attribute", "heads"]


@pytest.mark.parametrize("verb", SEEDED)
def test_a_negative_seed_is_refused_naming_it_on_every_analysis(
    tmp_path, monkeypatch, capsys, verb
):
    import probes

    monkeypatch.chdir(tmp_path)
    one_line_error(CliRunner().invoke(app, [verb, "--seed", "-1"]), "--seed must be at least 0")
    code, err = console([verb, "--seed", "-1"], monkeypatch, capsys)
    assert code == 1 and err == "error: --seed must be at least 0, got -1\n", err
    with pytest.raises(ValueError, match="--seed must be at least 0, got -1"):
        getattr(probes, f"run_{verb}")(seed=-1)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["patch", "--task", "done_tracking,delayed_memory"],
        ["attribute", "--task", "all"],
        ["view", "--task", "delayed_memory,done_tracking"],
        ["stability", "--task", "done_tracking,multi_register"],
    ],
)
def test_a_verb_of_one_task_refuses_a_list_naming_task(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    one_line_error(
        CliRunner().invoke(app, argv), f"--task '{argv[2]}': this command takes one task"
    )
    assert files_under(tmp_path) == []


def test_the_cli_error_boundary(tmp_path, monkeypatch):
    import fbt_probe.train.loop as T

    def broken(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(T, "train", broken)
    out = tmp_path / "z"
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines() == [
        "error: unexpected ZeroDivisionError: division by zero (a bug or an unusual input; "
        "FBT_DEBUG=1 shows the traceback)"
    ]
    monkeypatch.setenv("FBT_DEBUG", "1")
    r = CliRunner().invoke(app, ["train", "-c", "tiny", "--out", str(out)])
    assert isinstance(r.exception, ZeroDivisionError)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["fit", "--prefill", "k1001"], "k<N> (N passes, 1..1000)"),
        (["intervene", "--task", "delayed_memory", "--prefill", "k5000"], "1..1000"),
        (["eval", "--n-groups", "100000000"], "--n-groups 100000000 would need about"),
        (["stability", "--decode-tokens", "10000000"], "--decode-tokens must be in 0..4000"),
    ],
)
def test_sizes_beyond_what_runs_are_refused(tmp_path, model_dir, args, msg):
    # an unbounded k-pass prefill once kept every pass's logits and was killed for memory
    out = tmp_path / "out"
    extra = [] if args[0] == "eval" else ["--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--model", str(model_dir), *extra])
    one_line_error(r, msg)
    assert not out.exists()


def test_fit_checks_folds_and_sites_before_it_makes_the_results_folder(tmp_path, model_dir):
    one = generate_dataset(
        "delayed_memory", tmp_path / "one.parquet", n_groups=3, distractors=(1, 4), seed=2
    )
    out = tmp_path / "res"
    r = CliRunner().invoke(
        app, ["fit", "--model", str(model_dir), "--data", str(one), "--out", str(out)]
    )
    one_line_error(r, "--folds 5: the delayed_memory dataset has only 3 groups")
    data = small_dataset(tmp_path)
    r = CliRunner().invoke(
        app,
        [
            "fit",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "-p",
            "standard",
            "--site",
            "fusion.hook_state",
            "--out",
            str(out),
        ],
    )
    one_line_error(r, "fusion.hook_state fires under none of the prefills standard")
    assert not out.exists()


AUDIT_FOUND = [
    (["generate", "--task", "delayed_memory", "--distractors", "-1"], "--distractors '-1'"),
    (
        ["generate", "--task", "delayed_memory", "--distractors", "300"],
        "--distractors '300': distractor count 300 outside [0, 256]",
    ),
    (["generate", "--task", "delayed_memory", "--distractors", "5-2"], "--distractors '5-2'"),
    (["generate", "--task", "delayed_memory", "--distractors", "0,,1"], "--distractors '0,,1'"),
    (["eval", "--modes", "nope"], "--modes 'nope': unknown decoding mode 'nope'"),
    (["eval", "--modes", "standard,,full"], "--modes 'standard,,full'"),
    (
        ["stability", "--prefill", "k2"],
        "--decode-tokens 1000: the prompt and the decoded tokens need",
    ),
    (
        ["lens", "--position", "nope"],
        "--position 'nope': task delayed_memory declares no such position",
    ),
    (["lens", "--position", ""], "--position ''"),
    (["patch", "--depths", "1,,2"], "--depths '1,,2'"),
    (["heads", "--seed", "-1"], "--seed must be at least 0, got -1"),
]


@pytest.mark.parametrize(
    "args,needle", AUDIT_FOUND, ids=[" ".join(a[:1] + a[-2:]) for a, _ in AUDIT_FOUND]
)
def test_options_the_audit_found_are_refused_by_name_before_any_work(
    model_dir, tmp_path, monkeypatch, args, needle
):
    monkeypatch.chdir(tmp_path)  # a default dataset generated before the refusal would land here
    extra = [] if args[0] == "generate" else ["--model", str(model_dir), "--task", "delayed_memory"]
    before = snapshot(tmp_path)
    out = [] if args[0] == "eval" else ["--out", str(tmp_path / "out")]
    r = CliRunner().invoke(app, [*args, *extra, *out])
    one_line_error(r, needle)
    assert snapshot(tmp_path) == before

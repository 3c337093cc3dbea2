"""Training under torch.distributed (gloo, 2 processes on this machine) equals one process on
the same global batch; gradient accumulation equals the whole batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fbt_probe.train.distributed import spawn_local
from fbt_probe.train.loop import train
from fbt_probe.train.recipes import load_recipe

STEPS = 20


def _cfg(**extra):
    # jitter on, so that a shard must draw exactly its rows of the whole batch's noise
    sets = {"steps": STEPS, "model.jitter": 0.5, "run.eval_every": 1000, **extra}
    return load_recipe("tiny").with_overrides(sets)


def _train(world, cfg_dict: dict, out: str, resume: bool, stop_after) -> None:
    from fbt_probe.train.config import TrainConfig

    train(TrainConfig.from_dict(cfg_dict), out, world=world, resume=resume, stop_after=stop_after)


def run_distributed(size: int, cfg, out: Path, resume: bool = False, stop_after=None) -> None:
    """Train ``cfg`` on ``size`` gloo processes on 127.0.0.1 (a free port)."""
    spawn_local(_train, size, cfg.to_dict(), str(out), resume, stop_after, threads=1)


def _losses(run: Path) -> np.ndarray:
    return np.array([h["loss"] for h in json.loads((run / "metrics.json").read_text())["history"]])


def _weights(run: Path) -> dict:
    return load_file(str(run / "model" / "model.safetensors"))


def _assert_same_run(a: Path, b: Path) -> None:
    la, lb = _losses(a), _losses(b)
    assert len(la) == len(lb) == STEPS
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=0)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "one"
    train(_cfg(), out)
    return out


def test_two_gloo_processes_equal_one_process(single, tmp_path):
    run_distributed(2, _cfg(), tmp_path / "two")
    _assert_same_run(single, tmp_path / "two")
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["per_rank_batch"] == 4
    # only rank 0 wrote: one command line, no stray files
    assert len((tmp_path / "two" / "command.txt").read_text().splitlines()) == 1


def test_gradient_accumulation_equals_the_whole_batch(single, tmp_path):
    train(_cfg(**{"optim.accum": 2}), tmp_path / "acc")
    _assert_same_run(single, tmp_path / "acc")


def test_resume_at_world_size_two_from_a_world_size_one_checkpoint(single, tmp_path):
    out = tmp_path / "mixed"
    train(_cfg(), out, stop_after=10)
    run_distributed(2, _cfg(), out, resume=True)
    _assert_same_run(single, out)


def test_a_batch_too_small_for_the_parts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="data.batch_size 8 cannot be split in 1 ranks x 16"):
        train(_cfg(**{"optim.accum": 16}), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _extract(world, data: str, prefill: str, out: str) -> None:
    from fbt_probe.loading import resolve_model
    from probes.common.extract import extract_features
    from tasks.dataset import load

    model, _ = resolve_model("default")
    feats = extract_features(model, load(data), prefill, batch_size=16)
    np.save(Path(out) / f"rank{world.rank}.npy", feats)


@pytest.mark.parametrize("prefill", ["recurrent", "full"])
def test_extraction_under_two_ranks_equals_one(tmp_path, prefill):
    from fbt_probe.loading import resolve_model
    from probes.common.extract import extract_features
    from tasks.dataset import load
    from tasks.generate import generate_dataset

    data = generate_dataset(
        "done_tracking", tmp_path / "dt.parquet", n_groups=10, distractors=(1, 5, 30), seed=4
    )
    model, _ = resolve_model("default")
    one = extract_features(model, load(data), prefill, batch_size=16)
    spawn_local(_extract, 2, str(data), prefill, str(tmp_path))
    for r in (0, 1):  # every rank holds all of it, bit for bit what one process extracts
        assert np.array_equal(np.load(tmp_path / f"rank{r}.npy"), one)


def test_dry_run_of_the_paper_scale_recipe(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    r = CliRunner().invoke(app, ["recipe", "paper-1b", "--cost", "--world-size", "8"])
    assert r.exit_code == 0, r.output
    # the formula of docs/distributed.md, written out here
    D, L, F, V = 1536, 24, 8192, 100352
    formula = V * D + L * (4 * D * D + 2 * D * F + 2 * D) + D + (2 * D * D + D)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("parameters:"))
    count = int(line.split()[1].replace(",", ""))
    assert abs(count - formula) <= 0.02 * formula
    assert "1.28 passes per token (200B tokens cost as 256B)" in r.stdout
    assert "DDP 14.7 GiB, FSDP 1.8 GiB" in r.stdout  # 16 bytes a parameter, / 8 under FSDP
    assert not Path("runs/paper-1b").exists()


def test_bf16_autocast_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match=r"run.bf16 \(bf16 autocast\) needs a CUDA device"):
        train(_cfg(**{"run.bf16": True}), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_bf16_autocast_trains_on_cuda(tmp_path):
    m = train(_cfg(**{"run.bf16": True}), tmp_path / "bf16", device="cuda")
    losses = [h["loss"] for h in m["history"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_fsdp_on_two_gloo_processes_equals_one_process(single, tmp_path):
    cfg = _cfg(**{"run.fsdp": True})
    run_distributed(2, cfg, tmp_path / "fsdp")
    _assert_same_run(single, tmp_path / "fsdp")
    assert json.loads((tmp_path / "fsdp" / "metrics.json").read_text())["sharding"] == "fsdp"


def test_fsdp_checkpoints_are_the_unsharded_format(single, tmp_path):
    # stopped half-way under FSDP, the checkpoint resumes in one process (and the reverse
    # direction is the world-size test above): it ends where an uninterrupted run does
    out = tmp_path / "mixed"
    run_distributed(2, _cfg(**{"run.fsdp": True}), out, stop_after=10)
    assert torch.load(out / "state.pt", weights_only=False)["step"] == 10
    train(_cfg(), out, resume=True)
    _assert_same_run(single, out)
    # and a one-process checkpoint resumes under FSDP
    out2 = tmp_path / "mixed2"
    train(_cfg(), out2, stop_after=10)
    run_distributed(2, _cfg(**{"run.fsdp": True}), out2, resume=True)
    _assert_same_run(single, out2)


def test_fsdp_needs_two_ranks(tmp_path):
    with pytest.raises(ValueError, match="run.fsdp shards over the ranks"):
        train(_cfg(**{"run.fsdp": True}), tmp_path / "x")


@pytest.mark.slow
def test_torchrun_runs_the_train_command(tmp_path):
    # as a user runs it: torchrun starts two processes of the command line
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "cli",
            "train",
            "--config",
            "tiny",
            "--set",
            "steps=6",
            "--set",
            "run.eval_every=1000",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("trained 6/6 steps") == 1  # rank 0 reports, once
    m = json.loads((out / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["steps_done"] == 6


def test_ranks_with_different_numbers_of_length_buckets_equal_one_process(tmp_path):
    # 16 examples of counts 0..256: on 7 of the 20 steps one rank runs its 8 rows in more
    # length buckets than the other, so the ranks make different numbers of forwards
    extra = {"data.batch_size": 16, "data.count_dist": "uniform", "schedule.0.n_max": 256}
    train(_cfg(**extra), tmp_path / "one")
    run_distributed(2, _cfg(**extra), tmp_path / "two")
    _assert_same_run(tmp_path / "one", tmp_path / "two")

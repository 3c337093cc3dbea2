"""The seed study: seeds trained one after another, resumable, then a table and a figure."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fbt_probe.train.loop import train
from fbt_probe.train.recipes import load_recipe, named_config
from probes.seeds.study import meets, parse_seeds, run_seed_study


def test_parse_seeds():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("3,0") == [0, 3]
    for bad in ("", "4-1", "a", "-1", "3,0,3", "0-4,2"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.slow
def test_a_seed_study_trains_each_seed_once_and_tabulates(tmp_path):
    cfg = load_recipe("tiny").with_overrides({"steps": 6, "run.eval_every": 1000})
    calls = []

    def one(scfg, run, resume):
        calls.append((scfg.run.seed, resume))
        train(scfg, run, resume=resume)

    # seed 1 was stopped part-way earlier: the study resumes it
    seed1 = cfg.with_overrides({"run.seed": 1, "name": f"{cfg.name}-seed1"})
    train(seed1, tmp_path / "seed-1", stop_after=3)
    table = run_seed_study(cfg, [0, 1], tmp_path, one, eval_groups=5, probe_groups=6)
    assert calls == [(0, False), (1, True)]
    for s in (0, 1):
        m = json.loads((tmp_path / f"seed-{s}" / "metrics.json").read_text())
        assert m["seed"] == s and m["finished"]
    assert {"seed 0", "seed 1", "mean", "min", "seeds meeting"} <= set(table.index)
    csv = pd.read_csv(tmp_path / "seed_table.csv", index_col=0)
    rows = json.loads((tmp_path / "seed_rows.json").read_text())
    col = "delayed_memory/full"
    assert csv.loc["mean", col] == pytest.approx((rows["0"][col] + rows["1"][col]) / 2, abs=1e-4)
    assert csv.loc["min", col] == pytest.approx(min(rows["0"][col], rows["1"][col]), abs=1e-4)
    assert (tmp_path / "seeds.png").stat().st_size > 0 and (tmp_path / "seed_table.md").is_file()
    # every probe entry keeps its interval beside it; the markdown shows it in the seed's cell
    probes = [k for k in rows["0"] if k.startswith("probe/")]
    assert probes
    for s in ("0", "1"):
        for k in probes:
            lo, hi = (
                rows[s][k.replace("probe/", "ci_low/")],
                rows[s][k.replace("probe/", "ci_high/")],
            )
            assert lo <= rows[s][k] <= hi
    assert not [c for c in csv.columns if c.startswith(("ci_low/", "ci_high/", "chance/"))]
    k = probes[0]
    lo, hi = (rows["1"][k.replace("probe/", f"ci_{e}/")] for e in ("low", "high"))
    md = (tmp_path / "seed_table.md").read_text()
    line = next(line for line in md.splitlines() if line.startswith(f"| {k} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]  # measure, seed 0, seed 1, mean, ...
    assert cells[2] == f"{rows['1'][k]:.3f} [{lo:.3f}, {hi:.3f}]"
    # a second call trains nothing and reads the cached rows
    calls.clear()
    run_seed_study(cfg, [0, 1], tmp_path, one, eval_groups=5, probe_groups=6)
    assert calls == []
    assert json.loads((tmp_path / "seed_rows.json").read_text()) == rows
    # the same recipe under another name keeps the finished seeds; another recipe is refused
    run_seed_study(
        cfg.with_overrides({"name": "renamed"}),
        [0, 1],
        tmp_path,
        one,
        eval_groups=5,
        probe_groups=6,
    )
    assert calls == []
    other = cfg.with_overrides({"optim.lr": 1e-3})
    with pytest.raises(ValueError, match=r"seed-0 was trained with another recipe than tiny-seed0"):
        run_seed_study(other, [0, 1], tmp_path, one, eval_groups=5, probe_groups=6)
    assert calls == []


def test_targets_read_from_a_row():
    row = {
        f"{t}/{m}": 1.0
        for t in ("delayed_memory", "done_tracking")
        for m in ("standard", "soft", "fused", "full")
    }
    row.update(
        {f"multi_register/{m}/min_register": 0.96 for m in ("standard", "soft", "fused", "full")}
    )
    row.update(
        {
            "probe/delayed_memory/label/recurrent": 0.995,
            "probe/done_tracking/label/recurrent": 0.98,
            "probe/delayed_memory/label/standard": 0.52,
            "chance/delayed_memory/label/standard": 0.49,
        }
    )
    got = meets(row)
    assert got["answers >= 0.99"] and got["multi_register >= 0.95 per register"]
    assert not got["layer-0 probe recurrent >= 0.99"]  # done_tracking's 0.98
    assert got["standard prefill at chance"]


# ---- fbt-probe seeds merge -----------------------------------------------------------------
def merge(*studies, out, force=False):
    from typer.testing import CliRunner

    from cli import app

    args = ["seeds", "merge", *map(str, studies), "--out", str(out), *["--force"] * force]
    return CliRunner().invoke(app, args)


def _split_study(tmp_path, seeds_per_part):
    """The committed smear-ramp study cut into parts, one folder each: ``seeds_per_part``
    picks each part's seeds from the study's seeds in order."""
    src = Path(__file__).resolve().parents[2] / "figures" / "seeds" / "smear-ramp"
    rows = json.loads((src / "seed_rows.json").read_text())
    parts = []
    for i, pick in enumerate(seeds_per_part):
        seeds = pick(sorted(rows, key=int))
        d = tmp_path / f"part{i}"
        d.mkdir()
        (d / "seed_rows.json").write_text(json.dumps({s: rows[s] for s in seeds}))
        parts.append(d)
    return src, parts


def test_merge_seeds_of_a_study_cut_in_parts_gives_the_studys_own_table(tmp_path):
    # the last seed alone, then every seed (the last one again, with the same row)
    src, parts = _split_study(tmp_path, [lambda ss: ss[-1:], lambda ss: ss])
    r = merge(*parts, out=tmp_path / "m")
    assert r.exit_code == 0, r.output
    out = tmp_path / "m"
    assert (out / "seed_table.md").read_text() == (src / "seed_table.md").read_text()
    assert json.loads((out / "seed_rows.json").read_text()) == json.loads(
        (src / "seed_rows.json").read_text()
    )
    assert (out / "seeds.png").stat().st_size > 0
    assert "recipe not checked" in r.output
    assert (src / "seed_table.md").read_text().splitlines()[0] in r.output


def test_merge_seeds_refuses_conflicting_rows_and_other_recipes(tmp_path):
    _, (a, b) = _split_study(tmp_path, [lambda ss: ["0"], lambda ss: ["2"]])
    bad = json.loads((b / "seed_rows.json").read_text())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "seed_rows.json").write_text(
        json.dumps({"0": {**bad["2"], "done_tracking/standard": 0.5}})
    )
    r = merge(a, tmp_path / "c", out=tmp_path / "m")
    assert r.exit_code == 1 and "seed 0 has different rows" in r.output
    assert not (tmp_path / "m").exists()
    # the same recipe on two seeds merges; another recipe is refused by name
    cfg = named_config("smeared-keys")
    for d, s, c in ((a, 0, cfg), (b, 2, cfg)):
        (d / f"seed-{s}").mkdir()
        c2 = c.with_overrides({"run.seed": s, "name": f"x-seed{s}"})
        (d / f"seed-{s}" / "train_config.json").write_text(json.dumps(c2.to_dict()))
    r = merge(a, b, out=tmp_path / "m")
    assert r.exit_code == 0 and "recipe not checked" not in r.output
    other = cfg.with_overrides({"run.seed": 2, "steps": 100})
    (b / "seed-2" / "train_config.json").write_text(json.dumps(other.to_dict()))
    r = merge(a, b, out=tmp_path / "m2")
    assert r.exit_code == 1 and "seed-2 was trained with another recipe" in r.output
    r = merge(tmp_path / "none", out=tmp_path / "m3")
    assert r.exit_code == 1 and "no seed_rows.json" in r.output
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"0": {"a": 1}, "0": {"a": 2}}', "'0' is written twice"),
        ('{"0": {"a": 1}, "00": {"a": 2}}', "'00' is not a seed"),
        ('{"-1": {"a": 1}}', "'-1' is not a seed"),
        ('{"+3": {"a": 1}}', "'+3' is not a seed"),
        ('{"0": {"a": 1, "a": 2}}', "'a' is written twice"),
    ],
)
def test_merge_refuses_a_seed_written_twice_or_not_as_a_seed(tmp_path, text, message):
    # json keeps the last of two equal keys, and int() reads "00" and "-1": neither may
    # silently drop or add a seed
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "seed_rows.json").write_text(text)
    r = merge(tmp_path / "a", out=tmp_path / "m")
    assert r.exit_code == 1 and message in r.output and "seed_rows.json" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_a_merge_is_one_transaction_replaced_only_with_force(tmp_path, monkeypatch):
    import errno
    import os

    from tests.refusals import snapshot

    _, (a, b) = _split_study(tmp_path, [lambda ss: ["0"], lambda ss: ["2"]])
    out = tmp_path / "m"
    assert merge(a, out=out).exit_code == 0
    (out / "seeds.stale.png").write_text("an earlier merge's figure")
    before = snapshot(tmp_path)
    r = merge(a, b, out=out)  # an earlier merge is there: refused, nothing changed
    assert r.exit_code == 1 and "exists from an earlier run" in r.output and "--force" in r.output
    assert snapshot(tmp_path) == before
    real = os.replace

    def full(src, dst, *args, **kw):  # the figure cannot be written
        if str(dst).endswith(".png"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", full)
        r = merge(a, b, out=out, force=True)
    assert r.exit_code == 1 and "No space left on device" in r.output
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    r = merge(a, b, out=out, force=True)
    assert r.exit_code == 0, r.output
    assert set(json.loads((out / "seed_rows.json").read_text())) == {"0", "2"}
    assert not (out / "seeds.stale.png").exists()

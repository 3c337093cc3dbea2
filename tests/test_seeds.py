"""The seed study: seeds trained one after another, resumable, then a table and a figure."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fbt_probe.recipes import load_recipe
from fbt_probe.train import train
from probes.seeds import meets, parse_seeds, run_seed_study


def test_parse_seeds():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("3,0,3") == [0, 3]
    for bad in ("", "4-1", "a", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


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
    # a second call trains nothing and reads the cached rows; a row cached without intervals
    # gets them from the fit results it was measured with
    calls.clear()
    cached = tmp_path / "seed-1" / "seed_row.json"
    old = json.loads(cached.read_text())
    cached.write_text(json.dumps({k: v for k, v in old.items() if not k.startswith("ci_")}))
    run_seed_study(cfg, [0, 1], tmp_path, one, eval_groups=5, probe_groups=6)
    assert calls == []
    again = json.loads((tmp_path / "seed_rows.json").read_text())
    assert again.keys() == rows.keys() and again["0"] == rows["0"]
    assert again["1"].keys() == rows["1"].keys()
    for k, v in rows["1"].items():  # intervals read back from the CSV (6 digits)
        assert again["1"][k] == (pytest.approx(v, abs=1e-5) if k.startswith("ci_") else v)
    # the same recipe under another name keeps the finished seeds; another recipe is refused
    run_seed_study(cfg.with_overrides({"name": "renamed"}), [0, 1], tmp_path, one,
                   eval_groups=5, probe_groups=6)  # fmt: skip
    assert calls == []
    other = cfg.with_overrides({"optim.lr": 1e-3})
    with pytest.raises(ValueError, match=r"seed-0 was trained with another recipe than tiny-seed0"):
        run_seed_study(other, [0, 1], tmp_path, one, eval_groups=5, probe_groups=6)
    assert calls == []


def test_targets_read_from_a_row():
    row = {f"{t}/{m}": 1.0 for t in ("delayed_memory", "done_tracking")
           for m in ("standard", "soft", "fused", "full")}  # fmt: skip
    row.update(
        {f"multi_register/{m}/min_register": 0.96 for m in ("standard", "soft", "fused", "full")}
    )
    row.update({"probe/delayed_memory/label/recurrent": 0.995, "probe/done_tracking/label/recurrent": 0.98,
                "probe/delayed_memory/label/standard": 0.52, "chance/delayed_memory/label/standard": 0.49})  # fmt: skip
    got = meets(row)
    assert got["answers >= 0.99"] and got["multi_register >= 0.95 per register"]
    assert not got["layer-0 probe recurrent >= 0.99"]  # done_tracking's 0.98
    assert got["standard prefill at chance"]

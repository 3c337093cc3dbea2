"""The analysis registry: one registration makes an analysis a CLI verb with its options' help,
a section of report.md and report.html, figures that `plot` redraws, and a step of reproduce."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import cli
import probes
from probes import ANALYSES, Analysis, Figure, Result, register_analysis
from probes.common.figures import save_figure, subplots
from probes.common.options import option
from probes.common.tables import write_table
from tasks import get_task


@dataclass(frozen=True)
class CountOptions:
    model: str = option("default", "--model", "-m")
    """Unused by the toy, as every analysis takes one."""
    task: str = option("delayed_memory", "--task", "-t")
    """The task whose prompts are counted."""
    groups: int = option(5, "--groups", min=1)
    """Base instances drawn."""
    out: Path = option(Path("results/count"), "--out", "-o")
    """Output folder."""


def count_run(options: CountOptions, progress=None) -> Result:
    """The toy's work: prompt lengths by distractor count, a table and a bar chart."""
    examples = get_task(options.task).generate(options.groups, (1, 4), seed=0)
    df = pd.DataFrame(
        {
            "distractors": [e.n_distractors for e in examples],
            "length": [len(e.prompt) for e in examples],
        }
    )
    table = df.groupby("distractors", as_index=False).length.mean()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    write_table(table, out / "count.csv")
    count_figures(out.parent)
    return Result({"count": table}, [f"{options.task}: {len(df)} prompts", f"wrote {out}"])


def count_figures(results: Path) -> int:
    """The toy's bar chart, drawn from its table alone."""
    csv = results / "count" / "count.csv"
    if not csv.is_file():
        return 0
    table = pd.read_csv(csv)
    fig, ax = subplots()
    ax.bar(table.distractors.astype(str), table.length)
    save_figure(fig, csv.parent, "count_lengths")
    return 1


def count_section(results: Path) -> list:
    csv = results / "count" / "count.csv"
    if not csv.is_file():
        return []
    table = pd.read_csv(csv)
    rows = [f"| {r.distractors} | {r.length:.1f} |" for r in table.itertuples()]
    png = results / "count" / "count_lengths.png"
    heat = '<table class="toy-heat"><tr><td>toy</td></tr></table>'
    return [
        "## Prompt lengths (`fbt-probe count`)",
        "",
        "| distractors | mean length |",
        "|---|---|",
        *rows,
        "",
        Figure(png, (heat,)),
    ]


TOY = Analysis(
    name="count",
    options=CountOptions,
    run=count_run,
    help="Count the prompts' tokens by distractor count (a toy analysis).",
    example="fbt-probe count --task done_tracking",
    folder="count",
    section=count_section,
    figures=count_figures,
    reproduce={"task": "done_tracking", "groups": 3},
)


@pytest.fixture
def toy():
    register_analysis(TOY)
    try:
        yield TOY
    finally:
        ANALYSES.remove("count")


def test_one_registration_makes_a_verb_with_its_options_help(toy, tmp_path):
    runner = CliRunner()
    shown = runner.invoke(cli.app, ["--help"])
    assert shown.exit_code == 0 and "count" in shown.output and "Count the prompts'" in shown.output
    helped = runner.invoke(cli.app, ["count", "--help"])
    assert helped.exit_code == 0
    assert "The task whose prompts are counted." in helped.output
    assert (
        "--groups" in helped.output
        and "Example: fbt-probe count --task done_tracking" in helped.output
    )
    out = tmp_path / "res" / "count"
    done = runner.invoke(
        cli.app, ["count", "--task", "done_tracking", "--groups", "4", "--out", str(out)]
    )
    assert done.exit_code == 0, done.output
    assert "done_tracking: 8 prompts" in done.output
    table = pd.read_csv(out / "count.csv")
    assert table.distractors.tolist() == [1, 4]
    bad = runner.invoke(cli.app, ["count", "--groups", "0"])
    assert bad.exit_code != 0


def test_the_library_runs_it_with_the_same_options(toy, tmp_path):
    res = probes.get_analysis("count")(options=CountOptions(out=tmp_path / "c"), groups=2)
    assert isinstance(res, Result) and len(res.tables["count"]) == 2
    assert res.lines[0] == "delayed_memory: 4 prompts"


def test_a_registered_analysis_is_a_library_call_with_its_options(toy, tmp_path):
    import inspect

    run_count = probes.run_count  # made on first use from the registration
    params = inspect.signature(run_count).parameters
    assert list(params) == ["model", "task", "groups", "out", "progress"]
    assert params["groups"].default == 5 and params["groups"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "groups: Base instances drawn. [at least 1]" in run_count.__doc__
    res = run_count(task="done_tracking", groups=3, out=tmp_path / "c")
    assert res.lines[0] == "done_tracking: 6 prompts"
    with pytest.raises(TypeError, match="group"):
        run_count(group=3)  # a misspelled option, as any function refuses it
    with pytest.raises(ValueError, match="--groups must be at least 1, got 0"):
        run_count(groups=0, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def _verb_params(name: str) -> dict:
    """The CLI verb's options: {name: (default, help as --help shows it)}."""
    import click
    import typer

    root = typer.main.get_command(cli.app)
    cmd = root.get_command(click.Context(root), name)
    cmd.format_help(click.Context(cmd), click.HelpFormatter())  # fills in each option's help
    return {
        p.name: (p.default, p.help)
        for p in cmd.params
        if not p.name.endswith("_moved") and p.name != "help"
    }


@pytest.mark.parametrize("name", list(probes.BUILTIN))
def test_each_library_call_is_its_verb_options_defaults_and_help(name):
    import inspect

    fn = getattr(probes, f"run_{name}")
    params = inspect.signature(fn).parameters
    verb = _verb_params(name)
    assert [p for p in params if p != "progress"] == sorted(verb, key=list(params).index)
    assert set(params) - {"progress"} == set(verb)
    for p, (default, help_text) in verb.items():
        assert params[p].default == default or (
            isinstance(default, list | tuple) and list(params[p].default) == list(default)
        ), (name, p)
        assert help_text and f"    {p}: {help_text}\n" in fn.__doc__, (name, p)
    assert fn.__name__ == f"run_{name}" and ANALYSES[name].example in fn.__doc__


def test_an_option_error_stops_the_library_call_before_any_work(tmp_path):
    out = tmp_path / "lens"
    with pytest.raises(ValueError, match="k99"):
        probes.run_lens(prefill="k99", out=out)
    with pytest.raises(ValueError, match="--tuned-lens reads a saved tuned lens"):
        probes.run_lens(tuned=False, tuned_lens=tmp_path, out=out)
    with pytest.raises(ValueError, match="--folds must be at least 2"):
        probes.run_fit(folds=1, out=out)
    assert not out.exists()


def test_a_duplicate_name_is_refused_unless_replacing(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_analysis(TOY)
    assert register_analysis(TOY, replace=True) is TOY


def test_it_is_a_section_of_both_reports(toy, tmp_path):
    from probes.report.markdown import write_report

    res = tmp_path / "res"
    probes.get_analysis("count")(options=CountOptions(out=res / "count"))
    md = write_report(res).read_text()
    assert "## Prompt lengths (`fbt-probe count`)" in md
    assert "![count_lengths](count/count_lengths.png)" in md
    html = (res / "report.html").read_text()
    assert "Prompt lengths" in html and 'class="toy-heat"' in html
    assert "data:image/png" not in html  # the interactive table replaces the PNG
    # and fbt-probe plot redraws its figure from its table
    (res / "count" / "count_lengths.png").unlink()
    got = CliRunner().invoke(cli.app, ["plot", "--results", str(res)])
    assert got.exit_code == 0 and "drew 1 figure panel of count" in got.output
    assert (res / "count" / "count_lengths.png").stat().st_size > 1000


def test_it_is_a_step_of_reproduce(toy, tmp_path, monkeypatch):
    from probes.report import reproduce as R

    only = {"count": TOY}
    monkeypatch.setattr(R, "ANALYSES", only)
    monkeypatch.setattr(R, "resolve_model", lambda spec: (object(), "default"))
    lines = R.reproduce(out=tmp_path / "res")
    assert lines[0] == "count:" and "done_tracking: 6 prompts" in lines[1]
    table = pd.read_csv(tmp_path / "res" / "count" / "count.csv")
    assert np.allclose(table.length, table.length.round(1), atol=0.05)
    assert (tmp_path / "res" / "report.md").read_text().count("## Prompt lengths") == 1

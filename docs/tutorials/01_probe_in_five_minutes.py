# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Probe the default model in five minutes
#
# A full-bandwidth transformer feeds each position's top hidden state back into the next
# position's input. Is the task's state *linearly decodable* where that feedback enters, and
# only because of it? This tutorial answers it for the built-in default model, from Python:
#
# 1. load the model and generate a task's data;
# 2. fit probes at the colon, at every depth, under standard and recurrent prefill;
# 3. read the layer-0 table and the heatmap;
# 4. write the report as one HTML page.
#
# The command line does the same in one line (`fbt-probe fit --task delayed_memory`); here
# every step is a library call whose result you can look at. Sizes are small so that it runs
# in a minute or two on a laptop's CPU.

# %%
import os
from pathlib import Path

# where this tutorial writes (a folder of its own) and how much data it makes
OUT = Path(os.environ.get("FBT_TUTORIAL_OUT", "tutorials-out")) / "01"
N_GROUPS = int(os.environ.get("FBT_TUTORIAL_GROUPS", "60"))

# %% [markdown]
# ## The model
#
# `resolve_model("default")` loads the model shipped with the package (a folder name or a
# Hugging Face folder works the same way). `entry_depth` is the depth whose input receives
# the fed-back state: 0, block 0's input, in the paper's design.

# %%
from fbt_probe import resolve_model

model, name = resolve_model("default")
cfg = model.cfg
print(
    f"{name}: {cfg.n_layers} layers, d_model {cfg.d_model}, feedback enters at depth {model.entry_depth}"
)

# %% [markdown]
# ## A task's data
#
# `delayed_memory` sets a bit, then shows distractor words, then asks for the bit after a
# colon. Each *group* is one base instance rendered at several distractor counts; the probes'
# folds split by group, so no instance is both trained and tested on.

# %%
from tasks import generate_dataset, load_dataset

path = generate_dataset(
    "delayed_memory",
    OUT / "delayed_memory.parquet",
    n_groups=N_GROUPS,
    distractors=(1, 4, 16),
    seed=0,
    force=True,
)
ds = load_dataset(path)
print(len(ds), "examples in", len(set(ds.group)), "groups; the first:", ds.text[0])

# %% [markdown]
# ## Probes at every depth, two prefills
#
# Under *standard* prefill each position runs once; under *recurrent* prefill a second pass
# sees the first pass's top states fed back. `fit_protocol` caches the residual stream at the
# colon for every depth and pass, fits a logistic probe per depth with grouped
# cross-validation and bootstrap intervals, and fits the same probes on a randomly
# initialised copy of the model (the control).

# %%
from probes.fit.run import fit_protocol

df = fit_protocol(
    model,
    name,
    ("delayed_memory",),
    ("standard", "recurrent"),
    {"delayed_memory": path},
    OUT / "results",
    controls=True,
    per_count=False,
    cache_dir=OUT / "cache",
)
df[(df.model == "trained") & (df.depth == 0)][
    ["prefill", "depth", "accuracy", "ci_low", "ci_high", "chance"]
]

# %% [markdown]
# ## The layer-0 table
#
# At depth 0 under standard prefill the colon holds only its own embedding: a probe there can
# only reach chance. One recurrent step puts the task state into the same position.

# %%
from probes.common.probe_results import format_layer0, layer0_table

table = layer0_table(df, model.entry_depth)
print(format_layer0(table))

# %%
# what you should see: chance under standard prefill, near 1 under recurrent prefill
row = table.set_index("prefill")
assert row.loc["standard", "accuracy"] <= row.loc["standard", "chance"] + 0.15
assert row.loc["recurrent", "accuracy"] >= 0.9

# %% [markdown]
# ## The heatmap
#
# `plot_all` draws every figure from `probe_results.csv` and returns the matrices it drew.
# Rows are prefills, columns depths.

# %%
from probes.fit.plot import plot_all

drawn = plot_all(OUT / "results")
drawn["prefill_by_depth"]["delayed_memory/label"].round(3)

# %% [markdown]
# ![the heatmap](../../figures/heatmap_delayed_memory_prefill_by_depth.png)
#
# *(The figure above is the full-size run's, from `fbt-probe reproduce`; yours is in
# `tutorials-out/01/results/figures/`.)*
#
# ## The report
#
# `write_report` writes `report.md` and `report.html`: one page that works offline, with
# tables you can sort and heatmaps that show each cell's interval and n on hover.

# %%
from probes import write_report

md = write_report(OUT / "results")
html = md.with_suffix(".html")
print(f"open {html} in a browser ({html.stat().st_size // 1024} KB)")

# %% [markdown]
# Next: decodable is not the same as used. The second tutorial tests whether the model
# relies on the state it feeds back.

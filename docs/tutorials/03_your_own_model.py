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
# # Bring your own model
#
# Any Hugging Face causal LM saved with `save_pretrained` (model and tokenizer in one
# folder) becomes a full-bandwidth model here: the fusion enters through `inputs_embeds`,
# the model's own head and KV cache do the rest, and hooks keep TransformerLens names,
# pass by pass. Nothing is downloaded.
#
# This tutorial uses the real SmolLM2-135M where it has been converted
# (`fbt-probe convert --gguf smollm2 --out models/smollm2`), and otherwise writes a tiny
# random Llama with a tokenizer trained on the tasks' text. The steps are the same for yours.

# %%
import os
from pathlib import Path

OUT = Path(os.environ.get("FBT_TUTORIAL_OUT", "tutorials-out")) / "03"
N_GROUPS = int(os.environ.get("FBT_TUTORIAL_GROUPS", "60"))
# FBT_TUTORIAL_MODEL: a save_pretrained folder of your own, or "tiny" for the tiny one
choice = os.environ.get("FBT_TUTORIAL_MODEL", "")

# %%
from fbt_probe.hf.tiny import bpe_tokenizer, model_folder

if choice and choice != "tiny":
    folder = Path(choice)
elif not choice and (Path("models/smollm2") / "config.json").is_file():
    folder = Path("models/smollm2")
else:
    folder = OUT / "tiny-llama"
    if not folder.is_dir():
        model_folder(folder, "llama", bpe_tokenizer(), seed=0)
print("model folder:", folder)

# %% [markdown]
# ## Loading it
#
# `resolve_model` reads the folder's `config.json` and wraps the model. A folder that was
# never trained with feedback gets a fresh fusion (`W_U`, `W_G`) of the model's width, so
# its fed-back input is a random function of the state until it is upcycled
# (`fbt-probe train --init-from FOLDER --config upcycle`, `docs/hf.md`).

# %%
from fbt_probe import resolve_model

model, name = resolve_model(str(folder))
print(f"{name}: {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {model.n_heads} heads")

# %% [markdown]
# ## Tasks through its tokenizer
#
# The tasks are written in words; `tokenizer=` encodes them with the model's own tokenizer
# and records where the colon and the label word fall.

# %%
from tasks import generate_dataset, load_dataset

path = generate_dataset(
    "delayed_memory",
    OUT / "delayed_memory.parquet",
    n_groups=N_GROUPS,
    distractors=(2, 8),
    seed=0,
    tokenizer=str(folder),
    force=True,
)
ds = load_dataset(path)
print(len(ds), "examples; the first:", ds.text[0], "->", len(ds.token_ids[0]), "tokens")

# %% [markdown]
# ## Two passes, one cache per pass
#
# `run_with_pass_caches` runs the passes and keeps chosen hooks at chosen positions: here
# block 0's input at the colon. In pass 2 it holds the fed-back state of pass 1.

# %%
import torch

rows = list(range(4))
length = max(int(ds.colon_index[r]) + 1 for r in rows)
tokens = torch.tensor(
    [list(ds.token_ids[r][:length]) + [0] * (length - len(ds.token_ids[r][:length])) for r in rows]
)
colon = torch.tensor([int(ds.colon_index[r]) for r in rows])
out, caches = model.run_with_pass_caches(
    tokens, passes=2, names_filter="blocks.0.hook_resid_pre", positions=colon
)
print([tuple(c["blocks.0.hook_resid_pre"].shape) for c in caches])

# %% [markdown]
# ## Probes, with their control
#
# On a real language model the residual stream is rich enough that a probe can read almost
# anything off almost anywhere. The random-init control, the same architecture with random
# weights, tells a learned state from one a random network also exposes.

# %%
from probes.common.probe_results import format_layer0, layer0_table
from probes.fit.run import fit_protocol

df = fit_protocol(
    model,
    name,
    ("delayed_memory",),
    ("standard", "recurrent"),
    {"delayed_memory": path},
    OUT / "fit",
    controls=True,
    per_count=False,
    cache_dir=OUT / "cache",
    folds=3,
)
print(format_layer0(layer0_table(df)))

# %%
# what you should see: every probe scored with an interval and its random-init control
table = layer0_table(df)
assert {"standard", "recurrent"} <= set(table.prefill)
assert (table.ci_low <= table.accuracy + 1e-9).all() and (
    table.accuracy <= table.ci_high + 1e-9
).all()

# %% [markdown]
# ## Look at it
#
# `fbt-probe view` (here `probes.report.view.view`) writes one offline page: the tokens, what the
# saved probes predict at every depth and pass, the logit lens and its read of the fed-back
# state, and every head's attention, pass by pass.

# %%
from probes.report.view import view

page, lines = view(
    model=str(folder),
    data=path,
    probes=OUT / "fit",
    examples="0,1",
    prefill="recurrent",
    out=OUT / "view.html",
)
print(lines[0])

# %% [markdown]
# From here: `fbt-probe intervene --model FOLDER` asks whether the state is used
# (the second tutorial), and `docs/real-model.md` does all of it on SmolLM2, upcycled.

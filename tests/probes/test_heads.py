"""Attention by pass and the per-head hooks of Hugging Face models: the hook-side reductions
against the whole cached pattern, Hugging Face's q, k, v, z and pattern against the model's own
modules and output_attentions, per-head patches on Hugging Face models, and ``fbt-probe heads``
on the default model and a tiny Hugging Face model."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from fbt_probe.kernels.heads import head_reads, induction_scores, repeated_tokens
from fbt_probe.loading import resolve_model
from probes.common.bootstrap import GroupBootstrap
from tasks.generate import generate_dataset

FAMILIES = ("llama", "gpt2", "qwen2", "gpt_neox")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    pytest.importorskip("transformers")
    from fbt_probe.hf import load_hf
    from fbt_probe.hf.tiny import model_folder

    root = tmp_path_factory.mktemp("hf")
    return {f: load_hf(model_folder(root / f, f)) for f in FAMILIES}


def _patterns(model, toks, passes):
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.cfg.n_layers)]
    _, caches = model.run_with_pass_caches(toks, passes=passes, names_filter=names)
    return torch.stack([torch.stack([c[n] for n in names]) for c in caches])  # (P, L, B, H, T, T)


@torch.no_grad()
@pytest.mark.parametrize("which", ["default", "llama"])
def test_the_hooks_reductions_equal_the_whole_pattern(default_model, hf_models, which):
    model = default_model if which == "default" else hf_models["llama"]
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 40, (5, 12), generator=g)
    read = torch.tensor([11, 9, 6, 11, 4])
    label = torch.tensor([2, 1, 3, 7, 0])
    r = head_reads(model, toks, read, label, passes=2, show=(1,))
    pat = _patterns(model, toks, 2)
    for b in range(5):
        t = torch.arange(1, int(read[b]) + 1)
        prev = pat[:, :, b, :, t, t - 1].mean(-1)  # (P, L, H)
        torch.testing.assert_close(r.prev_token[:, :, b], prev, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.label[:, :, b], pat[:, :, b, :, read[b], label[b]])
        nxt = pat[:, :, b, :, read[b], label[b] + 1]
        torch.testing.assert_close(r.label_next[:, :, b], nxt)
    torch.testing.assert_close(r.rows[1], pat[:, :, 1, :, 9, :10])
    assert torch.allclose(pat.sum(-1), torch.ones(()), atol=1e-5)  # rows of a softmax


@torch.no_grad()
def test_induction_scores_equal_the_patterns_diagonal(default_model):
    ids = torch.arange(10, 40)
    toks = repeated_tokens(ids, 4, 6, bos=1, seed=0)
    assert toks.shape == (4, 13) and (toks[:, 1:7] == toks[:, 7:]).all() and (toks[:, 0] == 1).all()
    s = induction_scores(default_model, toks, 6, passes=2)
    pat = _patterns(default_model, toks, 2)
    q = torch.arange(7, 13)  # the second copy; its first occurrence + 1 is q - 6 + 1
    ref = pat[..., q, q - 5].mean(-1)  # (P, L, B, H)
    torch.testing.assert_close(s, ref, atol=1e-6, rtol=1e-5)


def test_a_bootstraps_columns_are_its_means():
    rng = np.random.default_rng(0)
    v = rng.random((40, 3))
    boot = GroupBootstrap(rng.integers(0, 9, 40), seed=1, n_boot=50)
    cols = boot.mean_columns(v)
    for j in range(3):
        np.testing.assert_allclose(cols[:, j], boot.mean(v[:, j]))


def _raw(module_path, model, toks, pre=False):
    """What a plain PyTorch hook on one Hugging Face module sees (its input or output)."""
    got = {}
    mod = model.hf.get_submodule(module_path)
    if pre:
        h = mod.register_forward_pre_hook(lambda m, a: got.setdefault("x", a[0]))
    else:
        h = mod.register_forward_hook(lambda m, a, o: got.setdefault("x", o))
    try:
        model(toks, passes=1)
    finally:
        h.remove()
    return got["x"]


LAYOUT = {  # family: (the attention's path, q/k/v source, output projection)
    "llama": ("model.layers.1.self_attn", "q_proj", "o_proj"),
    "qwen2": ("model.layers.1.self_attn", "q_proj", "o_proj"),
    "gpt2": ("transformer.h.1.attn", "c_attn", "c_proj"),
    "gpt_neox": ("gpt_neox.layers.1.attention", "query_key_value", "dense"),
}


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_head_hooks_are_the_models_own_tensors(hf_models, family):
    model = hf_models[family]
    toks = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    names = [f"blocks.1.attn.hook_{n}" for n in ("q", "k", "v", "z", "pattern")]
    _, caches = model.run_with_pass_caches(toks, passes=1, names_filter=names)
    c = caches.of_pass(1)
    B, T, dh = 2, 9, model.cfg.d_model // model.n_heads
    attn, src, out = LAYOUT[family]
    z = _raw(f"{attn}.{out}", model, toks, pre=True)
    torch.testing.assert_close(c["blocks.1.attn.hook_z"].reshape(B, T, -1), z)
    raw = _raw(f"{attn}.{src}", model, toks)
    if family == "gpt2":
        q, k, v = raw.chunk(3, dim=-1)
    elif family == "gpt_neox":
        q, k, v = (x.reshape(B, T, -1) for x in raw.view(B, T, -1, 3, dh).unbind(3))
    else:
        q = raw
        k = _raw(f"{attn}.k_proj", model, toks)
        v = _raw(f"{attn}.v_proj", model, toks)
    for name, ref in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(c[f"blocks.1.attn.hook_{name}"].reshape(B, T, -1), ref)
    model.hf.config._attn_implementation = "eager"
    try:
        own = model.hf(input_ids=toks, output_attentions=True).attentions[1]
    finally:
        model.hf.config._attn_implementation = "sdpa"
    torch.testing.assert_close(c["blocks.1.attn.hook_pattern"], own, atol=1e-6, rtol=1e-5)
    assert model.hf.config._attn_implementation == "sdpa"  # eager only while it was hooked


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hugging_face_pattern_in_pass_2_is_the_models_own_on_the_fused_input(hf_models, family):
    model = hf_models[family]
    toks = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    inputs = []  # what the wrapper gives the model in each pass (GPT-2 adds positions after)
    h = model.hf.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: inputs.append(kwargs["inputs_embeds"]), with_kwargs=True
    )
    try:
        _, caches = model.run_with_pass_caches(
            toks, passes=2, names_filter="blocks.1.attn.hook_pattern"
        )
    finally:
        h.remove()
    fused = inputs[1]
    assert not torch.allclose(fused, inputs[0])  # pass 2 is fed back
    pos = torch.arange(9)[None].expand(2, 9)
    model.hf.config._attn_implementation = "eager"
    try:
        own = model.hf(inputs_embeds=fused, position_ids=pos, output_attentions=True).attentions[1]
    finally:
        model.hf.config._attn_implementation = "sdpa"
    torch.testing.assert_close(
        caches.of_pass(2)["blocks.1.attn.hook_pattern"], own, atol=1e-6, rtol=1e-5
    )


@torch.no_grad()
def test_a_hugging_face_pattern_is_read_only(hf_models):
    model = hf_models["llama"]
    toks = torch.randint(1, 40, (1, 5))
    with pytest.raises(ValueError, match="read-only on a Hugging Face model"):
        zero = ("blocks.0.attn.hook_pattern", lambda x, hook: x * 0)
        model.run_with_hooks(toks, fwd_hooks=[zero])
    # the next forward is the model's own again (the hook is gone, sdpa back)
    assert not model.blocks[0].attn.hook_pattern.fwd_hooks
    assert model.hf.config._attn_implementation == "sdpa"


@pytest.fixture(scope="module")
def hf_dm(tmp_path_factory):
    pytest.importorskip("transformers")
    from fbt_probe.hf.tiny import model_folder

    root = tmp_path_factory.mktemp("hfdm")
    folder = model_folder(root / "llama", "llama")
    data = root / "dm.parquet"
    generate_dataset(
        "delayed_memory", data, n_groups=6, distractors=(1, 4), seed=2, twins=True, tokenizer=folder
    )
    return folder, data


@torch.inference_mode()
def test_every_heads_patch_together_is_the_output_projections_input_on_hugging_face(hf_dm):
    from fbt_probe.hf import load_hf
    from fbt_probe.kernels.patching import clean_run, patched_output
    from fbt_probe.prefill import parse_prefill
    from probes.common.twins import answer_logits, batches, pairs_of
    from probes.patch.run import head_hook, twin_acts
    from tasks.dataset import load

    model = load_hf(hf_dm[0])
    pf = parse_prefill("recurrent")
    b = batches(pairs_of(load(hf_dm[1])), 64, "cpu")[0]
    _, acts = twin_acts(model, b, pf, ["blocks.1.attn.hook_z"])
    b.clean = clean_run(model, b.tokens, pf)
    t = torch.arange(b.tokens.shape[1])[None]
    after = (t <= b.answer[:, None]) & (t >= b.label_pos[:, None])
    start = int(b.label_pos.min())
    heads = [
        ("blocks.1.attn.hook_z", head_hook(h, after, acts["blocks.1.attn.hook_z"]))
        for h in range(model.n_heads)
    ]
    a = answer_logits(patched_output(model, b.clean, start, heads), b, start)
    # the reference: the twin's input of o_proj put in by a plain PyTorch hook
    twin_in = acts["blocks.1.attn.hook_z"].flatten(2)
    proj = model.hf.model.layers[1].self_attn.o_proj

    def swap(mod, args):
        x = args[0]
        off = x.shape[1]  # the patched run covers positions start .. end
        m = after[:, -off:, None]
        return (torch.where(m, twin_in[:, -off:], x),)

    h = proj.register_forward_pre_hook(swap)
    try:
        ref = answer_logits(patched_output(model, b.clean, start), b, start)
    finally:
        h.remove()
    torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    assert float((a - answer_logits(b.clean.out, b, 0)).abs().max()) > 1e-4


def test_heads_command_on_the_default_model(tmp_path):
    data = tmp_path / "dm.parquet"
    generate_dataset("delayed_memory", data, n_groups=6, distractors=(1, 5), seed=3, twins=True)
    out = tmp_path / "h"
    r = CliRunner().invoke(app, ["heads", "--data", str(data), "--out", str(out)])
    assert r.exit_code == 0, r.output
    model = resolve_model("default")[0]
    L, H = model.cfg.n_layers, model.n_heads
    df = pd.read_csv(out / "heads.csv", dtype={"distractors": str})
    assert len(df) == 2 * L * H * (3 * 3 + 1)  # three measures x 3 cells, and induction
    assert set(df.metric) == {"prev_token", "label", "label_next", "induction"}
    assert ((df.ci_low <= df.value + 1e-9) & (df.value <= df.ci_high + 1e-9)).all()
    assert df.value.between(0, 1).all()
    pat = pd.read_csv(out / "heads_pattern.csv")
    meta = json.loads((out / "heads.json").read_text())
    shown = meta["shown"]["delayed_memory"]
    assert shown["distractors"] == 5
    assert len(pat) == 2 * L * H * len(set(pat.position)) and pat.is_label.sum() == 2 * L * H
    # every head's row is a distribution over the positions up to the read one
    np.testing.assert_allclose(pat.groupby(["pass", "layer", "head"]).weight.sum(), 1, atol=1e-5)
    for stem in ("heads", "heads_pattern"):
        assert (out / "figures" / f"{stem}_delayed_memory.png").stat().st_size > 0
    assert "strongest attention to the label token" in r.output


def test_heads_and_patch_commands_on_a_hugging_face_model(hf_dm, tmp_path):
    folder, data = hf_dm
    r = CliRunner().invoke(
        app,
        [
            "heads",
            "--model",
            str(folder),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "h"),
            "--prefill",
            "k3",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "h" / "heads.csv")
    assert sorted(set(df["pass"])) == [1, 2, 3] and len(set(df["head"])) == 4
    r = CliRunner().invoke(
        app, ["patch", "--model", str(folder), "--data", str(data), "--out", str(tmp_path / "p")]
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "p" / "patch.csv")
    paths = df[(df.intervention == "patch_path") & (df.metric == "logit_diff")]
    # 4 query heads, 2 key-value heads (grouped-query attention)
    assert paths.groupby("site").size().to_dict() == {
        "blocks.0.attn.hook_q": 4,
        "blocks.0.attn.hook_k": 2,
        "blocks.0.attn.hook_v": 2,
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prefill", "k0"], "error: --prefill: unknown prefill 'k0'"),
        (["--prefill", "k17"], "error: --prefill k17: this command reads k1 to k16"),
        (["--passes", "3"], "error: --passes is gone: use --prefill k3"),
        (["--task", "nope"], "error: --task: unknown task"),
    ],
)
def test_heads_refuses_bad_input_in_one_line(tmp_path, args, message):
    r = CliRunner().invoke(app, ["heads", "--out", str(tmp_path / "h"), *args])
    assert r.exit_code == 1 and r.output.startswith(message), r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "h").exists()

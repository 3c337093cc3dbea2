"""Hugging Face causal LMs as full-bandwidth models (fbt_probe.hf), on tiny random models built
from configs here and saved with save_pretrained into temporary folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fbt_probe.decode import generate_tokens
from fbt_probe.hf import FUSION_CONFIG, FUSION_WEIGHTS, HFFeedbackModel, load_hf, save_hf
from fbt_probe.hf.tiny import VOCAB, tiny_hf
from fbt_probe.loading import resolve_model
from fbt_probe.prefill import Prefill
from fbt_probe.recurrence import run_recurrence

transformers = pytest.importorskip("transformers")
TOL = {"atol": 1e-5, "rtol": 1e-5}


FAMILIES = ["llama", "gpt2", "qwen2", "gpt_neox"]


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    """A plain save_pretrained folder (no fusion files: an upcycling start)."""
    out = tmp_path_factory.mktemp(request.param)
    tiny_hf(request.param).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def model(folder):
    m = load_hf(folder)
    with torch.no_grad():  # a fusion that matters: the fresh one is close to a constant gate
        g = torch.Generator().manual_seed(1)
        for p in m.fusion.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def toks(B=2, T=9, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_pass_one_equals_the_models_own_logits(model):
    t = toks()
    ref = model.hf(input_ids=t).logits
    out = model(t, passes=1)
    assert (out.logits - ref).abs().max() <= 1e-5
    # the top state is the last hidden state after the final norm: the head maps it to logits
    hs = model.hf(input_ids=t, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(out.states, hs, **TOL)


@torch.no_grad()
def test_k_jacobi_passes_equal_the_exact_recurrence_on_the_first_k_positions(model):
    t = toks(T=8)
    rec = run_recurrence(model, t)
    out = model(t, passes=4)
    for k in range(1, 5):
        torch.testing.assert_close(out.passes[k - 1].states[:, :k], rec.states[:, :k], **TOL)
    assert (out.passes[3].states[:, 5:] - rec.states[:, 5:]).abs().max() > 1e-4


def _recompute(model: HFFeedbackModel, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Top states of the whole stack over these block-0 inputs, no cache."""
    x = torch.stack(inputs, 1)
    return model.hf.base_model(inputs_embeds=x, use_cache=False).last_hidden_state


def _fuse(model: HFFeedbackModel, h_prev, e):
    f = model.fusion
    v = (h_prev @ f.W_U.T) * torch.sigmoid(e @ f.W_G.T)
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + f.norm.eps) * f.norm.w


@torch.no_grad()
@pytest.mark.parametrize("mode", ["standard", "soft", "fused", "full"])
def test_kv_cached_decoding_equals_recomputation(model, mode):
    prompt = toks(T=6, seed=3)
    new, states = generate_tokens(model, prompt, mode=mode, max_new_tokens=4, return_states=True)
    seq = torch.cat([prompt, new], dim=1)
    T = prompt.shape[1]
    e = model.hf.get_input_embeddings()(seq)
    head = model.hf.get_output_embeddings()
    if mode in ("standard", "soft"):
        inputs = list(e[:, :T].unbind(1))
    else:
        hs = _recompute(model, list(e[:, :T].unbind(1)))
        if mode == "full":
            hs = run_recurrence(model, prompt).states
        inputs = [e[:, 0]] + [_fuse(model, hs[:, i - 1], e[:, i]) for i in range(1, T)]
    h = _recompute(model, inputs)
    assert torch.equal(head(h[:, -1]).argmax(-1), new[:, 0])
    ref = [h[:, -1]]
    for j in range(1, 4):
        i = T + j - 1
        inputs.append(e[:, i] if mode == "standard" else _fuse(model, h[:, i - 1], e[:, i]))
        h = _recompute(model, inputs)
        assert torch.equal(head(h[:, -1]).argmax(-1), new[:, j])
        ref.append(h[:, -1])
    torch.testing.assert_close(states, torch.stack(ref, 1), **TOL)


@torch.no_grad()
def test_per_pass_caches_do_not_overwrite_each_other(model):
    t = toks()
    names = [
        "hook_embed",
        "blocks.0.hook_resid_pre",
        "blocks.1.hook_resid_post",
        "ln_final.hook_normalized",
        "fusion.hook_fused",
    ]
    out, caches = model.run_with_pass_caches(t, passes=3, names_filter=names)
    assert len(caches) == 3 and "fusion.hook_fused" not in caches.of_pass(1)
    for k in range(3):
        torch.testing.assert_close(
            caches.of_pass(k + 1)["ln_final.hook_normalized"], out.passes[k].states
        )
        assert caches.of_pass(k + 1)["blocks.1.hook_resid_post"].shape == (2, 9, 32)
    pre = [c["blocks.0.hook_resid_pre"] for c in caches]
    torch.testing.assert_close(pre[1][:, 0], pre[0][:, 0])  # position 0 stays plain
    assert (pre[1][:, 1:] - pre[0][:, 1:]).abs().amin(-1).min() > 0  # every later one is fused
    post = [c["blocks.1.hook_resid_post"] for c in caches]
    assert (post[1] - post[2]).abs().max() > 0


@torch.no_grad()
def test_save_then_load_gives_identical_logits(model, tmp_path):
    save_hf(model, tmp_path / "m")
    back = load_hf(tmp_path / "m")
    t = toks(seed=7)
    assert torch.equal(back(t, passes=3).logits, model(t, passes=3).logits)
    assert json.loads((tmp_path / "m" / FUSION_CONFIG).read_text())["fusion"] == "gated"


def test_a_fusion_config_that_disagrees_with_its_weights_is_refused(model, tmp_path):
    save_hf(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / FUSION_CONFIG).read_text())
    (tmp_path / "m" / FUSION_CONFIG).write_text(json.dumps({**cfg, "fusion": "additive"}))
    with pytest.raises(ValueError, match="does not match"):
        load_hf(tmp_path / "m")
    (tmp_path / "m" / FUSION_WEIGHTS).unlink()
    with pytest.raises(ValueError, match="both or neither"):
        load_hf(tmp_path / "m")


@torch.no_grad()
@pytest.mark.parametrize("fusion", ["additive", "none"])
def test_the_fusion_ablations(folder, fusion):
    m = load_hf(folder, fusion=fusion)
    t = toks(T=7)
    out = m(t, passes=3)
    if fusion == "none":  # no feedback: every pass is pass 1
        for p in out.passes[1:]:
            torch.testing.assert_close(p.logits, out.passes[0].logits, **TOL)
        return
    rec = run_recurrence(m, t)
    for k in (1, 2, 3):
        torch.testing.assert_close(out.passes[k - 1].states[:, :k], rec.states[:, :k], **TOL)
    assert m.fusion.W_G is None and (out.passes[2].logits - out.passes[0].logits).abs().max() > 0


# ---- interventions: patched re-runs through the Hugging Face cache ---------------------
def _every(tokens):
    return torch.ones_like(tokens, dtype=torch.bool)


@pytest.mark.parametrize("passes", [2, None])
def test_a_self_patch_changes_nothing_and_each_run_restores_the_cache(model, passes):
    from fbt_probe.kernels.patching import STATE_HOOK, clean_run, patched_run, replace_where

    t = toks(B=3, T=11)
    c = clean_run(model, t, Prefill(passes))
    other = clean_run(model, toks(B=3, T=11, seed=1), Prefill(passes), keep_cache=False)
    # a patch that changes the answers, from a late position, then self patches from
    # earlier positions: each must find the clean keys and values again
    changed = patched_run(model, c, 6, [(STATE_HOOK, replace_where(_every(t), other.fed))])
    assert (changed - c.logits[:, 6:]).abs().max() > 1e-4
    for s in (1, 3, 8):
        lg = patched_run(model, c, s, [(STATE_HOOK, replace_where(_every(t), c.fed))])
        torch.testing.assert_close(lg, c.logits[:, s:], **TOL)


@pytest.mark.parametrize("passes", [2, None])
def test_interchanging_every_state_and_token_gives_the_other_run(model, passes):
    from fbt_probe.kernels.patching import STATE_HOOK, clean_run, patched_run, replace_where

    a, b = toks(B=2, T=10, seed=2), toks(B=2, T=10, seed=3)
    c = clean_run(model, a, Prefill(passes))
    w = clean_run(model, b, Prefill(passes), keep_cache=False)
    lg = patched_run(model, c, 0, [(STATE_HOOK, replace_where(_every(a), w.fed))], emb=w.emb)
    torch.testing.assert_close(lg, w.logits, **TOL)


def test_a_recurrence_patch_resumed_from_t_equals_the_whole_patched_recurrence(model):
    from fbt_probe.kernels.patching import STATE_HOOK, clean_run, patched_run, replace_where

    a, t = toks(B=2, T=12, seed=4), 7
    mask = torch.zeros_like(a, dtype=torch.bool)
    mask[:, t] = True
    hook = (STATE_HOOK, replace_where(mask, torch.zeros(*a.shape, model.cfg.d_model)))
    with model.hooks(fwd_hooks=[hook]):
        whole = run_recurrence(model, a)
    c = clean_run(model, a, Prefill(None))
    torch.testing.assert_close(whole.logits[:, :t], c.logits[:, :t], atol=0, rtol=0)
    torch.testing.assert_close(patched_run(model, c, t, [hook]), whole.logits[:, t:], **TOL)


@pytest.mark.parametrize("passes", [1, 2, None])
def test_a_hugging_face_run_from_depth_d_equals_the_whole_stacks_run(model, passes):
    """Where position enters inside the layers (rotary), a patched run starts at decoder layer
    d with the model's own rotary embeddings and masks; GPT-2 adds position embeddings to its
    input and runs whole."""
    from fbt_probe.kernels.patching import STATE_HOOK, clean_run, patched_run, replace_where

    t = toks(B=3, T=11)
    c = clean_run(model, t, Prefill(passes))
    if model.cfg.architecture.lower().startswith("gpt2"):
        assert not model.skips_layers and c.resid is None
        with pytest.raises(ValueError, match="runs its stack whole"):
            patched_run(model, c, 1, [], from_layer=1)
        return
    assert model.skips_layers and c.resid is not None
    for d in range(1, model.cfg.n_layers):
        for start in (0, 4):
            torch.testing.assert_close(
                patched_run(model, c, start, [], from_layer=d), c.logits[:, start:], **TOL
            )
    # a patch at block d's input, run from d, equals the same patch run from layer 0
    d, name = 1, "blocks.1.hook_resid_pre"
    other = clean_run(model, toks(B=3, T=11, seed=5), Prefill(passes), keep_cache=False)
    mask = torch.zeros_like(t, dtype=torch.bool)
    mask[:, 10] = True
    patch = [(name, replace_where(mask, torch.randn(3, 11, model.cfg.d_model)))]
    torch.testing.assert_close(
        patched_run(model, c, 10, patch, from_layer=d), patched_run(model, c, 10, patch), **TOL
    )
    assert STATE_HOOK and (other.logits - c.logits).abs().max() > 0


def test_tiny_hf_model_script_writes_a_folder_every_command_loads(tmp_path, monkeypatch):
    import runpy
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "tiny_hf_model.py"
    out = tmp_path / "m"

    def run(*args):  # as `python scripts/tiny_hf_model.py ARGS` runs it, in this process
        monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
        runpy.run_path(str(script), run_name="__main__")

    run(out, "--family", "gpt2")
    model, _ = resolve_model(str(out))
    assert model.cfg.architecture == "GPT2LMHeadModel" and model.encoding is not None
    with pytest.raises(SystemExit) as again:  # sys.exit("error: ..."): exit status 1
        run(out)
    assert "exists" in str(again.value.code)

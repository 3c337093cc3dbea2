"""The model against references with explicit tolerances (GUIDE §4.6)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fbt_probe.checkpoint import load_model, save_model
from fbt_probe.config import FBTConfig, build_cfg
from fbt_probe.decode import generate_tokens
from fbt_probe.recurrence import run_recurrence, run_recurrence_with_cache
from fbt_probe.stack import FBTModel

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(params=["plain", "smeared", "smeared-layer-1"])
def model(request):
    torch.manual_seed(0)
    if request.param == "plain":
        return FBTModel(build_cfg(), seed=0).eval()
    layers = [1] if request.param == "smeared-layer-1" else None
    m = FBTModel(build_cfg(smear_keys=True, smear_layers=layers), seed=0).eval()
    with torch.no_grad():  # a different mix per head, some near each end
        for blk in m.blocks:
            if hasattr(blk.attn, "smear"):
                blk.attn.smear.copy_(torch.tensor([-3.0, -0.5, 0.7, 4.0])[: m.cfg.n_heads])
    return m


def toks(B=3, T=12, seed=1, V=60):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (B, T), generator=g)


# ---- a minimal plain transformer written independently, reading the model's weights ----
def rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_stack(m: FBTModel, x: torch.Tensor) -> torch.Tensor:
    """Plain pre-norm decoder on inputs x (B, T, D); returns the final-normed h."""
    cfg = m.cfg
    B, T, D = x.shape
    H, dh = cfg.n_heads, cfg.d_head
    pos = torch.arange(T, dtype=torch.float64)
    inv = cfg.rope_base ** (-torch.arange(dh // 2, dtype=torch.float64) / (dh // 2))
    ang = (pos[:, None] * inv[None]).float()
    cos, sin = ang.cos(), ang.sin()

    def rot(v):  # v: (B, H, T, dh), rotate pairs (i, i + dh/2)
        a, b = v[..., : dh // 2], v[..., dh // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    s = 1 / math.sqrt(2 * cfg.n_layers)
    for blk in m.blocks:
        y = rms(x, blk.ln1.w, cfg.norm_eps)
        q, k, v = (
            (y @ W.T).view(B, T, H, dh).transpose(1, 2)
            for W in (blk.attn.W_Q, blk.attn.W_K, blk.attn.W_V)
        )
        q, k = rot(q), rot(k)
        if hasattr(blk.attn, "smear"):  # k'_t = a k_t + (1 - a) k_{t-1}, zero before position 0
            a = torch.sigmoid(blk.attn.smear).view(1, H, 1, 1)
            k = a * k + (1 - a) * F.pad(k, (0, 0, 1, 0))[:, :, :T]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        z = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
        x = x + s * (z @ blk.attn.W_O.T)
        y = rms(x, blk.ln2.w, cfg.norm_eps)
        x = x + s * (F.gelu(y @ blk.mlp.W_in.T) @ blk.mlp.W_out.T)
    return rms(x, m.ln_final.w, cfg.norm_eps)


def reference_embed(m, t):
    return m.W_E[t] * math.sqrt(m.cfg.d_model)


def reference_fuse(m, h_prev, e):
    if m.cfg.fusion == "gated":
        return rms(
            (h_prev @ m.fusion.W_U.T) * torch.sigmoid(e @ m.fusion.W_G.T),
            m.fusion.norm.w,
            m.cfg.norm_eps,
        )
    return rms(e + h_prev @ m.fusion.W_U.T, m.fusion.norm.w, m.cfg.norm_eps)


def reference_recurrence(m, t, prefix=1):
    """Sequential recurrence recomputed from scratch at every position (no KV cache)."""
    e = reference_embed(m, t)
    inputs = [e[:, i] for i in range(prefix)]
    hs = reference_stack(m, torch.stack(inputs, 1))
    for i in range(prefix, t.shape[1]):
        inputs.append(reference_fuse(m, hs[:, i - 1], e[:, i]))
        hs = reference_stack(m, torch.stack(inputs, 1))
    return hs


# ---- tests ----
@torch.no_grad()
@pytest.mark.parametrize("fusion", ["gated", "additive", "none"])
def test_pass_one_equals_plain_transformer(fusion):
    m = FBTModel(build_cfg(fusion=fusion), seed=3).eval()
    t = toks()
    out = m(t, passes=1)
    ref = reference_stack(m, reference_embed(m, t))
    torch.testing.assert_close(out.states, ref, **TOL)
    torch.testing.assert_close(out.logits, ref @ m.W_E.T, **TOL)
    if fusion == "none":  # no feedback: every pass is pass 1
        torch.testing.assert_close(m(t, passes=3).states, out.states, **TOL)


@torch.no_grad()
def test_smeared_keys_keep_the_seeds_other_weights_and_change_the_output():
    plain = FBTModel(build_cfg(), seed=3).eval()
    smeared = FBTModel(build_cfg(smear_keys=True), seed=3).eval()
    sd = smeared.state_dict()
    assert {n for n in sd if n.endswith(".smear")} == {f"blocks.{i}.attn.smear" for i in range(2)}
    for n, p in plain.state_dict().items():  # the smear parameters draw nothing
        assert torch.equal(sd[n], p), n
    assert all(torch.equal(sd[f"blocks.{i}.attn.smear"], torch.zeros(4)) for i in range(2))
    t = toks()
    out = smeared(t, passes=1)
    torch.testing.assert_close(
        out.states, reference_stack(smeared, reference_embed(smeared, t)), **TOL
    )
    assert (out.states - plain(t, passes=1).states).abs().max() > 1e-3
    spread = FBTModel(build_cfg(smear_keys=True, smear_spread=2.0), seed=3)
    torch.testing.assert_close(
        spread.blocks[1].attn.smear.detach(), torch.tensor([-2, -2 / 3, 2 / 3, 2])
    )
    assert torch.equal(spread.blocks[0].attn.W_K, plain.blocks[0].attn.W_K)
    # smear_layers: only the layers named smear; the output is the reference's with block 0 plain
    upper = FBTModel(build_cfg(smear_keys=True, smear_layers=[1]), seed=3).eval()
    assert upper.cfg.smear_layers == (1,) and not hasattr(upper.blocks[0].attn, "smear")
    assert {n for n in upper.state_dict() if n.endswith(".smear")} == {"blocks.1.attn.smear"}
    upper.blocks[1].attn.smear.fill_(-1.5)
    out = upper(t, passes=1)
    torch.testing.assert_close(out.states, reference_stack(upper, reference_embed(upper, t)), **TOL)
    smeared.blocks[1].attn.smear.fill_(-1.5)  # both layers smeared: another output
    assert (out.states - smeared(t, passes=1).states).abs().max() > 1e-3
    assert FBTConfig.from_dict(upper.cfg.to_dict()) == upper.cfg


@torch.no_grad()
def test_the_schedules_smear_share_moves_the_keys_between_plain_and_learned():
    from fbt_probe.train.objective import smear_hooks

    plain = FBTModel(build_cfg(), seed=3).eval()
    smeared = FBTModel(build_cfg(smear_keys=True), seed=3).eval()
    for blk in smeared.blocks:
        blk.attn.smear.copy_(torch.tensor([-3.0, -0.5, 0.7, 4.0]))
    t = toks()
    learned = smeared(t, passes=2).states
    with smeared.hooks(fwd_hooks=smear_hooks(smeared, 0.0)):  # every key plain
        torch.testing.assert_close(smeared(t, passes=2).states, plain(t, passes=2).states, **TOL)
    # 30 % of each head's previous-key weight: a = 1 - 0.3 (1 - a)
    with smeared.hooks(fwd_hooks=smear_hooks(smeared, 0.3)):
        partial = smeared(t, passes=1).states
    ref = FBTModel(build_cfg(smear_keys=True), seed=3).eval()
    for blk, src in zip(ref.blocks, smeared.blocks, strict=True):
        a = 1 - 0.3 * (1 - torch.sigmoid(src.attn.smear))
        blk.attn.smear.copy_(torch.logit(a.double()).float())
    torch.testing.assert_close(partial, reference_stack(ref, reference_embed(ref, t)), **TOL)
    assert smear_hooks(smeared, 1.0) == []
    assert torch.equal(smeared(t, passes=2).states, learned)
    # the partial share is neither end: 10x the tolerance away from plain, and short of learned
    gap = (partial - plain(t, passes=1).states).abs().max()
    assert gap > 10 * TOL["atol"]
    assert gap < (smeared(t, passes=1).states - plain(t, passes=1).states).abs().max()


@torch.no_grad()
def test_jacobi_passes_equal_recurrence_on_first_k_positions(model):
    t = toks(T=9)
    rec = run_recurrence(model, t).states
    ref = reference_recurrence(model, t)
    torch.testing.assert_close(rec, ref, **TOL)  # KV-cached recurrence = recomputation
    out = model(t, passes=9)
    for k in (1, 2, 3, 5, 9):
        torch.testing.assert_close(out.passes[k - 1].states[:, :k], rec[:, :k], **TOL)
    # and pass 2 really differs from the recurrence beyond position 1 (the test can fail)
    assert (out.passes[1].states[:, 3:] - rec[:, 3:]).abs().max() > 1e-3


@torch.no_grad()
def test_init_states_continue_the_jacobi_iteration(model):
    # a forward from pass 3's states is passes 4.. of one long forward (training's
    # fixed-point batches rely on it), padded batches included
    t = toks(T=11)
    lengths = torch.tensor([11, 7, 9])
    full = model(t, passes=5, lengths=lengths)
    warm = model(t, passes=3, lengths=lengths).states
    cont = model(t, passes=2, lengths=lengths, init_states=warm)
    for a, b in zip(full.passes[3:], cont.passes, strict=True):
        torch.testing.assert_close(b.logits, a.logits, **TOL)
        torch.testing.assert_close(b.states, a.states, **TOL)
    # from pass 1's states instead, pass 1 of the continuation is pass 2, not pass 4
    one = model(t, passes=1, init_states=model(t, passes=1).states)
    assert (one.logits - full.passes[3].logits).abs().max() > 1e-3
    with pytest.raises(ValueError, match="init_states must be"):
        model(t, passes=1, init_states=warm[:, :5])


@torch.no_grad()
def test_pass_two_block_zero_input_by_hand(model):
    t = toks()
    _, caches = model.run_with_pass_caches(t, passes=2)
    h1 = caches.of_pass(1)["ln_final.hook_normalized"]
    e = caches.of_pass(1)["hook_embed"]
    by_hand = rms(
        (h1[:, :-1] @ model.fusion.W_U.T) * torch.sigmoid(e[:, 1:] @ model.fusion.W_G.T),
        model.fusion.norm.w,
        1e-6,
    )
    got = caches.of_pass(2)["blocks.0.hook_resid_pre"]
    torch.testing.assert_close(got[:, 1:], by_hand, **TOL)
    torch.testing.assert_close(got[:, 0], e[:, 0], **TOL)  # position 0 has no previous state
    torch.testing.assert_close(caches.of_pass(1)["blocks.0.hook_resid_pre"], e, **TOL)
    assert not torch.allclose(
        caches.of_pass(1)["blocks.1.hook_resid_pre"], caches.of_pass(2)["blocks.1.hook_resid_pre"]
    )


@torch.no_grad()
def test_position_cache_equals_full_cache_slice(model):
    t = toks(B=4, T=10)
    pos = torch.tensor([2, 9, 0, 5])

    def names(n):
        return n.endswith(("hook_resid_pre", "hook_pattern")) or n.startswith("fusion")

    _, full = model.run_with_pass_caches(t, passes=3, names_filter=names)
    _, small = model.run_with_pass_caches(t, passes=3, names_filter=names, positions=pos)
    b = torch.arange(4)
    for k in range(3):
        for name in full.of_pass(k + 1).keys():
            if name.endswith("hook_pattern"):
                torch.testing.assert_close(
                    small.of_pass(k + 1)[name], full.of_pass(k + 1)[name][b, :, pos]
                )
            else:
                torch.testing.assert_close(
                    small.of_pass(k + 1)[name], full.of_pass(k + 1)[name][b, pos]
                )
    assert small.of_pass(1)["blocks.0.hook_resid_pre"].shape == (4, 32)
    # the last pass alone (what a many-pass probe keeps): the same tensors, one cache
    out, last = model.run_with_pass_caches(
        t, passes=3, names_filter=names, positions=pos, last_only=True
    )
    assert len(last) == 1 and len(out.passes) == 1 and list(last.passes) == [3]
    assert set(last.of_pass(3).keys()) == set(small.of_pass(3).keys())
    with pytest.raises(
        TypeError, match=r"caches\[1\] counted passes from 0 and is gone: use caches.of_pass\(2\)"
    ):
        small[1]  # the old index of pass 2 never quietly reads pass 1
    for name in small.of_pass(3).keys():
        assert torch.equal(last.last[name], small.of_pass(3)[name])
    # full recurrence with colon-only caching equals its own states at those positions
    rec, cache = run_recurrence_with_cache(
        model, t, names_filter="ln_final.hook_normalized", positions=pos
    )
    torch.testing.assert_close(cache["ln_final.hook_normalized"], rec.states[b, pos])


def test_run_with_cache_refuses_to_overwrite_passes(model):
    with pytest.raises(ValueError, match="overwrite"):
        model.run_with_cache(toks(), passes=2)


@torch.no_grad()
def test_prefix_mixin_keeps_prefix_plain(model):
    t = toks(B=2, T=10)
    out = model(t, passes=2, prefix_len=torch.tensor([4, 7]))
    p1 = model(t, passes=1)
    torch.testing.assert_close(out.passes[1].states[0, :4], p1.states[0, :4], **TOL)
    torch.testing.assert_close(out.passes[1].states[1, :7], p1.states[1, :7], **TOL)
    assert (out.passes[1].states[0, 4:] - p1.states[0, 4:]).abs().max() > 1e-3
    rec = run_recurrence(model, t, prefix_len=torch.tensor([4, 7]))
    torch.testing.assert_close(
        rec.states,
        torch.cat([reference_recurrence(model, t[:1], 4), reference_recurrence(model, t[1:], 7)]),
        **TOL,
    )


@torch.no_grad()
def test_right_padded_batch_equals_unbatched(model):
    a, b = toks(B=1, T=11, seed=5)[0], toks(B=1, T=6, seed=6)[0]
    batch = torch.zeros(2, 11, dtype=torch.long)
    batch[0], batch[1, :6] = a, b
    out = model(batch, passes=3, lengths=torch.tensor([11, 6]))
    for k in range(3):
        torch.testing.assert_close(
            out.passes[k].states[0], model(a[None], passes=3).passes[k].states[0], **TOL
        )
        torch.testing.assert_close(
            out.passes[k].states[1, :6], model(b[None], passes=3).passes[k].states[0], **TOL
        )
        assert out.passes[k].states[1, 6:].abs().max() == 0
    rec = run_recurrence(model, batch)
    torch.testing.assert_close(rec.states[1, :6], run_recurrence(model, b[None]).states[0], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["standard", "soft", "fused", "full"])
def test_kv_cached_decoding_equals_recomputation(model, mode):
    prompt = toks(B=2, T=6)
    new, states = generate_tokens(model, prompt, mode=mode, max_new_tokens=5, return_states=True)
    seq = torch.cat([prompt, new], dim=1)
    T = prompt.shape[1]
    e = reference_embed(model, seq)
    # from scratch: rebuild every input, recompute the whole stack at every step
    if mode in ("standard", "soft"):
        prompt_inputs = list(e[:, :T].unbind(1))
    elif mode == "fused":
        h1 = reference_stack(model, e[:, :T])
        prompt_inputs = [e[:, 0]] + [
            reference_fuse(model, h1[:, i - 1], e[:, i]) for i in range(1, T)
        ]
    else:
        hs = reference_recurrence(model, seq[:, :T])
        prompt_inputs = [e[:, 0]] + [
            reference_fuse(model, hs[:, i - 1], e[:, i]) for i in range(1, T)
        ]
    inputs = list(prompt_inputs)
    h = reference_stack(model, torch.stack(inputs, 1))
    assert torch.equal((h[:, -1] @ model.W_E.T).argmax(-1), new[:, 0])
    ref_states = [h[:, -1]]
    for j in range(1, 5):
        i = T + j - 1
        inputs.append(
            e[:, i] if mode == "standard" else reference_fuse(model, h[:, i - 1], e[:, i])
        )
        h = reference_stack(model, torch.stack(inputs, 1))
        assert torch.equal((h[:, -1] @ model.W_E.T).argmax(-1), new[:, j])
        ref_states.append(h[:, -1])
    torch.testing.assert_close(states, torch.stack(ref_states, 1), **TOL)


@torch.no_grad()
def test_soft_equals_recurrence_with_prompt_as_prefix(model):
    prompt = toks(B=2, T=5)
    new, states = generate_tokens(model, prompt, mode="soft", max_new_tokens=4, return_states=True)
    rec = run_recurrence(model, torch.cat([prompt, new], 1), prefix_len=5).states
    torch.testing.assert_close(states, rec[:, 4:8], **TOL)


def test_jitter_only_in_training(model):
    from fbt_probe.train.objective import jitter_hook
    from fbt_probe.train.steps import JitterNoise

    t = toks()
    hook = jitter_hook(model, JitterNoise(3, t.shape[1], model.cfg.d_model), torch.arange(len(t)))
    with torch.no_grad():
        a = model(t, passes=2).states
        with model.hooks(fwd_hooks=[hook]):
            b = model(t, passes=2).states  # eval mode: the training hook adds nothing
            model.train()
            c = model(t, passes=2).states
            model.eval()
        model.train()
        d = model(t, passes=2).states  # train mode alone: the model itself never jitters
        model.eval()
    assert torch.equal(a, b) and torch.equal(a, d)
    assert not torch.equal(a, c) and (a - c).abs().max() < 1.0


def test_save_load_roundtrip_and_errors(model, tmp_path):
    t = toks()
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(loaded(t, passes=2).logits, model(t, passes=2).logits)
    # corrupted weights
    w = tmp_path / "m" / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-10] ^= 0xFF
    w.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupted"):
        load_model(tmp_path / "m")
    # config that does not match the tensors
    save_model(model, tmp_path / "m2")
    cfg = json.loads((tmp_path / "m2" / "config.json").read_text())
    cfg["d_mlp"] = 128
    (tmp_path / "m2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="changed after the model was saved"):
        load_model(tmp_path / "m2")  # the config's hash in meta.json catches any edit
    meta = json.loads((tmp_path / "m2" / "meta.json").read_text())
    del meta["config_sha256"]  # a folder written before configs were hashed
    (tmp_path / "m2" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="d_mlp|shape"):
        load_model(tmp_path / "m2")
    cfg["bogus"] = 1
    (tmp_path / "m2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown key .bogus."):
        load_model(tmp_path / "m2")
    (tmp_path / "m3").mkdir()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(tmp_path / "m3")


@pytest.mark.parametrize(
    "bad",
    [
        dict(d_model=30, n_heads=4),
        dict(fusion="mult"),
        dict(positional="alibi"),
        dict(jitter=-0.1),
        dict(n_layers=0),
        dict(d_vocab=5),
        dict(smear_spread=-1.0),
        dict(smear_layers=[1]),  # without smear_keys
        dict(smear_keys=True, smear_layers=[2]),
        dict(smear_keys=True, smear_layers=[0, 0]),
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError, match="invalid FBTConfig"):
        build_cfg(**bad)
    assert FBTConfig.from_dict(build_cfg().to_dict()) == build_cfg()


def test_context_length_enforced(model):
    with pytest.raises(ValueError, match="context length"):
        model(torch.zeros(1, model.cfg.n_ctx + 1, dtype=torch.long))

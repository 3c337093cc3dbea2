"""Hooks while generating and the closed-loop battery (``fbt_probe.kernels.generation``), against
plain decoding and a from-scratch recomputation, in every decoding mode."""

from __future__ import annotations

import pytest
import torch

from fbt_probe.config import build_cfg
from fbt_probe.decode import decode, generate_tokens
from fbt_probe.hooks import at
from fbt_probe.kernels.generation import KINDS, closed_loop, step_residuals
from fbt_probe.prefill import MODES
from fbt_probe.stack import FBTModel

STEPS = 6


@pytest.fixture(scope="module")
def model():
    return FBTModel(build_cfg(d_model=32, n_layers=2, n_heads=2, d_mlp=64, n_ctx=64), seed=1).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, 60, (5, 10), generator=g)
    q = p.clone()
    q[:, 3] = torch.randint(3, 60, (5,), generator=g)  # the twin: one prompt word changed
    return p, q


def noise(x, hook):
    return torch.randn_like(x) * 3


@pytest.mark.parametrize("mode", list(MODES))
def test_decoding_with_no_intervention_equals_generate(model, prompts, mode):
    p, q = prompts
    ref = generate_tokens(model, p, mode, STEPS)
    seen = []
    read_only = at(lambda x, hook: seen.append(hook.ctx["decode_step"]), decode_steps=[2, 4])
    hooked = decode(model, p, mode, STEPS, fwd_hooks=[("blocks.0.hook_resid_pre", read_only)])
    assert torch.equal(hooked.tokens, ref) and seen == [2, 4]
    r = closed_loop(model, p, q, mode, STEPS)
    assert torch.equal(r.clean.tokens, ref)
    assert torch.equal(r.twin.tokens, generate_tokens(model, q, mode, STEPS))


@pytest.mark.parametrize("mode", ["soft", "fused", "full"])
@pytest.mark.parametrize("s", [1, 3, 5])
def test_a_state_interchange_at_step_s_changes_nothing_before_s(model, prompts, mode, s):
    p, _ = prompts
    clean = decode(model, p, mode, STEPS, keep_logits=True)
    hit = decode(
        model,
        p,
        mode,
        STEPS,
        keep_logits=True,
        fwd_hooks=[("fusion.hook_state", at(noise, decode_steps=s))],
    )
    assert torch.equal(hit.logits[:, :s], clean.logits[:, :s])
    assert torch.equal(hit.tokens[:, :s], clean.tokens[:, :s])
    assert not torch.allclose(hit.logits[:, s], clean.logits[:, s])  # the hook did act at s


def test_under_standard_decoding_a_state_interchange_changes_nothing(model, prompts):
    p, q = prompts
    clean = decode(model, p, "standard", STEPS, keep_logits=True)
    hit = decode(
        model,
        p,
        "standard",
        STEPS,
        keep_logits=True,
        fwd_hooks=[("fusion.hook_state", at(noise, decode_steps=range(1, STEPS)))],
    )
    assert torch.equal(hit.logits, clean.logits)
    r = closed_loop(model, p, q, "standard", STEPS, kinds=("state",))
    for s in r.steps:
        assert torch.equal(r.tokens["state", s], r.clean.tokens)
        assert torch.equal(r.pair_logits["state", s], r.pair_logits[None])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_self_interchange_changes_nothing(model, prompts, mode):
    p, _ = prompts
    r = closed_loop(model, p, p.clone(), mode, STEPS)
    for kind in KINDS:
        for s in r.steps:
            assert torch.equal(r.tokens[kind, s], r.clean.tokens)
            torch.testing.assert_close(
                r.pair_logits[kind, s], r.pair_logits[None], atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("mode", ["standard", "soft", "fused", "full"])
def test_the_battery_reusing_the_cache_equals_generating_again(model, prompts, mode):
    """Each swapped run continues from the clean run's KV cache; the reference generates the
    whole example again with the same hooks."""
    p, q = prompts
    r = closed_loop(model, p, q, mode, STEPS)
    twin = decode(model, q, mode, STEPS)
    emb = model.embed(twin.tokens)
    for kind in KINDS:
        for s in r.steps:
            hooks = []
            if kind != "token":
                v = twin.states[:, s - 1 : s]
                hooks.append(("fusion.hook_state", at(lambda x, hook, v=v: v, decode_steps=s)))
            if kind != "state":
                e = emb[:, s - 1 : s]
                hooks.append(("hook_embed", at(lambda x, hook, e=e: e, decode_steps=s)))
            ref = decode(model, p, mode, STEPS, fwd_hooks=hooks, keep_logits=True)
            assert torch.equal(ref.tokens, r.tokens[kind, s]), (kind, s)
    changed = sum(not torch.equal(r.tokens[k, s], r.clean.tokens) for k in KINDS for s in r.steps)
    assert mode in ("standard", "full") or changed > 0  # the swaps act on this random model


def test_step_residuals_read_the_generated_tokens(model, prompts):
    p, _ = prompts
    for mode in MODES:
        d, res = step_residuals(model, p, mode, STEPS)
        assert torch.equal(d.tokens, generate_tokens(model, p, mode, STEPS))
        top = res[model.depth_hooks()[-1]]  # (batch, steps, d_model)
        assert torch.equal(model.read_resid(top).argmax(-1), d.tokens)


def test_the_battery_refuses_what_it_cannot_do(model, prompts):
    p, q = prompts
    with pytest.raises(ValueError, match="same length"):
        closed_loop(model, p, q[:, :-1], "soft", STEPS)
    with pytest.raises(ValueError, match="steps must be in 1..5"):
        closed_loop(model, p, q, "soft", STEPS, steps=[0])
    with pytest.raises(ValueError, match="unknown intervention"):
        closed_loop(model, p, q, "soft", STEPS, kinds=["gate"])


def test_the_battery_on_a_hugging_face_model(tiny_llama):
    from fbt_probe.loading import resolve_model

    m = resolve_model(tiny_llama)[0].eval()
    p = torch.randint(5, 60, (3, 8), generator=torch.Generator().manual_seed(1))
    for mode in ("soft", "fused"):
        r = closed_loop(m, p, p.clone(), mode, 4)
        assert torch.equal(r.clean.tokens, generate_tokens(m, p, mode, 4))
        assert all(torch.equal(v, r.clean.tokens) for v in r.tokens.values())

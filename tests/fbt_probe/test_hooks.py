"""Pass-aware hooks: every hook knows its pass (and recurrence step), ``at`` restricts a hook
to passes, steps and positions, and no hook outlives an error."""

from __future__ import annotations

import pytest
import torch

from fbt_probe.config import build_cfg
from fbt_probe.decode import generate_tokens
from fbt_probe.hooks import at
from fbt_probe.kernels.stability import heldout_batch, jacobi_trajectory
from fbt_probe.recurrence import run_recurrence
from fbt_probe.stack import FBTModel


@pytest.fixture(scope="module")
def model():
    return FBTModel(build_cfg(), seed=0).eval()


def tokens(B=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, (B, T), generator=g)


def no_hooks_left(m: FBTModel) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in m.hook_dict.values())


def test_patching_the_state_in_pass_2_at_one_position(model):
    x = tokens()
    p = 7
    clean = model(x, passes=3)

    def noise(t, hook):
        return t + 5.0

    hooked = model.run_with_hooks(
        x, passes=3, fwd_hooks=[("fusion.hook_state", at(noise, on_pass=2, positions=[p]))]
    )
    # pass 1 is untouched, bit for bit
    assert torch.equal(hooked.passes[0].states, clean.passes[0].states)
    # pass 2 changed only from position p on (attention is causal)
    d = (hooked.passes[1].states - clean.passes[1].states).abs().amax(dim=(0, 2))
    assert torch.all(d[:p] == 0) and d[p] > 1e-3
    # pass 3 sees pass 2's changed states: it differs from position p on too, not before
    d3 = (hooked.passes[2].states - clean.passes[2].states).abs().amax(dim=(0, 2))
    assert torch.all(d3[:p] == 0) and d3[p:].max() > 1e-4
    assert no_hooks_left(model)


def test_positions_per_example_and_a_patch_with_the_clean_values_changes_nothing(model):
    x = tokens()
    clean = model(x, passes=2)
    seen = {}

    def grab(t, hook):
        seen[hook.ctx["pass_number"]] = t.clone()

    model.run_with_hooks(x, passes=2, fwd_hooks=[("fusion.hook_state", at(grab))])
    assert set(seen) == {2}  # pass 1 has no feedback: the fusion fires in pass 2 only
    own = seen[2]
    out = model.run_with_hooks(
        x, passes=2, fwd_hooks=[("fusion.hook_state", at(lambda t, h: own, on_pass=2))]
    )
    assert torch.equal(out.logits, clean.logits)
    # a (batch,) tensor: one position per example
    where = torch.tensor([2, 5, 9])
    out = model.run_with_hooks(
        x, passes=2, fwd_hooks=[("fusion.hook_state", at(lambda t, h: t * 0, positions=where))]
    )
    for b, p in enumerate(where.tolist()):
        d = (out.passes[1].states[b] - clean.passes[1].states[b]).abs().amax(dim=-1)
        assert torch.all(d[:p] == 0) and d[p] > 0


def test_a_jacobi_trajectory_fires_hooks_with_pass_indices_in_order(model):
    batch = heldout_batch(("delayed_memory",), n_groups=2, distractors=(1, 3))
    fired = []

    def record(t, hook):
        fired.append(hook.ctx["pass_number"])

    k = 5
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", record)]):
        jacobi_trajectory(model, batch, passes=k, lipschitz_at=())
    assert fired == list(range(1, k + 1))
    assert no_hooks_left(model)


def test_recurrence_and_decoding_report_their_steps(model):
    x = tokens(B=2, T=6)
    ctx = []

    def record(t, hook):
        ctx.append(
            (hook.ctx["pass_number"], hook.ctx["step"], hook.ctx["first_position"], t.shape[1])
        )

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", record)]):
        run_recurrence(model, x)
    assert ctx == [(None, t, t, 1) for t in range(6)]
    ctx.clear()
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", record)]):
        generate_tokens(model, x, mode="fused", max_new_tokens=3)
    assert ctx == [(1, None, 0, 6), (2, None, 0, 6), (None, 6, 6, 1), (None, 7, 7, 1)]
    # a patch restricted to one recurrence step changes that step and later ones only
    clean = run_recurrence(model, x)

    def zero(t, hook):
        return t * 0

    with model.hooks(fwd_hooks=[("fusion.hook_state", at(zero, steps=[3]))]):
        out = run_recurrence(model, x)
    d = (out.states - clean.states).abs().amax(dim=(0, 2))
    assert torch.all(d[:3] == 0) and d[3] > 0


def test_no_hook_outlives_an_error(model):
    x = tokens()
    clean = model(x, passes=2)

    def boom(t, hook):
        raise RuntimeError("a broken hook")

    with pytest.raises(RuntimeError, match="a broken hook"):
        model.run_with_hooks(x, passes=2, fwd_hooks=[("fusion.hook_state", at(boom, on_pass=[2]))])
    assert no_hooks_left(model)
    with pytest.raises(RuntimeError):
        with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", boom)]):
            model(x, passes=2)
    assert no_hooks_left(model)
    assert torch.equal(model(x, passes=2).logits, clean.logits)


def test_fusion_none_makes_state_patches_inert():
    m = FBTModel(build_cfg(fusion="none"), seed=0).eval()
    x = tokens()
    clean = m(x, passes=2)
    fired = []

    def patch(t, hook):
        fired.append(1)
        return t + 1.0

    out = m.run_with_hooks(x, passes=2, fwd_hooks=[("fusion.hook_state", at(patch))])
    assert torch.equal(out.logits, clean.logits) and not fired


def test_the_old_pass_numbering_fails_in_one_line_naming_the_new(model):
    # at(passes=[1]) meant pass 2: it must not quietly start meaning pass 1
    with pytest.raises(
        TypeError, match=r"counted passes from 0 and is gone: use at\(fn, on_pass=\[2\]\)"
    ):
        at(lambda t, h: t, passes=[1])
    with pytest.raises(TypeError, match="on_pass"):
        at(lambda t, h: t, [1])  # the old second positional argument
    seen = []

    def old_keys(t, hook):
        for key in ("pass", "offset"):
            try:
                hook.ctx[key]
            except KeyError as e:
                seen.append(str(e))

    model.run_with_hooks(tokens(), passes=1, fwd_hooks=[("blocks.0.hook_resid_pre", old_keys)])
    assert seen == [
        "\"hook.ctx['pass'] is gone: read hook.ctx['pass_number'] (counted from 1: pass 1 is 1)\"",
        "\"hook.ctx['offset'] is gone: read hook.ctx['first_position']\"",
    ]

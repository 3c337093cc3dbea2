"""Does the feedback map contract? Jacobi passes 1..K and long SOFT decoding.

Pass k maps the top states of pass k-1 to new top states. On a T-token sequence this map is
strictly causal in position (pass k at position t reads pass k-1 only at positions < t), so
k Jacobi passes make positions < k exact and pass T reproduces the sequential recurrence
exactly: what matters is how fast the state change decays *before* that, i.e. for k < T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fbt_probe.batch import make_batch
from fbt_probe.decode import generate_tokens
from fbt_probe.feedback import FeedbackModel, check_context
from fbt_probe.hf import HFFeedbackModel, copy_hf
from fbt_probe.kernels.evaluate import heldout_examples
from fbt_probe.stack import FBTModel


@dataclass
class HeldoutBatch:
    tokens: torch.Tensor  # (batch, pos), right-padded
    targets: torch.Tensor  # (batch, pos), -100 where none
    answer: torch.Tensor  # (batch, pos) bool
    valid: torch.Tensor  # (batch, pos) bool


def heldout_batch(
    tasks: tuple[str, ...],
    n_groups: int = 16,
    distractors=(1, 4, 16, 64, 128, 256),
    encoding=None,
) -> HeldoutBatch:
    """Held-out examples of ``tasks``, encoded with ``encoding`` (a model's tokenizer) or
    the word vocabulary."""

    exs = [ex for t in tasks for ex in heldout_examples(t, n_groups, distractors)]
    b = make_batch(exs, encoding=encoding)
    valid = torch.arange(b.tokens.shape[1])[None, :] < b.lengths[:, None]
    return HeldoutBatch(b.tokens, b.targets, b.answer, valid)


def _feedback_step(
    model: FeedbackModel, states: torch.Tensor, emb: torch.Tensor, plain: torch.Tensor
):
    """One pass: previous top states (batch, pos, d_model) -> this pass's output."""
    return model.feedback_pass(emb, states, plain=plain, pass_number=None)


def float64_copy(model: FeedbackModel) -> FeedbackModel:

    if isinstance(model, HFFeedbackModel):
        return copy_hf(model, torch.float64)
    m = FBTModel(model.cfg)
    m.load_state_dict(model.state_dict())
    return m.double().eval()


def lipschitz_estimate(
    m: FeedbackModel, states, emb, plain, valid, iters: int = 8, seed: int = 0
) -> float:
    """Largest singular value of the pass-to-pass Jacobian at ``states``, by power iteration
    on JᵀJ: Jv by central differences, Jᵀu by autograd. ``m`` is a float64 copy of the model
    (``float64_copy``), made once per trajectory, not once per estimate."""
    s = states.double()
    e = emb.double()
    mask = valid[..., None].double()
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(s.shape, generator=g, dtype=torch.float64) * mask
    v /= v.norm()
    sigma = float("nan")
    eps = 1e-5
    for _ in range(iters):
        with torch.no_grad():
            jv = (
                _feedback_step(m, s + eps * v, e, plain).states
                - _feedback_step(m, s - eps * v, e, plain).states
            ) / (2 * eps)
            jv = jv * mask
        x = s.clone().requires_grad_(True)
        y = _feedback_step(m, x, e, plain).states * mask
        (jtjv,) = torch.autograd.grad(y, x, grad_outputs=jv, allow_unused=True)
        if jtjv is None:  # the pass does not read the states at all (no fusion): J = 0
            return 0.0
        jtjv = jtjv * mask
        n = jtjv.norm()
        if not torch.isfinite(n) or n == 0:
            return float(n)
        # ||JᵀJ v|| for a unit v converges to σ² as the Rayleigh quotient v·JᵀJv does, but
        # cannot go negative: with Jv from differences and Jᵀ from autograd, v·JᵀJv can,
        # where the differences are noisier than the Jacobian is large
        sigma = math.sqrt(float(n))
        v = jtjv / n
    return sigma


LOGITS_BYTES = 1 << 28  # the logits of one chunk of sequences: a vocabulary of 49k and
# a few hundred tokens would otherwise hold every sequence's (GBs for SmolLM2's 96)


def _scored_pass(model: FeedbackModel, emb, prev, plain, k: int, batch: HeldoutBatch):
    """Pass k over every sequence, a chunk of sequences at a time: the top states (kept
    whole), the next-token loss (mean over targets) and each sequence's answer right."""
    B, T = batch.tokens.shape
    rows = max(1, LOGITS_BYTES // (T * model.cfg.d_vocab * 4))
    states, oks = [], []
    ce_sum, n_targets = 0.0, 0
    for i in range(0, B, rows):
        sl = slice(i, i + rows)
        out = model.feedback_pass(
            emb[sl], None if prev is None else prev[sl], plain=plain[sl], pass_number=k
        )
        targets = batch.targets[sl]
        ce = F.cross_entropy(
            out.logits.flatten(0, 1), targets.flatten().clamp(min=0), reduction="none"
        ).view_as(targets)
        tgt_ok = targets != -100
        ce_sum += float((ce * tgt_ok).sum())
        n_targets += int(tgt_ok.sum())
        oks.append(((out.logits.argmax(-1) == targets) | ~batch.answer[sl]).all(dim=1))
        states.append(out.states)
    return torch.cat(states), ce_sum / n_targets, torch.cat(oks)


@torch.no_grad()
def jacobi_trajectory(
    model: FeedbackModel,
    batch: HeldoutBatch,
    passes: int = 30,
    lipschitz_at: tuple[int, ...] = (2, 3, 5, 10, 30),
    lipschitz_examples: int = 4,
    progress=None,
) -> list[dict]:
    """Per pass k: relative state change ||h^k - h^(k-1)|| / ||h^(k-1)|| (mean and max over
    real positions), next-token loss, teacher-forced answer accuracy, and — at the passes in
    ``lipschitz_at`` — a local Lipschitz estimate of the map from pass k-1 to pass k."""
    if passes < 1:
        raise ValueError("passes must be >= 1")
    model.eval()
    B, T = batch.tokens.shape
    model.set_context(1, None, 0)
    emb = model.embed(batch.tokens)
    plain = model.plain_mask(B, T, None, batch.tokens.device)
    valid = batch.valid
    rows = []
    prev = None
    m64 = float64_copy(model) if any(2 <= k <= passes for k in lipschitz_at) else None
    for k in range(1, passes + 1):
        if rows and rows[-1]["delta_max"] == 0.0:
            # h(k-1) == h(k-2) bit for bit, so every later pass repeats it exactly (the
            # Jacobi iteration reached the sequential recurrence): no need to compute it.
            rows.append({**rows[-1], "pass": k, "lipschitz": float("nan")})
            if progress is not None:
                progress(k, passes, f"pass {k} (fixed point)")
            continue
        h, loss, ok = _scored_pass(model, emb, prev, plain, k, batch)
        h = h * valid[..., None]
        row = {
            "pass": k,
            "delta_mean": float("nan"),
            "delta_max": float("nan"),
            "loss": loss,
            "accuracy": float(ok.float().mean()),
            "h_norm_mean": float(h.norm(dim=-1)[valid].mean()),
            "lipschitz": float("nan"),
        }
        if prev is not None:
            num = (h - prev).norm(dim=-1)[valid]
            den = prev.norm(dim=-1)[valid].clamp(min=1e-12)
            rel = num / den
            row["delta_mean"] = float(rel.mean())
            row["delta_max"] = float(rel.max())
            if k in lipschitz_at:
                n = min(lipschitz_examples, B)
                with torch.enable_grad():
                    row["lipschitz"] = lipschitz_estimate(
                        m64, prev[:n], emb[:n], plain[:n], valid[:n]
                    )
        rows.append(row)
        prev = h
        if progress is not None:
            progress(k, passes, f"pass {k}")
    return rows


def verdict(rows: list[dict]) -> str:
    """'converging', 'diverging' or 'inconclusive' from the state-change curve.

    converging: the last state change is at most a tenth of pass 2's. diverging: it does not
    fall (at least half of pass 2's, or any non-finite value) while the local Lipschitz
    estimates along the trajectory exceed 1 (or, without estimates, it does not fall at all).
    Fewer than four passes (three state changes) are always inconclusive.
    """
    d = [r["delta_mean"] for r in rows[1:]]
    if not all(math.isfinite(x) for x in d):
        return "diverging"
    if len(d) < 3:  # under four passes there is no curve to judge
        return "inconclusive"
    first, last = d[0], d[-1]
    if last <= max(1e-7, 0.1 * first):
        return "converging"
    lips = [r["lipschitz"] for r in rows if r.get("lipschitz") == r.get("lipschitz")]
    if lips and last >= 0.5 * first and float(np.median(lips)) > 1.0:
        return "diverging"
    if last >= first:
        return "diverging"
    return "inconclusive"


@torch.no_grad()
def long_soft_decoding(
    model: FeedbackModel,
    prompt: torch.Tensor,
    n_tokens: int = 1000,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[dict]:
    """Generate ``n_tokens`` in SOFT mode (sampled); per step the norm of h and its change."""
    check_context(prompt.shape[1] + n_tokens - 1, model.cfg.n_ctx)
    toks, states = generate_tokens(
        model,
        prompt,
        mode="soft",
        max_new_tokens=n_tokens,
        temperature=temperature,
        seed=seed,
        return_states=True,
    )
    norms = states.norm(dim=-1)  # (batch, steps)
    change = torch.cat(
        [
            torch.full_like(norms[:, :1], float("nan")),
            (states[:, 1:] - states[:, :-1]).norm(dim=-1),
        ],
        dim=1,
    )
    rows = []
    for i in range(n_tokens):
        rows.append(
            {
                "step": i + 1,
                "h_norm_mean": float(norms[:, i].mean()),
                "h_norm_max": float(norms[:, i].max()),
                "h_change_mean": float(np.nanmean(change[:, i].numpy())) if i else float("nan"),
                "finite": bool(torch.isfinite(states[:, i]).all()),
            }
        )
    return rows

"""Attribution patching through the feedback loop: every site's patching effect estimated from
one clean run with its backward pass and one counterfactual run (AtP, Kramár et al. 2024,
with AtP*'s fix for queries and keys), and edge attribution between components (EAP, Syed et
al. 2023).

The metric is the answer's logit difference, summed over a batch: ``logit[clean label] -
logit[counterfactual label]`` at each example's answer position. A site's estimate is
``(a_twin - a_clean) . dM/da`` at the patched positions: the first-order change of the metric
when the twin's activation replaces the clean one. Gradients flow through every pass of a
Jacobi prefill (pass k's top states enter pass k+1's fusion) and through every step of the
exact recurrence, so a site in pass 1 is scored by what it does to the answer of the last pass,
as ``fbt-probe patch --pass 1`` measures it exactly.

Sites (``Site``): the residual at each depth (``resid``), each head's output (``head``,
``hook_z``), the fed-back state entering the fusion (``state``) and the fed-back state's path
into block 0's queries, keys and values (``path``). For ``path`` queries and keys the estimate
reads the attention pattern after the patch exactly and takes the gradient there (AtP*'s QK
fix: a saturated softmax makes the query's or key's own gradient near zero); ``linear`` keeps
the plain first-order estimate beside it.

Edges (``fbt_probe.kernels.edges``): the same change of each upstream node (the input of block 0, each
head, each MLP, the state pass k feeds back into pass k+1) dotted with the gradient at each
downstream node's own input (each layer's attention and MLP, the readout).

Nothing here knows tasks: callers give token batches, answer positions and label ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fbt_probe.feedback import FeedbackModel
from fbt_probe.kernels.edges import Edge, dot_over, edge_layout, edge_scores, per_position
from fbt_probe.kernels.patching import STATE_HOOK
from fbt_probe.positions import pos_dim
from fbt_probe.prefill import Prefill
from fbt_probe.stack import FBTModel, GrowingKVCache

STATE = STATE_HOOK
PATTERN = "blocks.0.attn.hook_pattern"  # the QK fix reads block 0's, the only one a path patches
KINDS = ("resid", "head", "state", "path")


@dataclass(frozen=True)
class Site:
    """A patchable activation: its kind, the pass (counted from 1; None in the exact
    recurrence), the hook and the positions (a column name) or the head (``head h``)."""

    kind: str
    pass_number: int | None
    name: str
    where: str


@dataclass
class BatchAttribution:
    """One batch: per example, the clean and twin logit differences and each site's (edge's)
    estimated change of the clean one."""

    ld_clean: torch.Tensor  # (batch,)
    ld_twin: torch.Tensor
    estimate: dict[Site, torch.Tensor]  # AtP* (the QK fix where it applies)
    linear: dict[Site, torch.Tensor]  # plain AtP
    edges: dict[Edge, torch.Tensor]
    twin: dict  # the twin run's activations by (hook, pass): the exact check reuses them
    swapped: dict  # block 0's q, k, v by (hook, pass) with the twin's fed-back state


class _Stop(Exception):
    """Raised by a hook to end a forward once what it needs has run."""


def _capture(store: dict, detach: bool) -> Callable:
    """Keep each activation the hook sees. For gradients the hook passes on a view of its own:
    the gradient at it is then what flows through this hook's downstream alone (pass 1's
    block-0 input is the embeddings, which pass 2 reads again, and a patch there replaces only
    pass 1's)."""

    def hook(x, hook):
        if CLOSED in store:  # a block recomputed for the backward pass: already kept
            return None if detach or hook.name == PATTERN else x.view_as(x)
        key = (hook.name, hook.ctx.get("pass_number"))
        # a pattern is read once, and a Hugging Face model's is read-only: kept as it is
        own = not detach and hook.name != PATTERN
        y = x.detach() if detach else x.view_as(x) if own else x
        at = (int(hook.ctx.get("first_position", 0)), pos_dim(hook))
        store.setdefault(key, []).append((at, y))
        return y if own else None

    return hook


def _joined(pieces: list) -> torch.Tensor:
    """One activation from the pieces a hook saw (one per recurrence step), in position order
    from position 0 (zeros before the first step it fired at: the recurrence's plain
    position 0 has no fed-back state). Each piece is ((first position, position axis), x)."""
    pieces = sorted(pieces, key=lambda p: p[0][0])
    (first, dim), x0 = pieces[0]
    if len(pieces) == 1 and first == 0:
        return x0
    lead = [x0.new_zeros(*x0.shape[:dim], first, *x0.shape[dim + 1 :])] if first else []
    return torch.cat(lead + [x for _, x in pieces], dim=dim)


def _run(
    model: FeedbackModel,
    tokens: torch.Tensor,
    prefill: Prefill,
    names: list[str],
    grad: bool,
    embed: Callable | None = None,
    backward: Callable | None = None,
):
    """The prefill on ``tokens`` with the activations ``names`` kept per pass: (output, pieces),
    or what ``backward(output, pieces)`` returns. With ``grad`` the embeddings become the
    graph's leaf, so every kept activation has a gradient and no weight does; ``embed`` maps
    the embeddings to the ones run (a point on the way to the twin's, for integrated
    gradients). ``backward`` runs inside the same hooks: a block recomputed for it sees what
    the forward saw."""
    store: dict = {}
    hooks = [(n, _capture(store, not grad)) for n in names]
    if grad:
        move = embed or (lambda x: x)
        hooks.insert(0, ("hook_embed", lambda x, hook: move(x.detach()).requires_grad_(True)))
    cache = None
    if grad and prefill.passes is None and isinstance(model, FBTModel):
        cache = GrowingKVCache(model.cfg)  # the preallocated one is written in place
    recompute = grad and prefill.passes is not None and model.cfg.n_layers > RECOMPUTE_ABOVE
    with torch.set_grad_enabled(grad), model.hooks(fwd_hooks=hooks), _recomputed(model, recompute):
        out = prefill.run(model, tokens, cache).out
        if backward is not None:
            kept = dict(store)
            store[CLOSED] = True  # a block recomputed for the backward pass keeps nothing more
            return backward(out, kept)
    return out, store


# blocks recomputed in the backward pass on a stack deeper than this: there the graph's
# matrix products dominate memory (SmolLM2-135M: 2.9x a cached clean run, 6.4x without, for
# 1.35x the time); on a shallow one what the hooks keep does, and recomputing only costs time
RECOMPUTE_ABOVE = 8
CLOSED = ("closed", None)  # a key of the store: once there, the hooks keep nothing more


@contextmanager
def _recomputed(model: FeedbackModel, on: bool):
    """Each block's internals recomputed in the backward pass instead of kept (activation
    checkpointing): the graph then holds what the hooks keep and each block's input, not every
    matrix product's, at the price of one more forward. Jacobi passes only: the recurrence
    writes its cache as it goes, and a recomputed step would write it twice. A Hugging Face
    model's attention kernel, chosen per call, is the forward's again when recomputed."""
    layers = list(getattr(model, "_layers", None) or model.blocks) if on else []
    config = getattr(getattr(model, "hf", None), "config", None)
    for layer in layers:

        def wrapped(*args, _run=layer.forward, **kwargs):
            kernel = getattr(config, "_attn_implementation", None)
            contexts = lambda: (nullcontext(), _attention(config, kernel))  # noqa: E731
            return checkpoint(_run, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        layer.forward = wrapped  # the instance's own: module hooks still fire once, outside
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextmanager
def _attention(config, kernel):
    if config is None:
        yield
        return
    was = config._attn_implementation
    config._attn_implementation = kernel
    try:
        yield
    finally:
        config._attn_implementation = was


def logit_diff(out, answer: torch.Tensor, clean_id: torch.Tensor, twin_id: torch.Tensor):
    """(batch,) logit[clean_id] - logit[twin_id] at each example's ``answer`` position."""
    rows = torch.arange(len(answer), device=answer.device)
    lg = out.logits_at(rows, answer)
    return lg[rows, clean_id] - lg[rows, twin_id]


def site_names(model: FeedbackModel, kinds: Iterable[str], edges: bool = False) -> list[str]:
    """The hooks a sweep over ``kinds`` (and the edges) reads."""
    L = model.cfg.n_layers
    names = list(model.depth_hooks())
    if "head" in kinds or edges:
        names += [f"blocks.{i}.attn.hook_z" for i in range(L)]
    if "state" in kinds or "path" in kinds or edges:
        names.append(STATE)
    if "path" in kinds:
        names += [f"blocks.0.attn.hook_{w}" for w in "qkv"] + [PATTERN]
    if edges:
        layout = edge_layout(model)
        if layout == "branches":
            names += [f"blocks.{i}.hook_{b}_in" for i in range(L) for b in ("attn", "mlp")]
        else:
            names += [f"blocks.{i}.hook_resid_mid" for i in range(L)]
    return list(dict.fromkeys(names))


def gradients(
    model: FeedbackModel,
    tokens: torch.Tensor,
    answer: torch.Tensor,
    clean_id: torch.Tensor,
    twin_id: torch.Tensor,
    prefill: Prefill,
    names: list[str],
    ig_steps: int = 0,
    twin_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict, dict]:
    """One clean run of ``prefill`` and its backward pass: the logit difference (batch,), and
    the activations of the hooks ``names`` with the gradient of the summed logit difference,
    each {(hook, pass): (batch, pos, ...)} (pass counted from 1; None in the recurrence, whose
    steps are joined along positions). No weight takes a gradient.

    ``ig_steps`` > 0: the gradients are integrated instead (EAP-IG, Hanna et al. 2024): their
    mean over ``ig_steps`` runs whose input embeddings lie evenly on the way from the clean
    ones to ``twin_tokens``' (midpoints), which a saturated site's plain gradient misses."""
    if ig_steps <= 0:
        return _gradients(model, tokens, answer, clean_id, twin_id, prefill, names)
    with torch.no_grad():
        e_clean, e_twin = model.embed(tokens), model.embed(twin_tokens)
    total = None
    for k in range(ig_steps):
        a = (k + 0.5) / ig_steps
        _, _, g = _gradients(
            model,
            tokens,
            answer,
            clean_id,
            twin_id,
            prefill,
            names,
            embed=lambda x, a=a: e_clean + a * (e_twin - e_clean),
        )
        total = g if total is None else {n: total[n] + g[n] for n in total}
    with torch.no_grad():  # the clean activations and answer, from the clean run itself
        out, store = _run(model, tokens, prefill, names, grad=False)
    clean = {k: _joined(v) for k, v in store.items()}
    ld = logit_diff(out, answer, clean_id, twin_id)
    return ld, clean, {n: g / ig_steps for n, g in total.items()}


def _gradients(model, tokens, answer, clean_id, twin_id, prefill, names, embed=None):
    def backward(out, store):
        ld = logit_diff(out, answer, clean_id, twin_id)
        flat = [x for k in store for _, x in store[k]]
        grads = iter(torch.autograd.grad(ld.sum(), flat, allow_unused=True))
        clean, grad = {}, {}
        for k, pieces in store.items():
            gs = [next(grads) for _ in pieces]
            clean[k] = _joined([(o, x.detach()) for o, x in pieces])
            grad[k] = _joined(
                [
                    (o, torch.zeros_like(x) if g is None else g)
                    for (o, x), g in zip(pieces, gs, strict=True)
                ]
            )
        return ld.detach(), clean, grad

    was = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        return _run(model, tokens, prefill, names, grad=True, embed=embed, backward=backward)
    finally:
        for p, w in zip(model.parameters(), was, strict=True):
            p.requires_grad_(w)


def attribute(
    model: FeedbackModel,
    tokens: torch.Tensor,
    twin_tokens: torch.Tensor,
    answer: torch.Tensor,
    clean_id: torch.Tensor,
    twin_id: torch.Tensor,
    prefill: Prefill,
    columns: dict[str, torch.Tensor],
    after: torch.Tensor,
    kinds: Iterable[str] = KINDS,
    edges: bool = False,
    qk_fix: bool = True,
    ig_steps: int = 0,
) -> BatchAttribution:
    """Estimate every site of ``kinds`` in every pass of ``prefill`` for one batch of aligned
    twins (``twin_tokens`` line up with ``tokens`` position by position).

    ``columns``: {name: (batch, pos) bool}, the positions a residual or state site patches
    together; ``after``: (batch, pos) bool, the positions a head or path site patches. With
    ``edges``, also every edge between components; ``ig_steps`` > 0 integrates the gradients
    over that many points between the clean and the twin's input (``gradients``)."""
    kinds = tuple(kinds)
    names = site_names(model, kinds, edges)
    if edges and edge_layout(model) is None:
        raise ValueError(
            f"{getattr(model, 'loaded_as', 'this model')}: edges need a sequential "
            "pre-norm layout (each branch's input, heads that write through an "
            "output projection without a bias) and feedback into block 0"
        )
    if prefill.passes is None or not qk_fix:  # the QK fix needs a whole pass's pattern
        names = [n for n in names if n != PATTERN]
    ld, clean, grad = gradients(
        model, tokens, answer, clean_id, twin_id, prefill, names, ig_steps, twin_tokens
    )
    with torch.inference_mode():
        twin_out, tstore = _run(model, twin_tokens, prefill, names, grad=False)
        ld_twin = logit_diff(twin_out, answer, clean_id, twin_id)
    twin = {k: _joined(v) for k, v in tstore.items()}
    result = BatchAttribution(ld, ld_twin, {}, {}, {}, twin, {})
    with torch.no_grad():
        _node_estimates(model, kinds, clean, grad, twin, columns, after, result)
        if "path" in kinds:
            _path_estimates(model, tokens, prefill, clean, grad, twin, after, result, qk_fix)
        if edges:
            upto = columns.get("all", torch.ones_like(after))
            edge_scores(model, clean, grad, twin, upto, result.edges)
    return result


def _node_estimates(model, kinds, clean, grad, twin, columns, after, result) -> None:
    depth = set(model.depth_hooks())
    for (name, p), a in clean.items():
        if (name, p) not in twin:
            continue
        resid = name in depth and "resid" in kinds
        state = name == STATE and "state" in kinds
        head = name.endswith("attn.hook_z") and "head" in kinds
        if not (resid or state or head):
            continue
        prod = per_position(twin[(name, p)] - a, grad[(name, p)], keep=3 if head else 2)
        if head:  # (batch, pos, head): each head over the positions after the label
            per_head = (prod * after[:, : prod.shape[1], None]).sum(1)
            for h in range(prod.shape[2]):
                s = Site("head", p, name, f"head {h}")
                result.estimate[s] = result.linear[s] = per_head[:, h]
            continue
        for col, m in columns.items():
            s = Site("resid" if resid else "state", p, name, col)
            result.estimate[s] = result.linear[s] = (prod * m[:, : prod.shape[1]]).sum(1)


def _path_estimates(model, tokens, prefill, clean, grad, twin, after, result, qk_fix) -> None:
    """Block 0's q, k and v as they are when the twin's fed-back state enters the fusion (each
    position's q, k and v read only its own input, so one partial pass gives every position);
    with ``qk_fix``, the pattern after patching the queries (keys) of every head at once, each
    head's pattern depending on its own queries and keys only."""
    qkv = [f"blocks.0.attn.hook_{w}" for w in "qkv"]
    pat = PATTERN
    emb = model.embed(tokens)
    plain = model.plain_mask(*tokens.shape, None, tokens.device)
    everywhere = torch.ones_like(after)
    for p in sorted({p for (n, p) in twin if n == STATE}, key=lambda p: p or 0):
        state = _put(twin[(STATE, p)], everywhere)
        swapped = _block0(model, emb, plain, p, [(STATE, state)], qkv)
        result.swapped.update({(n, p): x for n, x in swapped.items()})
        for name in qkv:
            delta, g = swapped[name] - clean[(name, p)], grad[(name, p)]
            fix = qk_fix and prefill.passes is not None and not name.endswith("hook_v")
            if fix:  # the clean state, only this name's q (k) swapped, at the patched positions
                hooks = [
                    (STATE, _put(clean[(STATE, p)], everywhere)),
                    (name, _put(swapped[name], after)),
                ]
                new = _block0(model, emb, plain, p, hooks, [pat])[pat]
                dA = (new - clean[(pat, p)]) * grad[(pat, p)]  # (batch, head, query, key)
                rows = after if name.endswith("hook_q") else everywhere
                per_head = (dA.sum(-1) * rows[:, None, : dA.shape[2]]).sum(-1)  # (batch, head)
                group = per_head.shape[1] // delta.shape[2]  # query heads per key-value head
            for h in range(delta.shape[2]):
                s = Site("path", p, name, f"head {h}")
                result.linear[s] = dot_over(delta[:, :, h], g[:, :, h], after)
                result.estimate[s] = (
                    per_head[:, h * group : (h + 1) * group].sum(1) if fix else result.linear[s]
                )


def _put(values: torch.Tensor, mask: torch.Tensor) -> Callable:
    """A hook replacing its activation by ``values`` where ``mask`` (batch, pos) is true."""

    def hook(x, hook):
        m = mask[:, : x.shape[1]].reshape(*mask.shape[:1], -1, *[1] * (x.ndim - 2))
        return torch.where(m, values[:, : x.shape[1]].to(x.dtype), x)

    return hook


def _block0(model, emb, plain, pass_number, hooks, read: list[str]) -> dict[str, torch.Tensor]:
    """Block 0 of one pass over every position, the fed-back state set by ``hooks`` (the
    states passed in are placeholders): the activations ``read``, the rest never run."""
    got: dict[str, torch.Tensor] = {}

    def keep(x, hook):
        got[hook.name] = x

    def stop(x, hook):
        raise _Stop

    hooks = [*hooks, *[(n, keep) for n in read], ("blocks.0.hook_resid_post", stop)]
    try:
        with model.hooks(fwd_hooks=hooks):
            model.feedback_pass(emb, torch.zeros_like(emb), plain=plain, pass_number=pass_number)
    except _Stop:
        pass
    return got

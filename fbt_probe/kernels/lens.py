"""Reading the residual stream through the output head, pass by pass.

The *logit lens* reads a residual x at depth d of pass k as ``model.read_resid(x)``: the final
norm and the head, as if the blocks above d did nothing. At depth L of a pass it is that pass's
own output. A *tuned lens* first maps x through an affine translator of its depth,
``x @ A_d + b_d``, fitted so that it predicts the last block's output of the same pass: the
blocks above d, replaced by the best affine map. Here the translators are fitted in closed form
by ridge least squares on the residuals of held-out prompts (the linear "jump" of Din et al.
2023), not by gradient descent on the KL (Belrose et al. 2023): one solve per depth, the same
answer every time, and cheap on a 30-layer model with a 49k vocabulary.

The fed-back state is read two ways at every pass k >= 2: ``fed_state``, the head on the state
h_{t-1} itself (what the position before said next, in the pass before), and ``fed_value``, the
logit lens on the fusion's value ``W_U h_{t-1}`` (where the term that enters block 0 points in
the vocabulary).

Each read is scored against the *final* distribution, the last pass's output at the same
position: its KL to it, and the answer's probability and rank (0 = the top token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from fbt_probe.feedback import FeedbackModel
from fbt_probe.util.files import atomic_write, read_json, read_tensors

RIDGE = 1e-3  # relative to the mean diagonal of X^T X: keeps a near-singular depth solvable
TRANSLATORS, INDEX = "translators.safetensors", "tuned_lens.json"
FORMAT = "fbt-probe-tuned-lens"


@dataclass
class Translators:
    """One affine map per depth: ``A`` (n_depths, d, d), ``b`` (n_depths, d); the last depth's
    is the identity (its logit lens is already the output)."""

    A: torch.Tensor
    b: torch.Tensor
    meta: dict

    def apply(self, depth: int, x: torch.Tensor) -> torch.Tensor:
        return x @ self.A[depth].to(x) + self.b[depth].to(x)

    def save(self, folder: str | Path) -> Path:

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"A": self.A.contiguous(), "b": self.b.contiguous()}
        atomic_write(folder / TRANSLATORS, lambda tmp: save_file(tensors, str(tmp)))
        doc = {"format": FORMAT, "version": 1, **self.meta}
        atomic_write(
            folder / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n")
        )
        return folder

    @classmethod
    def load(cls, folder: str | Path, model: FeedbackModel, mhash: str) -> Translators:
        """A saved tuned lens, refused in one line unless it was fitted on this model."""

        folder = Path(folder)
        index, weights = folder / INDEX, folder / TRANSLATORS
        if not index.exists() and not weights.exists():
            raise FileNotFoundError(
                f"no tuned lens in {folder} (it needs {INDEX} and {TRANSLATORS})"
            )
        meta = read_json(index, "tuned lens's index")
        t = read_tensors(weights, "tuned lens's weights")
        if meta.get("format") != FORMAT or "A" not in t or "b" not in t:
            raise ValueError(f"{folder} is not a tuned lens written by fbt-probe lens")
        if meta.get("model_hash") != mhash:
            raise ValueError(
                f"the tuned lens in {folder} was fitted on model {meta.get('model_hash')}, not on "
                f"this one ({mhash}): fit one with fbt-probe lens --model <this model>"
            )
        n, d = len(model.depth_hooks()), model.cfg.d_model
        if tuple(t["A"].shape) != (n, d, d) or tuple(t["b"].shape) != (n, d):
            raise ValueError(f"the tuned lens in {folder} does not fit a model of {n} depths x {d}")
        if not (torch.isfinite(t["A"]).all() and torch.isfinite(t["b"]).all()):
            raise ValueError(f"{weights} holds NaN or infinite values: fit the tuned lens again")
        meta = {k: v for k, v in meta.items() if k not in ("format", "version")}
        return cls(t["A"].float(), t["b"].float(), meta)


class RidgeStats:
    """X^T X and X^T Y per depth, accumulated batch by batch in float64 (nothing kept per
    token): X the residual at that depth, Y the last block's output, both of the same pass and
    position, with a constant column for the bias."""

    def __init__(self, n_depths: int, d: int):
        self.xtx = torch.zeros(n_depths, d + 1, d + 1, dtype=torch.float64)
        self.xty = torch.zeros(n_depths, d + 1, d, dtype=torch.float64)
        self.n = 0

    def add(self, depth: int, x: torch.Tensor, y: torch.Tensor) -> None:
        xa = torch.cat([x, x.new_ones(len(x), 1)], 1).double().cpu()
        self.xtx[depth] += xa.T @ xa
        self.xty[depth] += xa.T @ y.double().cpu()
        if depth == 0:
            self.n += len(x)

    def solve(self, meta: dict) -> Translators:
        n, d1, d = self.xty.shape
        A, b = torch.zeros(n, d, d), torch.zeros(n, d)
        for k in range(n - 1):
            g = self.xtx[k]
            lam = RIDGE * float(g.diagonal()[:-1].mean())
            reg = torch.eye(d1, dtype=g.dtype) * lam
            reg[-1, -1] = 0.0  # the bias is not shrunk
            w = torch.linalg.solve(g + reg, self.xty[k])
            A[k], b[k] = w[:-1].float(), w[-1].float()
        A[-1] = torch.eye(d)
        return Translators(A, b, {**meta, "n_positions": self.n, "ridge": RIDGE})


@torch.no_grad()
def accumulate(
    model: FeedbackModel, stats: RidgeStats, tokens: torch.Tensor, keep: torch.Tensor, passes: int
) -> None:
    """Add one batch (tokens (batch, pos); keep (batch, pos) bool: the positions to fit on)
    of every pass 1..``passes`` to ``stats``: each depth's residual, once the last block's
    output of the same pass is there, is paired with it and dropped."""
    hooks = model.depth_hooks()
    depth_of, last = {h: i for i, h in enumerate(hooks)}, hooks[-1]
    held: dict[int, torch.Tensor] = {}

    def hook(x, hook):
        i = depth_of[hook.name]
        if hook.name != last:
            held[i] = x[keep]
            return None
        y = x[keep]
        for j, xj in held.items():
            stats.add(j, xj, y)
        held.clear()
        return None

    with model.hooks(fwd_hooks=[(lambda n: n in depth_of, hook)]):
        model(tokens, passes=passes, keep_all=False)


@dataclass
class LensReads:
    """Per example and pass: each read's KL to the final distribution, the answer's
    probability and its rank. ``reads`` names the columns: ``fed_state``, ``fed_value``,
    then depth 0..L; pass 1 has no fed-back state (NaN)."""

    reads: list[str]
    kl: np.ndarray  # (n, passes, n_reads)
    prob: np.ndarray
    rank: np.ndarray


# logits scored at once: a large vocabulary's reads go through the head in chunks of this
# many floats, so one matmul serves many reads (a batch's reads one by one are small matmuls)
CHUNK_LOGITS = 2**24


def _score(read, x: torch.Tensor, ref_logp: torch.Tensor, answer: torch.Tensor):
    """x (n_reads * batch, d): read i * batch + j belongs to example j. Each row goes through
    ``read`` (the head) and is scored against that example's final log-probabilities: KL to
    them, the answer's probability and its rank. Returns three (n_reads, batch) arrays.

    With z the logits, lse their log-sum-exp and p the final distribution,
    KL = sum p log p - sum p z + lse: the read's log-probabilities are never formed, so each
    chunk of vocabulary-wide rows is passed over three times (lse, sum p z, the rank) instead
    of about ten (a large vocabulary's lens is bound by those passes, not by the head)."""
    B, V = ref_logp.shape
    p = ref_logp.exp()  # (batch, vocab)
    neg_entropy = (p * ref_logp).sum(-1)
    step = max(1, CHUNK_LOGITS // (V * B)) * B  # whole reads: chunk rows line up with p's
    kl, prob, rank = [], [], []
    for r0 in range(0, len(x), step):
        z = read(x[r0 : r0 + step]).float().view(-1, B, V)
        lse = torch.logsumexp(z, -1)  # (reads, batch)
        kl.append(neg_entropy - torch.einsum("rbv,bv->rb", z, p) + lse)
        a = z.gather(2, answer[None, :, None].expand(len(z), B, 1))[..., 0]
        prob.append((a - lse).exp())
        # a bool tensor summed as bytes: summing it as bools converts every element to int64
        rank.append((z > a[..., None]).view(torch.uint8).sum(-1, dtype=torch.int32))
    return [torch.cat(v).cpu().numpy() for v in (kl, prob, rank)]


@torch.no_grad()
def lens_batch(
    model: FeedbackModel,
    tokens: torch.Tensor,
    at: torch.Tensor,
    answer: torch.Tensor,
    passes: int,
    tuned: Translators | None = None,
) -> dict[str, LensReads]:
    """The reads of one batch at positions ``at`` (batch,), scored for ``answer`` (batch,)
    token ids: {"logit": ..., "tuned": ...} (the tuned lens where ``tuned`` is given)."""
    hooks = model.depth_hooks()
    fed_hook = "fusion.hook_state"
    out, caches = model.run_with_pass_caches(
        tokens, passes=passes, names_filter=[*hooks, fed_hook], positions=at
    )
    rows = torch.arange(len(at), device=at.device)
    ref = out.passes[-1].logits_at(rows, at).float().log_softmax(-1)
    reads = ["fed_state", "fed_value", *(str(i) for i in range(len(hooks)))]
    lenses = {"logit": None, **({"tuned": tuned} if tuned is not None else {})}
    shape = (len(at), passes, len(reads))
    res = {k: [np.full(shape, np.nan) for _ in range(3)] for k in lenses}
    for k, cache in enumerate(caches):
        if fed_hook in cache:  # the fed-back state's reads are the same for both lenses
            h = cache[fed_hook]
            state = _score(model.read_state, h, ref, answer)
            value = _score(model.read_resid, h @ model.fusion.W_U.T, ref, answer)
            for arrs in res.values():
                for m, v, w in zip(arrs, state, value, strict=True):
                    m[:, k, 0], m[:, k, 1] = v[0], w[0]
        xs = torch.stack([cache[h] for h in hooks])  # (depths, batch, d_model)
        for name, tr in lenses.items():
            x = xs if tr is None else torch.baddbmm(tr.b.to(xs)[:, None], xs, tr.A.to(xs))
            got = _score(model.read_resid, x.reshape(-1, xs.shape[-1]), ref, answer)
            for m, v in zip(res[name], got, strict=True):
                m[:, k, 2:] = v.T
    return {name: LensReads(reads, *arrs) for name, arrs in res.items()}

"""Residuals at each example's colon, at every depth, under each prefill mode.

Depths: 0..L-1 are the inputs of blocks 0..L-1 (depth 0 = block 0's input, which under
recurrent prefill *is* the fused feedback), and depth L is the last block's output.
Prefills (``fbt_probe.prefill``): ``standard`` (pass 1), ``recurrent`` (pass 2), ``k<N>``
(pass N, N-step Jacobi) and ``full`` (the exact sequential recurrence). Results are cached on disk under
the model hash and the dataset hash, so a second fit reuses them.

A *site* says where features come from: ``resid`` (the depth ladder above, the default) or
any hook name (``fusion.hook_state``, ``blocks.2.attn.hook_z``, ...), read at the colon, at
an offset from it (``blocks.0.hook_resid_pre@colon-1``: the position before the colon) or at
a position the task declares (``resid@bit``: delayed_memory's stored bit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.feedback import FeedbackModel
from fbt_probe.positions import pos_dim
from fbt_probe.prefill import Prefill, parse_prefill
from fbt_probe.recurrence import run_recurrence_with_cache
from fbt_probe.util.lists import comma_numbers
from probes.common.cache import entry_inputs, entry_path, read_entry, rows_digest, write_entry
from tasks import get_task, vocab
from tasks.dataset import Dataset

DEFAULT_CACHE = Path(".cache") / "extract"


RESID = "resid"


class SiteNotFired(ValueError):
    """The site's hook does not fire under this prefill (a fusion hook in pass 1)."""


def parse_site(site: str) -> tuple[str, int | str]:
    """``HOOK[@colon-K | @NAME]`` -> (hook or "resid", offset from the colon (<= 0) or the
    name of a position the task declares, e.g. delayed_memory's ``bit``)."""
    hook, _, where = site.partition("@")
    if not hook:
        raise ValueError(f"invalid site {site!r}: use resid or a hook name, e.g. fusion.hook_state")
    if not where or where == "colon":
        return hook, 0
    if where.startswith("colon-") and where[6:].isdigit():
        return hook, -int(where[6:])
    if where.isidentifier() and not where.startswith("colon"):
        return hook, where
    raise ValueError(
        f"invalid position {where!r} in site {site!r}: use @colon, @colon-K (K positions "
        "before the colon; the prompt ends at the colon) or a position the task declares"
    )


def site_positions(ds: Dataset, site: str) -> np.ndarray:
    """(n_examples,) the position each example is read at."""
    where = parse_site(site)[1]
    if isinstance(where, int):
        pos = ds.colon_index + where
    else:
        declared = getattr(get_task(ds.task), "POSITIONS", {})
        if where not in declared:
            raise ValueError(
                f"task {ds.task} declares no position {where!r}"
                + (f"; it declares {', '.join(declared)}" if declared else "")
            )
        pos = np.array([declared[where](vocab.decode(ids).split()) for ids in ds.token_ids])
    if (pos < 0).any() or (pos > ds.colon_index).any():
        raise ValueError(f"site {site!r} lies outside some prompts")
    return pos.astype(np.int64)


def site_hooks(model: FeedbackModel, site: str) -> list[str]:
    """The hooks a site reads, in depth order."""
    hook, _ = parse_site(site)
    if hook == RESID:
        return depth_hooks(model)
    if hook not in model.hook_dict:
        raise ValueError(
            f"unknown site {hook!r}: use resid or a hook name such as blocks.0.hook_resid_pre, "
            "blocks.1.attn.hook_z, fusion.hook_state, ln_final.hook_normalized"
        )
    if pos_dim(model.hook_dict[hook]) != 1:
        raise ValueError("attention patterns have no fixed width: probe hook_z or hook_q instead")
    return [hook]


def depth_hooks(model: FeedbackModel) -> list[str]:
    return model.depth_hooks()


# A forward without gradient holds about 8 bytes per token for every unit of d_model x layers
# at its peak (measured on SmolLM2-135M: 16 x 263 tokens took ~500 MB in Hugging Face's own
# forward); a batch is kept under this many bytes of that, so that a wide, deep model's fit
# stays within about its own size beyond the model (the built-in model never reaches it)
BATCH_BYTES = 512 * 2**20


def max_batch_tokens(model: FeedbackModel) -> int:
    """The most tokens (examples x padded length) one extraction batch of ``model`` holds."""
    return max(1, BATCH_BYTES // (8 * model.cfg.d_model * model.cfg.n_layers))


def length_batches(lengths: np.ndarray, batch_size: int, max_tokens: int | None = None):
    """Indices grouped by similar length (sorted), so padding stays small: at most
    ``batch_size`` examples, and at most ``max_tokens`` tokens padded to the longest."""
    order = np.argsort(lengths, kind="stable")
    cur: list[int] = []
    for i in order:
        n = len(cur) + 1
        if cur and (n > batch_size or (max_tokens and n * int(lengths[i]) > max_tokens)):
            yield np.array(cur)
            cur = []
        cur.append(int(i))
    if cur:
        yield np.array(cur)


@torch.no_grad()
def extract_features(
    model: FeedbackModel,
    ds: Dataset,
    prefill: str | Prefill,
    batch_size: int = 128,
    progress=None,
    site: str = RESID,
) -> np.ndarray:
    """(n_examples, n_depths, width) float32 at each example's site position: for ``resid``
    the residual at the colon at every depth (L+1, d_model); for a hook, that one activation
    (flattened)."""
    prefill = parse_prefill(prefill)
    passes = prefill.passes
    model.eval()
    hooks = site_hooks(model, site)
    where = site_positions(ds, site)
    prompt_lens = ds.colon_index + 1
    out = None
    device = next(model.parameters()).device
    done = 0
    rank, size = _world()
    for b, idx in enumerate(length_batches(prompt_lens, batch_size, max_batch_tokens(model))):
        if b % size != rank:  # under torchrun each rank extracts every size-th batch
            continue
        T = int(prompt_lens[idx].max())
        toks = torch.full((len(idx), T), vocab.PAD_ID, dtype=torch.long)
        for j, i in enumerate(idx):
            toks[j, : prompt_lens[i]] = torch.from_numpy(ds.token_ids[i][: prompt_lens[i]])
        toks = toks.to(device)
        at = torch.as_tensor(where[idx], device=device)
        if passes is None:
            _, cache = run_recurrence_with_cache(model, toks, names_filter=hooks, positions=at)
        else:
            _, caches = model.run_with_pass_caches(
                toks, passes=passes, names_filter=hooks, positions=at, last_only=True
            )
            cache = caches.last
        missing = [h for h in hooks if h not in cache]
        if missing:
            raise SiteNotFired(
                f"{missing[0]} does not fire under {prefill} prefill (pass 1 has no feedback); "
                "use --prefill recurrent or full"
            )
        vals = torch.stack([cache[h].flatten(1) for h in hooks], dim=1).cpu().numpy()
        if out is None:
            out = np.zeros((len(ds), *vals.shape[1:]), dtype=np.float32)
        out[idx] = vals
        done += len(idx)
        if progress is not None:
            progress(done, len(ds), prefill.name)
    if size > 1:  # every row was extracted by one rank, with the batch one process uses
        out = _gather(out, device)
    return out


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(part: np.ndarray | None, device) -> np.ndarray:
    """The rows each rank extracted, summed into one array on every rank (the other rows of
    a rank's array are zero); a rank with no batch learns the shape from the others."""
    import torch.distributed as dist

    shape = torch.tensor(
        part.shape if part is not None else (0, 0, 0), dtype=torch.long, device=device
    )
    dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    full = torch.zeros(tuple(shape.tolist()), dtype=torch.float32, device=device)
    if part is not None:
        full += torch.from_numpy(part).to(device)
    dist.all_reduce(full)
    return full.cpu().numpy()


def extract_cached(
    model: FeedbackModel,
    ds: Dataset,
    prefill: str | Prefill,
    cache_dir: str | Path | None = DEFAULT_CACHE,
    mhash: str | None = None,
    progress=None,
    site: str = RESID,
) -> tuple[np.ndarray, bool]:
    """Features for (model, dataset, prefill, site), from disk when already extracted: a
    verified cache entry (``probes.common.cache``), keyed by the rows as read, not by the
    file's metadata.

    Returns ``(features, was_cached)``.
    """
    prefill = parse_prefill(prefill)
    site_hooks(model, site)
    if cache_dir is None:
        return extract_features(model, ds, prefill, progress=progress, site=site), False
    mhash = mhash or model_hash(model)
    rows = rows_digest(ds.token_ids, ds.colon_index, site_positions(ds, site))
    inputs = entry_inputs(mhash, rows, prefill.name, site, ds.task)
    path = entry_path(Path(cache_dir), inputs)
    feats = read_entry(path, inputs, len(ds))
    if feats is not None:
        return feats, True
    feats = extract_features(model, ds, prefill, progress=progress, site=site)
    if _world()[0] != 0:
        return feats, False  # under torchrun rank 0 writes the cache entry
    write_entry(path, feats, inputs)
    return feats, False


def pick_depths(spec: str | None, n_depths: int) -> tuple[int, ...]:
    """The depths of ``--depths``: 'all', comma-separated depths, or None (DEFAULT_DEPTHS of
    them, evenly spaced, the first and the last among them)."""
    if spec is None:
        k = min(DEFAULT_DEPTHS, n_depths)
        return tuple(sorted({round(x) for x in np.linspace(0, n_depths - 1, k)}))
    if spec.strip() == "all":
        return tuple(range(n_depths))
    usage = f"--depths {spec!r}: give 'all' or depths between 0 and {n_depths - 1}, comma-separated"
    picked = sorted(comma_numbers(spec, "--depths", lambda w: [int(w)], usage))
    if not picked or not all(0 <= d < n_depths for d in picked):
        raise ValueError(usage)
    return tuple(picked)


# The depth interventions (erasers, steering: 20 patched runs a depth) run at this many
# depths of the colon by default, evenly spaced from the embeddings to the top: all of the
# built-in model's 5; 5 of a 30-layer model's 31, whose every depth would take hours on a CPU.
DEFAULT_DEPTHS = 5

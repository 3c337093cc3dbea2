"""Residuals at each example's colon, at every depth, under each prefill mode.

Depths: 0..L-1 are the inputs of blocks 0..L-1 (depth 0 = block 0's input, which under
recurrent prefill *is* the fused feedback), and depth L is the last block's output.
Prefill modes: ``standard`` (pass 1), ``recurrent`` (pass 2), ``k<N>`` (pass N, N-step
Jacobi) and ``full`` (the exact sequential recurrence). Results are cached on disk under
the model hash and the dataset hash, so a second fit reuses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from fbt_probe.checkpoint import model_hash
from fbt_probe.model import FBTModel
from fbt_probe.recurrence import run_recurrence_with_cache
from tasks import vocab
from tasks.dataset import Dataset

PREFILLS = ("standard", "recurrent", "full")
DEFAULT_CACHE = Path(".cache") / "extract"


def parse_prefill(prefill: str) -> int | None:
    """Passes for a Jacobi prefill (standard=1, recurrent=2, kN=N); None for full."""
    if prefill == "standard":
        return 1
    if prefill == "recurrent":
        return 2
    if prefill == "full":
        return None
    if prefill.startswith("k") and prefill[1:].isdigit() and int(prefill[1:]) >= 1:
        return int(prefill[1:])
    raise ValueError(
        f"unknown prefill {prefill!r}: use standard, recurrent, full or k<N> (N passes)"
    )


def depth_hooks(model: FBTModel) -> list[str]:
    L = model.cfg.n_layers
    return [f"blocks.{i}.hook_resid_pre" for i in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]


def _batches(lengths: np.ndarray, batch_size: int):
    """Indices grouped by similar length (sorted), so padding stays small."""
    order = np.argsort(lengths, kind="stable")
    for s in range(0, len(order), batch_size):
        yield order[s : s + batch_size]


@torch.no_grad()
def extract_features(
    model: FBTModel, ds: Dataset, prefill: str, batch_size: int = 128, progress=None
) -> np.ndarray:
    """(n_examples, L+1, d_model) float32: the residual at each colon at every depth."""
    passes = parse_prefill(prefill)
    model.eval()
    hooks = depth_hooks(model)
    prompt_lens = ds.colon_index + 1
    out = np.zeros((len(ds), len(hooks), model.cfg.d_model), dtype=np.float32)
    device = next(model.parameters()).device
    done = 0
    for idx in _batches(prompt_lens, batch_size):
        T = int(prompt_lens[idx].max())
        toks = torch.full((len(idx), T), vocab.PAD_ID, dtype=torch.long)
        for j, i in enumerate(idx):
            toks[j, : prompt_lens[i]] = torch.from_numpy(ds.token_ids[i][: prompt_lens[i]])
        toks = toks.to(device)
        colon = torch.as_tensor(ds.colon_index[idx], device=device)
        if passes is None:
            _, cache = run_recurrence_with_cache(model, toks, names_filter=hooks, positions=colon)
        else:
            _, caches = model.run_with_pass_caches(
                toks, passes=passes, names_filter=hooks, positions=colon
            )
            cache = caches[-1]
        out[idx] = torch.stack([cache[h] for h in hooks], dim=1).cpu().numpy()
        done += len(idx)
        if progress is not None:
            progress(done, len(ds), prefill)
    return out


def cache_key(mhash: str, dhash: str, prefill: str) -> str:
    return hashlib.sha256(f"{mhash}|{dhash}|{prefill}|v1".encode()).hexdigest()[:20]


def extract_cached(
    model: FBTModel,
    ds: Dataset,
    prefill: str,
    cache_dir: str | Path | None = DEFAULT_CACHE,
    mhash: str | None = None,
    progress=None,
) -> tuple[np.ndarray, bool]:
    """Features for (model, dataset, prefill), from disk when already extracted.

    Returns ``(features, was_cached)``.
    """
    parse_prefill(prefill)
    if cache_dir is None:
        return extract_features(model, ds, prefill, progress=progress), False
    mhash = mhash or model_hash(model)
    path = Path(cache_dir) / f"{cache_key(mhash, ds.content_hash, prefill)}.npy"
    if path.is_file():
        try:
            return np.load(path), True
        except (OSError, ValueError, EOFError):
            path.unlink(missing_ok=True)  # a damaged cache entry is recomputed
    feats = extract_features(model, ds, prefill, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a name
            np.save(f, feats)
        os.replace(tmp, path)
        path.with_suffix(".json").write_text(
            json.dumps(
                {
                    "model_hash": mhash,
                    "dataset_hash": ds.content_hash,
                    "prefill": prefill,
                    "task": ds.task,
                }
            )
        )
    finally:
        Path(tmp).unlink(missing_ok=True)
    return feats, False

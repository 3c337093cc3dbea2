"""The feature cache's entries, verified: keyed by everything they were computed from and checked
on every read.

An entry is ``<key>.npy`` (the features, float32) and ``<key>.json`` (what they were computed
from and what they are). The key is a digest of the model's hash, the rows as they were read
(each prompt's token ids up to its colon and the position the site reads), the prefill and the
site: two datasets share an entry only if they hold the same prompts, whatever their files'
metadata say. On read the record must name the same inputs, and the array must have the
recorded shape, be float32 and finite, and hash to the recorded checksum. Anything else is
discarded with one line on stderr and computed again; a reader never gets another dataset's
features or a damaged array.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from fbt_probe.util.files import atomic_write

VERSION = 2  # entries of an older layout are never read (their keys differ)


def rows_digest(token_ids, colon_index, positions) -> str:
    """A digest of the rows as a model reads them: each prompt's ids up to its colon and the
    position the site reads in it."""
    h = hashlib.sha256()
    for ids, c, p in zip(token_ids, colon_index, positions, strict=True):
        prompt = np.asarray(ids[: int(c) + 1], dtype=np.int64)
        h.update(f"{len(prompt)}|{int(p)}|".encode())
        h.update(prompt.tobytes())
    return h.hexdigest()


def entry_inputs(mhash: str, rows: str, prefill: str, site: str, task: str) -> dict:
    return {
        "version": VERSION,
        "model_hash": mhash,
        "rows": rows,
        "prefill": prefill,
        "site": site,
        "task": task,
    }


def entry_path(cache_dir: Path, inputs: dict) -> Path:
    text = json.dumps({k: inputs[k] for k in sorted(inputs)})
    return Path(cache_dir) / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.npy"


def checksum(feats: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(feats).tobytes()).hexdigest()


def _problem(path: Path, inputs: dict, n_rows: int) -> tuple[np.ndarray | None, str]:
    """(the entry's features, "") or (None, what is wrong with it)."""
    record = path.with_suffix(".json")
    try:
        rec = json.loads(record.read_text())
    except FileNotFoundError:
        return None, f"{record.name} is missing"
    except (OSError, ValueError):
        return None, f"{record.name} is not a cache record"
    if not isinstance(rec, dict) or any(rec.get(k) != v for k, v in inputs.items()):
        return None, "it was computed from other inputs"
    try:
        feats = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        return None, f"it cannot be read ({str(e).splitlines()[0] if str(e) else 'truncated'})"
    if feats.dtype != np.float32:
        return None, f"it holds {feats.dtype}, not float32"
    shape = rec.get("shape")
    if list(feats.shape) != shape or feats.ndim != 3 or feats.shape[0] != n_rows:
        return None, f"its shape {tuple(feats.shape)} is not the recorded one for {n_rows} rows"
    if not np.isfinite(feats).all():
        return None, "it holds NaN or infinite values"
    if checksum(feats) != rec.get("sha256"):
        return None, "its checksum does not match"
    return feats, ""


def read_entry(path: Path, inputs: dict, n_rows: int) -> np.ndarray | None:
    """The verified features of an entry, or None (absent, or discarded with one line)."""
    if not path.is_file() and not path.with_suffix(".json").is_file():
        return None
    feats, why = _problem(path, inputs, n_rows)
    if feats is None:
        sys.stderr.write(f"cache entry {path} discarded ({why}); computing it again\n")
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)
    return feats


def write_entry(path: Path, feats: np.ndarray, inputs: dict) -> None:
    """The features and their record, each written whole (the record last: an entry without
    its record is never read)."""
    feats = np.ascontiguousarray(feats, dtype=np.float32)

    def save(tmp):
        with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a name
            np.save(f, feats)

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, save)
    rec = {**inputs, "shape": list(feats.shape), "dtype": "float32", "sha256": checksum(feats)}
    atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(rec)))

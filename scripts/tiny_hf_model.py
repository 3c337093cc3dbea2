"""Write a tiny random Hugging Face model folder (save_pretrained: model + tokenizer) to try
the commands on a machine without access to a model hub.

    python scripts/tiny_hf_model.py OUT [--family llama|gpt2|qwen2|gpt_neox] [--tokenizer bpe|words]

The model is random (2 layers, d_model 32): a stand-in for your own checkpoint, which you
would write the same way with ``save_pretrained`` (docs/hf.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fbt_probe.hf.tiny import FAMILIES, bpe_tokenizer, model_folder, word_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the folder to write (must not exist)")
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument(
        "--tokenizer",
        default="bpe",
        choices=("bpe", "words"),
        help="a byte-level BPE trained on task text, or one token per built-in word",
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.out.exists():
        sys.exit(f"error: {a.out} exists; choose another folder")
    tok = bpe_tokenizer() if a.tokenizer == "bpe" else word_tokenizer()
    model_folder(a.out, a.family, tok, a.seed)
    print(
        f"wrote {a.out}: a random {a.family} (2 layers, d_model 32) with a {a.tokenizer} tokenizer of {len(tok)} tokens"
    )


if __name__ == "__main__":
    main()

"""Tiny Hugging Face models and tokenizers made on this machine (nothing is downloaded), to
try the commands on and to test with: a word-level tokenizer over the built-in words, a
byte-level BPE trained on task text, and model folders written with save_pretrained
(``scripts/tiny_hf_model.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from tasks import vocab

VOCAB = 61  # a model without a tokenizer (the wrapper's own tests)
FAMILIES = ("llama", "gpt2", "qwen2", "gpt_neox")


def word_tokenizer():
    """One token per built-in word; ':' its own token, words split at spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["<unk>", *vocab.TOKENS])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def bpe_tokenizer(size: int = 300):
    """A byte-level BPE trained on rendered task text: labels split into several tokens."""
    import numpy as np
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tasks import get_task

    rng = np.random.default_rng(0)
    text = []
    for task in ("delayed_memory", "done_tracking", "multi_register"):
        mod = get_task(task)
        text += [mod.sample(rng, int(rng.integers(0, 8)), mod.Params()).text for _ in range(200)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=size, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token=None)


def tiny_hf(family: str, vocab_size: int = VOCAB, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 2048}  # fmt: skip
    if family == "llama":
        return T.LlamaForCausalLM(
            T.LlamaConfig(vocab_size=vocab_size, num_key_value_heads=2, **small)
        )
    if family == "qwen2":
        return T.Qwen2ForCausalLM(
            T.Qwen2Config(vocab_size=vocab_size, num_key_value_heads=2, **small)
        )
    if family == "gpt_neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=vocab_size, **small))
    if family == "gpt2":
        c = T.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=2048,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return T.GPT2LMHeadModel(c)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def model_folder(out: str | Path, family: str, tokenizer=None, seed: int = 0) -> Path:
    """A save_pretrained folder: a tiny random model of ``family`` and its tokenizer."""
    from fbt_probe.hf import quiet

    quiet()
    tok = tokenizer if tokenizer is not None else word_tokenizer()
    out = Path(out)
    tiny_hf(family, len(tok), seed).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out

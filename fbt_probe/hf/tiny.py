"""Tiny Hugging Face models and tokenizers made on this machine (nothing is downloaded), to
try the commands on and to test with: a word-level tokenizer over the built-in words, a
byte-level BPE trained on task text, and model folders written with save_pretrained
(``scripts/tiny_hf_model.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fbt_probe.hf.quiet import quiet
from tasks import get_task, vocab

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
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

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
    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
    }
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
        c = T.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=2048,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return T.GPT2LMHeadModel(c)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def model_folder(out: str | Path, family: str, tokenizer=None, seed: int = 0) -> Path:
    """A save_pretrained folder: a tiny random model of ``family`` and its tokenizer."""

    quiet()
    tok = tokenizer if tokenizer is not None else word_tokenizer()
    out = Path(out)
    tiny_hf(family, len(tok), seed).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def _permute_rope(w, n_head: int):
    """llama.cpp's row order for a query or key matrix (its converter permutes them; the
    reader undoes it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(out: str | Path, seed: int = 0):
    """A GGUF file of a tiny random Llama (fp32 tensors) with a byte-level BPE, as llama.cpp's
    converter writes one: what ``fbt-probe convert`` is tested on. Returns the Hugging Face
    model and tokenizer it holds."""

    import gguf

    tok = bpe_tokenizer()
    model = tiny_hf("llama", len(tok), seed)
    w = gguf.GGUFWriter(str(out), "llama")
    _gguf_config(w, model.config)
    _gguf_tokenizer(w, tok)
    _gguf_tensors(w, model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok


def _gguf_config(w, c) -> None:
    """The model's shape, as llama.cpp's metadata keys."""
    import gguf

    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _gguf_tokenizer(w, tok) -> None:
    """The byte-level BPE: its tokens in id order and its merges."""
    import gguf

    backend = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


# Hugging Face's block weights by their GGUF names
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_tensors(w, model) -> None:
    """The weights under their GGUF names, q and k permuted as llama.cpp's rotary expects."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, g_name in GGUF_NAMES.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                t = _permute_rope(t, c.num_attention_heads)
            elif g_name == "attn_k":
                t = _permute_rope(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", t)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])

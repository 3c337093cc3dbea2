"""Hugging Face wrapper benchmark: the wrapper's pass 1 against the bare Hugging Face forward on
the same input, and k passes against k x one pass, for each supported family.

Models are random, built from configs here (4 layers, d_model 256, vocabulary 2048), batch
8 x 256 tokens, no gradient; 15 rounds, each timing every variant once, and each ratio the
median over rounds of the ratio within a round, so that drift of a shared machine cancels. Goals: pass 1 <= 1.05 x the bare forward, k passes <= 1.05 x k single.
A k-pass forward reads the last pass's logits, as a caller of ``model(x, passes=k).logits``
does: the wrapper computes a pass's logits only when they are read (``LazyPassOutput``), so
the head is paid once, not k times.

Run: .venv/bin/python -m bench.hf   (prints a table, writes bench/hf.json)
     .venv/bin/python -m bench.hf models/smollm2   (the same on SmolLM2-135M, batch 4 x 128,
     and seconds per training step with the fusion learning alone, with the fusion and LoRA
     adapters (upcycle-smollm2-lora's) and with everything, each with its peak memory;
     writes bench/hf_smollm2.json)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import machine, table, write_json
from fbt_probe.hf import HFFeedbackModel, hf_config_of, init_fusion, quiet

B, T, REPEATS = 8, 256, 15


def build(family: str):
    import transformers as tr

    torch.manual_seed(0)
    size = {
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "max_position_embeddings": 1024,
    }
    if family == "llama":
        hf = tr.LlamaForCausalLM(tr.LlamaConfig(num_key_value_heads=4, **size))
    elif family == "qwen2":
        hf = tr.Qwen2ForCausalLM(tr.Qwen2Config(num_key_value_heads=4, **size))
    elif family == "gpt_neox":
        hf = tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(**size))
    else:
        hf = tr.GPT2LMHeadModel(
            tr.GPT2Config(vocab_size=2048, n_embd=256, n_layer=4, n_head=8, n_positions=1024)
        )
    hf.eval()
    model = HFFeedbackModel(hf, hf_config_of(hf)).eval()
    init_fusion(model)
    return hf, model


def measure(family: str, built=None, shape=(B, T), repeats: int = REPEATS) -> dict:
    hf, model = built or build(family)
    vocab = model.cfg.d_vocab
    x = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
    runs = {
        "bare": lambda: hf(input_ids=x, use_cache=False).logits,
        **{f"k{k}": (lambda k=k: model(x, passes=k).logits) for k in (1, 2, 3)},
    }
    rounds = []
    with torch.no_grad():
        for fn in runs.values():
            fn()
        for _ in range(repeats):
            t = {}
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                t[name] = time.perf_counter() - t0
            rounds.append(t)
        same = (model(x, passes=1).logits - hf(input_ids=x, use_cache=False).logits).abs().max()

    def med(f):  # the median over rounds of a ratio taken within each round
        return round(float(np.median([f(t) for t in rounds])), 3)

    return {
        "family": family,
        "bare_ms": round(1000 * min(t["bare"] for t in rounds), 1),
        "pass1_ms": round(1000 * min(t["k1"] for t in rounds), 1),
        "pass1_vs_bare": med(lambda t: t["k1"] / t["bare"]),
        "k2_vs_2x1": med(lambda t: t["k2"] / (2 * t["k1"])),
        "k3_vs_3x1": med(lambda t: t["k3"] / (3 * t["k1"])),
        "max_abs_diff_pass1": float(same),
    }


def train_rates(folder: str, steps: int = 4) -> list[dict]:
    """Seconds per step, tokens per second and the peak of resident memory of the
    upcycle-smollm2 recipe's steps (two passes at a batch of 8) on ``folder``, with the fusion
    learning alone, with the fusion and upcycle-smollm2-lora's adapters, and with all."""
    import resource

    from fbt_probe.batch import make_batch
    from fbt_probe.hf import load_hf
    from fbt_probe.train.objective import multipass_loss
    from fbt_probe.train.recipes import named_config
    from fbt_probe.train.start import lora_spec, make_optimizer, set_learning
    from fbt_probe.train.steps import draw_step

    rows = []
    lora = named_config("upcycle-smollm2-lora").optim
    for learn in ("fusion", "lora", "all"):
        cfg = named_config("upcycle-smollm2").with_overrides({"optim.learn": learn})
        if learn == "lora":  # the adapters the lora recipe trains
            cfg = cfg.with_overrides(
                {"optim.lora_rank": lora.lora_rank, "optim.lora_targets": list(lora.lora_targets)}
            )
        model = load_hf(folder, lora=lora_spec(cfg), keep_adapter=True).train()
        set_learning(model, learn)
        opt, stream = make_optimizer(model, cfg), cfg.stream()
        times, tokens = [], []
        for step in range(steps + 1):  # the first step warms up
            draw = draw_step(cfg, stream, 200 + step)
            batch = make_batch(draw.examples, encoding=model.encoding)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss, _ = multipass_loss(model, batch, draw.passes, cfg)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            tokens.append(batch.n_tokens * draw.passes)
        sec = float(np.median(times[1:]))
        rows.append(
            {
                "learn": learn,
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "s_per_step": round(sec, 2),
                "tokens_per_s": round(float(np.sum(tokens[1:]) / np.sum(times[1:]))),
                # the process's peak so far: each row runs after the ones before it
                "peak_rss_gib": round(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
                ),
            }
        )
        del model, opt
    return rows


def smollm2(folder: str) -> dict:
    """The wrapper's overhead and the training rates on a real model folder."""
    from fbt_probe.hf import load_hf

    model = load_hf(folder)
    row = measure("SmolLM2-135M", (model.hf, model), shape=(4, 128), repeats=7)
    return {"forward": row, "train": train_rates(folder)}


def main() -> None:
    import sys

    quiet()
    if len(sys.argv) > 1:  # python -m bench.hf models/smollm2: the real model's rows
        res = smollm2(sys.argv[1])
        print(f"SmolLM2-135M ({sys.argv[1]}): wrapper vs bare forward, batch 4 x 128")
        print(table([res["forward"]], list(res["forward"])))
        print(
            "\ntraining steps of upcycle-smollm2 (median of 4, after one warm-up; the peak is "
            "the process's so far)"
        )
        print(table(res["train"], list(res["train"][0])))
        print(f"wrote {write_json('hf_smollm2', {'machine': machine(), **res})}")
        return
    rows = [measure(f) for f in ("llama", "gpt2", "qwen2", "gpt_neox")]
    print(f"wrapper vs bare Hugging Face forward, random 4-layer d=256 models, batch {B} x {T}")
    print(table(rows, list(rows[0])))
    ok = all(r["pass1_vs_bare"] <= 1.05 and r["k3_vs_3x1"] <= 1.05 for r in rows)
    print(
        f"\ngoals (pass 1 <= 1.05 x bare, k passes <= 1.05 x k single): {'met' if ok else 'missed'}"
    )
    path = write_json("hf", {"machine": machine(), "batch": [B, T], "rows": rows, "goals_met": ok})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

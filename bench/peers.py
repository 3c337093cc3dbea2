"""fbt-probe against the tools a researcher would otherwise use, on the same weights in one run.

The extraction job: 1,024 delayed_memory prompts through the model's tokenizer (256 groups x
distractor counts 1, 2, 4, 8), sorted by length, in batches of 32, right-padded (the same
batches for every tool); the residual stream at the colon at every depth: the embeddings and
every decoder layer's output (L + 1 vectors a prompt). Tools:

- ``fbt-probe``: ``run_with_pass_caches(passes=1, positions=colon)`` on the wrapped model;
- ``fbt-probe k2``: the same over two Jacobi passes, both kept (no peer can; not compared);
- ``transformer_lens``: TransformerLens 4.3's ``TransformerBridge`` on the loaded model
  (``build_bridge_from_module``), ``run_with_cache`` with a ``names_filter``;
- ``nnsight``: nnsight 0.8's ``LanguageModel`` around the loaded model, one ``trace`` a batch
  that saves each layer's output at the colon;
- ``transformers``: the model itself with ``output_hidden_states=True``.

The patching job: on done_tracking's twins (they line up through every tokenizer here), put
the twin's residual after the middle layer at the answer position into the clean run, and
read the logit difference between the clean and the twin answer there: fbt-probe's hooks,
nnsight's assignment, TransformerLens's hooks and a plain PyTorch hook.

Each (model, tool, job) runs in a process of its own: the model is loaded and every weight read
once (safetensors maps the file, so a weight's first reading would otherwise count as the
job's memory), the job is run once while the resident memory is sampled (its peak above the
loaded model's is the memory "beyond the model"), then three times for the median time. Every tool's features and logit
differences are checked against the plain transformers run. Models: a random GPT-2-small
shape and a random Llama shape built here, and SmolLM2-135M where ``models/smollm2`` has been
converted (``fbt-probe convert --gguf smollm2 --out models/smollm2``).

Run: .venv/bin/python -m bench.peers [--n 1024] [--models gpt2,llama,smollm2]
(prints a table, writes bench/peers.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.common import machine, table, write_json

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("fbt-probe", "fbt-probe k2", "transformer_lens", "nnsight", "transformers")
PEERS = ("transformer_lens", "nnsight", "transformers")
PATCHERS = ("fbt-probe", "transformer_lens", "nnsight", "transformers")
COUNTS, BATCH = (1, 2, 4, 8), 32


# ---- models ------------------------------------------------------------------------------
def build_folder(shape: str, out: Path) -> Path:
    """A random model of ``shape`` saved with the word tokenizer (nothing downloaded)."""
    import transformers as tr

    from fbt_probe.hf import quiet
    from fbt_probe.hf.tiny import word_tokenizer

    quiet()
    if shape == "tiny":  # a quick check of the script itself
        from fbt_probe.hf.tiny import model_folder

        return model_folder(out, "llama")
    tok = word_tokenizer()
    torch.manual_seed(0)
    if shape == "gpt2":  # GPT-2 small: 12 layers, 768 wide, 12 heads, its vocabulary
        hf = tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=12, n_embd=768, n_head=12))
    else:  # a Llama of the same size class: 12 layers, 768 wide, GQA, 32k vocabulary
        hf = tr.LlamaForCausalLM(
            tr.LlamaConfig(
                vocab_size=32000,
                hidden_size=768,
                intermediate_size=2048,
                num_hidden_layers=12,
                num_attention_heads=12,
                num_key_value_heads=4,
                max_position_embeddings=2048,
            )
        )
    hf.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def load(folder: Path):
    """The Hugging Face model and its wrapper sharing its weights (a fresh fusion)."""
    from fbt_probe.hf import load_hf

    model = load_hf(folder)
    return model.hf, model


# ---- data --------------------------------------------------------------------------------
def batches(folder: Path, task: str, n: int, tmp: Path):
    """[(tokens (b, T), answer position (b,), clean id, twin tokens or None, twin id)]."""
    from probes.common.twins import pairs_of
    from tasks.dataset import load as load_ds
    from tasks.generate import generate_dataset

    twins = task == "done_tracking"
    ds = load_ds(
        generate_dataset(
            task,
            tmp / f"{task}.parquet",
            n_groups=n // len(COUNTS),
            distractors=COUNTS,
            seed=7,
            tokenizer=folder,
            twins=twins,
        )
    )
    if not twins:
        seqs = [np.asarray(ds.token_ids[i][: int(ds.colon_index[i]) + 1]) for i in range(len(ds))]
        at = ds.colon_index.astype(int)
        return _cut([(s, a, 0, None, 0) for s, a in zip(seqs, at, strict=True)])
    p = pairs_of(ds)
    keep = np.flatnonzero(p.shift == 0)
    return _cut(
        [
            (p.tokens[i], int(p.answer[i]), int(p.clean_id[i]), p.twin_tokens[i], int(p.twin_id[i]))
            for i in keep
        ]
    )


def _cut(items):
    items = sorted(items, key=lambda x: len(x[0]))
    out = []
    for k in range(0, len(items), BATCH):
        part = items[k : k + BATCH]
        T = max(len(x[0]) for x in part)
        toks = torch.tensor(np.stack([_pad(x[0], T) for x in part]))
        twin = None if part[0][3] is None else torch.tensor(np.stack([_pad(x[3], T) for x in part]))
        at = torch.tensor([x[1] for x in part])
        out.append(
            (toks, at, torch.tensor([x[2] for x in part]), twin, torch.tensor([x[4] for x in part]))
        )
    return out


def _pad(ids: np.ndarray, T: int) -> np.ndarray:
    """Right padding: a causal model's real positions never see it."""
    return np.pad(ids, (0, T - len(ids)))


# ---- the extraction job, per tool: (L + 1, n, d) --------------------------------------------
def extract(tool: str, hf, model, bs) -> torch.Tensor:
    L, out = model.cfg.n_layers, []
    for toks, at, *_ in bs:
        rows = torch.arange(len(at))
        if tool.startswith("fbt-probe"):
            names = model.depth_hooks()
            k = 2 if tool.endswith("k2") else 1
            _, caches = model.run_with_pass_caches(toks, passes=k, names_filter=names, positions=at)
            out.append(torch.stack([caches.last[h] for h in names]))
        elif tool == "transformers":
            hs = hf(input_ids=toks, output_hidden_states=True, use_cache=False).hidden_states
            out.append(torch.stack([h[rows, at] for h in hs]))
        elif tool == "transformer_lens":
            names = ["blocks.0.hook_in"] + [f"blocks.{i}.hook_out" for i in range(L)]
            _, cache = bridge(hf).run_with_cache(toks, names_filter=lambda n, s=set(names): n in s)
            out.append(torch.stack([cache[h][rows, at] for h in names]))
        else:
            out.append(_nnsight_extract(hf, toks, rows, at, L))
    return torch.cat(out, dim=1)


def _nnsight_extract(hf, toks, rows, at, L) -> torch.Tensor:
    import nnsight

    m = wrapped(hf)
    layers = _layers(m)
    with m.trace(toks):
        got = nnsight.save([])
        got.append(_first(layers[0].input)[rows, at])
        for i in range(L):
            got.append(_first(layers[i].output)[rows, at])
    return torch.stack(list(got))


# ---- the patching job, per tool: logit differences (n,) -------------------------------------
def patch(tool: str, hf, model, bs) -> torch.Tensor:
    layer, lds = model.cfg.n_layers // 2, []
    for toks, at, clean_id, twin, twin_id in bs:
        rows = torch.arange(len(at))
        if tool == "fbt-probe":
            logits = _fbt_patch(model, toks, twin, at, layer)
        elif tool == "transformers":
            logits = _torch_patch(hf, toks, twin, rows, at, layer)
        elif tool == "transformer_lens":
            logits = _tl_patch(hf, toks, twin, rows, at, layer)
        else:
            logits = _nnsight_patch(hf, toks, twin, rows, at, layer)
        lds.append(logits[rows, clean_id] - logits[rows, twin_id])
    return torch.cat(lds)


def _fbt_patch(model, toks, twin, at, layer):
    from fbt_probe.hooks import at as only_at

    name = model.depth_hooks()[layer + 1]  # the residual after ``layer``
    _, caches = model.run_with_pass_caches(twin, names_filter=name, positions=at)
    put = only_at(lambda x, hook: caches.of_pass(1)[name][:, None].expand_as(x), positions=at)
    out = model.run_with_hooks(toks, fwd_hooks=[(name, put)])
    return out.passes[-1].logits_at(torch.arange(len(at)), at)


def _torch_patch(hf, toks, twin, rows, at, layer):
    block = _hf_layers(hf)[layer]
    got = {}

    def keep(m, a, o):  # returns None: the output goes on unchanged
        got["x"] = _first(o)[rows, at]

    h = block.register_forward_hook(keep)
    try:
        hf(input_ids=twin, use_cache=False)
    finally:
        h.remove()

    def put(m, a, o):
        x = _first(o).clone()
        x[rows, at] = got["x"]
        return (x, *o[1:]) if isinstance(o, tuple) else x

    h = block.register_forward_hook(put)
    try:
        return hf(input_ids=toks, use_cache=False).logits[rows, at]
    finally:
        h.remove()


def _tl_patch(hf, toks, twin, rows, at, layer):
    b, name = bridge(hf), f"blocks.{layer}.hook_out"
    _, cache = b.run_with_cache(twin, names_filter=lambda n: n == name)
    values = cache[name][rows, at]

    def put(x, hook):
        x = x.clone()
        x[rows, at] = values
        return x

    return b.run_with_hooks(toks, fwd_hooks=[(name, put)])[rows, at]


def _nnsight_patch(hf, toks, twin, rows, at, layer):
    m = wrapped(hf)
    block = _layers(m)[layer]
    with m.trace(twin):
        values = _first(block.output)[rows, at].save()
    with m.trace(toks):
        _first(block.output)[rows, at] = values
        logits = m.lm_head.output[rows, at].save()
    return logits


# ---- the tools' wrappers, made once a process -----------------------------------------------
_CACHE: dict = {}


def bridge(hf):
    if "tl" not in _CACHE:
        from transformer_lens.model_bridge.sources import build_bridge_from_module

        arch = hf.config.architectures[0]
        _CACHE["tl"] = build_bridge_from_module(hf, arch, hf_config=hf.config, device="cpu")
    return _CACHE["tl"]


def wrapped(hf, tokenizer=None):
    if "nn" not in _CACHE:
        from nnsight import LanguageModel

        _CACHE["nn"] = LanguageModel(hf, tokenizer=tokenizer)
    return _CACHE["nn"]


def _hf_layers(hf):
    base = hf.base_model
    return base.layers if hasattr(base, "layers") else base.h


def _layers(m):
    return m.model.layers if hasattr(m, "model") and hasattr(m.model, "layers") else m.transformer.h


def _first(x):
    return x[0] if isinstance(x, tuple) else x


# ---- one measurement, in a process of its own -----------------------------------------------
class PeakRSS:
    """The resident set size sampled every 2 ms in a thread: its peak while active."""

    def __enter__(self):
        self.base, self.peak, self._on = _rss(), _rss(), True
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while self._on:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._on = False
        self._t.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(folder: Path, tool: str, job: str, n: int, out: Path) -> None:
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    bs = batches(folder, "done_tracking" if job == "patch" else "delayed_memory", n, tmp)
    hf, model = load(folder)

    def run():
        return (patch if job == "patch" else extract)(tool, hf, model, bs)

    if tool == "transformer_lens":
        bridge(hf)
    elif tool == "nnsight":
        wrapped(hf, model.encoding.tok)
    # the weights are memory-mapped: touch every page now, or their first reading during the
    # job would count as memory the job used
    for p in model.parameters():
        float(p.detach().float().sum())
    with PeakRSS() as mem:
        result = run()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    np.save(out.with_suffix(".npy"), result.float().numpy())
    out.write_text(
        json.dumps(
            {
                "seconds": statistics.median(times),
                "times": times,
                "beyond_model_mb": (mem.peak - mem.base) / 2**20,
                "n": int(result.shape[-2] if job == "extract" else len(result)),
            }
        )
    )


def measure(folder: Path, tool: str, job: str, n: int, tmp: Path) -> dict:
    out = tmp / f"{folder.name}-{job}-{tool.replace(' ', '_')}.json"
    cmd = [sys.executable, "-m", "bench.peers", "--child", str(folder), tool, job, str(n), str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    got = json.loads(out.read_text())
    got["result"] = np.load(out.with_suffix(".npy"))
    return got


def compare(name: str, folder: Path, n: int, tmp: Path) -> list[dict]:
    rows = []
    for job, tools in (("extract", TOOLS), ("patch", PATCHERS)):
        got = {t: measure(folder, t, job, n, tmp) for t in tools}
        ref = got["transformers"].get("result")
        ok = [t for t in tools if "error" not in got[t] and t in PEERS]
        best_t = min((got[t]["seconds"] for t in ok), default=None)
        best_m = min((got[t]["beyond_model_mb"] for t in ok), default=None)
        for t in tools:
            g = got[t]
            row = {"model": name, "job": job, "tool": t}
            if "error" in g:
                rows.append({**row, "error": g["error"]})
                continue
            # the last depth is left out: transformers gives it after the final norm
            cut = (slice(None, -1),) if job == "extract" else (slice(None),)
            diff = (
                float(np.abs(g["result"][cut] - ref[cut]).max())
                if ref is not None and not t.endswith("k2")
                else None
            )
            rows.append(
                {
                    **row,
                    "seconds": round(g["seconds"], 3),
                    "beyond_model_mb": round(g["beyond_model_mb"], 1),
                    "time_vs_best_peer": round(g["seconds"] / best_t, 2) if best_t else None,
                    "memory_vs_best_peer": round(g["beyond_model_mb"] / max(best_m, 1e-9), 2)
                    if best_m
                    else None,
                    "max_abs_diff_vs_transformers": diff,
                    "n": g["n"],
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="prompts (a multiple of 4)")
    ap.add_argument("--models", default="gpt2,llama,smollm2")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        folder, tool, job, n, out = a.child
        return child(Path(folder), tool, job, int(n), Path(out))
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name in a.models.split(","):
            if name == "smollm2":
                folder = ROOT / "models" / "smollm2"
                if not (folder / "config.json").is_file():
                    notes.append(
                        "smollm2 skipped: convert it first (fbt-probe convert --gguf "
                        "smollm2 --out models/smollm2)"
                    )
                    continue
            else:
                folder = build_folder(name, tmp / name)
            rows += compare(name, folder, a.n, tmp)
            print(table([r for r in rows if r["model"] == name], COLUMNS), flush=True)
    for line in notes:
        print(line)
    out = write_json(
        "peers",
        {
            "prompts": a.n,
            "counts": COUNTS,
            "batch": BATCH,
            "rows": rows,
            "notes": notes,
            "machine": machine(),
        },
    )
    print(f"wrote {out}")


COLUMNS = [
    "model",
    "job",
    "tool",
    "seconds",
    "beyond_model_mb",
    "time_vs_best_peer",
    "memory_vs_best_peer",
    "max_abs_diff_vs_transformers",
    "error",
]


if __name__ == "__main__":
    main()

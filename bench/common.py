"""Shared helpers for the benchmark scripts: timing, machine facts, JSON output."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def best_of(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time of ``repeats`` calls after ``warmup`` calls (noise only adds time)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (FLOP/s), measured warm, now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = best_of(lambda: a @ b, repeats=repeats, warmup=2)
    return 2 * n**3 / t


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def write_json(name: str, data: dict) -> Path:
    out = Path(__file__).resolve().parent / f"{name}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    return out


def table(rows: list[dict], cols: list[str]) -> str:
    w = {c: max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols), "  ".join("-" * w[c] for c in cols)]
    lines += ["  ".join(f"{r.get(c, '')}".ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def peak_tensor_memory(fn) -> float:
    """MiB: the most tensor memory ``fn`` holds at once beyond what existed before it, from
    the profiler's record of every allocation (an op's own, at its start) and free."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    held = list(itertools.accumulate(m for _, m in events))
    return max([0, *held]) / 2**20

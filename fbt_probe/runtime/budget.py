"""One estimate of a command's work before it starts, shared by the verbs whose options
multiply it (passes, sites, depths, examples): the token-passes it will run, priced at two
FLOPs per parameter each against this machine's measured matmul speed. A run past
``LIMIT_SECONDS`` is refused in one line naming the options that make it so.

The price is coarse (it leaves out attention, and that a patch re-runs only from its depth
and position; a busy machine measures slower): it tells minutes from weeks, which is all the
limit asks. On 2 cores, ``fbt-probe patch --prefill k1000 --pass 1`` on the default model
prices at more than a day and is refused; the default ``patch`` at about two minutes.
"""

from __future__ import annotations

import functools
import time

import torch

LIMIT_SECONDS = 24 * 3600  # a day of this machine: an analysis past it is refused
FULL_COST = 2.0  # the exact recurrence: one position at a time, about two passes' work


def prefill_passes(pf) -> float:
    """Passes of work a prefill (``fbt_probe.prefill.Prefill``) costs per token."""
    return FULL_COST if pf.passes is None else float(pf.passes)


@functools.cache
def machine_flops(device: str = "cpu") -> float:
    """This machine's float32 matmul speed in FLOP/s, measured once per device (about 0.05 s
    of 512 x 512 products)."""
    n, size = 0, 512
    a = torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    while True:
        a @ a
        n += 1
        if n % 4 == 0:
            sync()
            if time.perf_counter() - t0 > 0.05:
                break
    return 2.0 * size**3 * n / (time.perf_counter() - t0)


def seconds(model, token_passes: float) -> float:
    """The floor of the time ``token_passes`` tokens x passes of ``model`` take here."""
    p = next(model.parameters())
    flops = 2.0 * sum(q.numel() for q in model.parameters()) * token_passes
    return flops / machine_flops(p.device.type)


def say(s: float) -> str:
    """A duration in the largest unit that keeps it above 1."""
    for unit, n in (("year", 365 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= n:
            k = round(s / n)
            return f"{k:,} {unit}" + ("s" if k != 1 else "")
    return f"{s:.0f} seconds"


def check_work(model, token_passes: float, options: str, what: str) -> float:
    """Refuse work that would take more than ``LIMIT_SECONDS`` here: one line naming
    ``options`` (as the user spelled them) and ``what`` they ask for. Returns the estimate."""
    s = seconds(model, token_passes)
    if s > LIMIT_SECONDS:
        raise ValueError(
            f"{options}: {what} would take about {say(s)} on this machine, "
            f"more than the {say(LIMIT_SECONDS)} an analysis may; ask for less"
        )
    return s

"""Training on several processes with PyTorch's own stack: ``torchrun`` starts them,
``torch.distributed`` connects them (gloo on CPU, nccl on CUDA), DistributedDataParallel
averages the gradients.

Every rank draws the same global batch of a step from the (seed, step) stream and takes its
own contiguous rows of it, so the global batch, the pass count, the prefix lengths and the
fixed-point choice are the same at every world size and the collectives always line up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (1 process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """The one process that writes checkpoints, metrics and the model."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def all_sum(self, values: list[float], device=None) -> list[float]:
        """Sum ``values`` over every rank (the same list length on each)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


def world_from_env(device: torch.device) -> World:
    """The world ``torchrun`` describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); a single process when WORLD_SIZE is unset or 1."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(rank, size, local)


def rank_device(device: torch.device, world: World) -> torch.device:
    """On CUDA each rank of a machine takes its own GPU (cuda:LOCAL_RANK)."""
    if device.type == "cuda" and world.size > 1 and device.index is None:
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return device


def rows(n: int, part: int, parts: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of part ``part`` when ``n`` rows are split in
    ``parts`` as evenly as they go (the first ones one longer)."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def _entry(rank: int, fn, size: int, port: int, threads: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))  # fmt: skip
    if threads:
        torch.set_num_threads(threads)
    world = world_from_env(torch.device("cpu"))
    try:
        fn(world, *args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn, size: int, *args, threads: int = 0) -> None:
    """Run ``fn(world, *args)`` in ``size`` gloo processes on this machine (127.0.0.1, a free
    port), as torchrun would: for tests and benchmarks. ``fn`` must be importable (top-level);
    ``threads`` > 0 sets each process's torch threads."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(fn, size, port, threads, args), nprocs=size, join=True)

"""Training on several processes with PyTorch's own stack: ``torchrun`` starts them,
``torch.distributed`` connects them (gloo on CPU, nccl on CUDA), DistributedDataParallel
averages the gradients.

Every rank draws the same global batch of a step from the (seed, step) stream and takes its
own contiguous rows of it, so the global batch, the pass count, the prefix lengths and the
fixed-point choice are the same at every world size and the collectives always line up.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fbt_probe.runtime.device import resolve_device


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


def place(device: str) -> tuple[torch.device, World]:
    """``--device`` checked, and this process's rank: under torchrun each rank of a machine
    takes its own GPU; a single process is rank 0 of 1."""

    dev = resolve_device(device)
    world = world_from_env(dev)
    return rank_device(dev, world), world


def rows(n: int, part: int, parts: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of part ``part`` when ``n`` rows are split in
    ``parts`` as evenly as they go (the first ones one longer)."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def _entry(rank: int, fn, size: int, port: int, threads: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
    )
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
    ``threads`` > 0 sets each process's torch threads.

    The processes fork from a server process that imported torch and the trainer once (the
    "forkserver" start method): the first call pays those imports (about 2.5 s on 2 cores),
    later calls start in milliseconds instead of importing them again in every process. The
    server never runs a torch operation, so what is forked holds no threads or process group."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    multiprocessing.set_forkserver_preload(["fbt_probe.train.loop"])
    mp.start_processes(
        _entry,
        args=(fn, size, port, threads, args),
        nprocs=size,
        join=True,
        start_method="forkserver",
    )


# ---- FSDP (fully_shard): parameters, gradients and optimizer state sharded over the ranks ----
def shard_model(model) -> None:
    """``fully_shard`` every block, then the whole model (embedding, fusion, final norm)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def param_order(model) -> list[str]:
    """Parameter names in the optimizer's order (matrices first, then vectors, as the
    trainer builds its two AdamW groups): what the integer keys of its state dict mean."""
    named = list(model.named_parameters())
    return [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]


def full_states(model, opt) -> tuple[dict, dict]:
    """The whole model's and optimizer's state, gathered from the shards onto rank 0's CPU
    (a collective: every rank calls it; the others get empty dicts), in the format of an unsharded run's
    ``state_dict()`` (optimizer state keyed by parameter index), so a checkpoint is the same
    whether or not it was sharded."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    if not osd:  # with cpu_offload only rank 0 receives the gathered state
        return msd, {}
    index = {n: i for i, n in enumerate(param_order(model))}
    return msd, {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]
        ],
    }


def load_optimizer(model, opt, state: dict) -> None:
    """Load an unsharded run's optimizer state dict into the optimizer of a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = param_order(model)
    osd = {
        "state": {names[int(k)]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))

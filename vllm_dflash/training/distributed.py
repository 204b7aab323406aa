"""Data parallelism under torchrun: one process per device, gloo on CPU, NCCL on CUDA.

`torchrun --nproc-per-node N $(which vllm-dflash) train ...` sets RANK, WORLD_SIZE
and LOCAL_RANK; a plain `vllm-dflash train` runs as rank 0 of a world of 1, and
every helper here is then a no-op. Collectives go through these few functions so
the training code reads the same at any world size.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Rank 0 generates responses (vLLM) while the others wait in a barrier: allow hours.
TIMEOUT = datetime.timedelta(hours=12)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1


def world_from_env() -> World:
    def read(name: str, default: int) -> int:
        value = os.environ.get(name)
        try:
            return default if value is None else int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer (torchrun sets it)") from None

    world = World(read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0))
    if not 0 <= world.rank < world.size:
        raise ValueError(f"RANK={world.rank} must be in [0, WORLD_SIZE={world.size})")
    return world


def init(device_type: str) -> World:
    """Join the process group torchrun describes (no-op for one process)."""
    world = world_from_env()
    if world.parallel and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend, timeout=TIMEOUT)
    return world


def device_for(world: World, requested: str | None) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is used, else the requested device (default: cuda if present)."""
    name = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and world.parallel:
        return torch.device("cuda", world.local_rank)
    return device


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned (float64 sums stay exact for counts)."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: float, device: torch.device) -> float:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

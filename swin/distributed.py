"""Distributed helpers: process-group setup from torchrun's environment, and small collectives.

Every function also works in a plain single process (no process group), so the training loop
calls them unconditionally.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    """World size as torchrun announces it (1 without torchrun); readable before any setup."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(name: str) -> torch.device:
    """'auto' -> cuda if available else cpu; 'cuda' without a GPU is an error naming the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA GPU is visible; use device=cpu (or device=auto)")
    return device


def init_distributed(device_name: str = "auto") -> DistInfo:
    """Join the process group that torchrun describes (RANK/WORLD_SIZE/MASTER_ADDR...), if any.

    nccl on GPUs, gloo on the CPU; each process takes the GPU of its LOCAL_RANK.
    """
    device = pick_device(device_name)
    world_size = env_world_size()
    if world_size == 1:
        return DistInfo(0, 0, 1, device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                **({"device_id": device} if device.type == "cuda" else {}))
    return DistInfo(rank, local_rank, world_size, device)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _active():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over processes, in place (returns t). A NaN on any rank makes the sum NaN on all ranks."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """rank `src`'s value of obj, on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (obj may contain tensors)."""
    if not _active():
        return [obj]
    # torch.save to bytes first: all_gather_object's own pickling of tensors fails on some torch
    # versions (2.14: "UntypedStorage has no attribute dtype"); bytes always travel
    buf = io.BytesIO()
    torch.save(obj, buf)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, buf.getvalue())
    return [torch.load(io.BytesIO(b), weights_only=False) for b in out]  # from our own processes

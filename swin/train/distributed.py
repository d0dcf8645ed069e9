"""Distributed helpers: process-group setup from torchrun's environment (or a submitit / srun job's,
translated into torchrun's variables), and small collectives.

Every function also works in a plain single process (no process group), so the training loop
calls them unconditionally.
"""
from __future__ import annotations

import io
import os
import random
import re
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
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


# the range submitit's TorchDistributedEnvironment draws its job-id-seeded port from
MASTER_PORTS = (20000, 60000)


def job_master_port(job_id: str) -> int:
    """MASTER_PORT if set, else a port derived from the job id: every task of a job computes the same one,
    and two jobs sharing a node rarely collide (submitit's rule)."""
    if "MASTER_PORT" in os.environ:
        return int(os.environ["MASTER_PORT"])
    return random.Random(job_id).randint(*MASTER_PORTS)


def _first_slurm_host(nodelist: str) -> str:
    # SLURM's compressed node lists ("gpu[01-04,07]") are expanded by scontrol, present wherever srun is
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def job_environment() -> dict[str, str] | None:
    """torchrun's variables for a task of a multi-task job started without torchrun, or None.

    A submitit job (Hydra's submitit launcher, submitit's executors) is described by submitit.JobEnvironment;
    an srun step by SLURM's variables. Rank 0 runs on the job's (step's) first host; the port is
    job_master_port(job id).
    """
    if os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        env = submitit.JobEnvironment()
        if env.num_tasks == 1:
            return None
        rank, local_rank, world = env.global_rank, env.local_rank, env.num_tasks
        local_world, host, job_id = world // env.num_nodes, env.hostnames[0], env.job_id
    elif int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:  # srun sets it for its tasks, sbatch does not
        rank, local_rank = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_LOCALID"])
        world = int(os.environ["SLURM_STEP_NUM_TASKS"])
        local_world = world // int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))
        host, job_id = _first_slurm_host(os.environ["SLURM_STEP_NODELIST"]), os.environ["SLURM_JOB_ID"]
    else:
        return None
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": host, "MASTER_PORT": str(job_master_port(job_id))}


def export_job_environment() -> dict[str, str] | None:
    """Without torchrun, in a multi-task submitit or srun job: set torchrun's variables from the job (returned),
    so that the rest of the set-up is torchrun's path. torchrun's own variables, when present, win."""
    if "WORLD_SIZE" in os.environ:
        return None
    env = job_environment()
    if env is not None:
        os.environ.update(env)
    return env


def pick_device(name: str) -> torch.device:
    """'auto' -> cuda if available else cpu; 'cuda' without a GPU is an error naming the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r}: use auto, cpu, cuda or cuda:<index>") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA GPU is visible; use device=cpu (or device=auto)")
    return device


def init_distributed(device_name: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group that torchrun describes (RANK/WORLD_SIZE/MASTER_ADDR...), if any.

    nccl on GPUs, gloo on the CPU; each process takes the GPU of its LOCAL_RANK. timeout_s: how long a collective
    waits for the other processes before it fails (None: torch's default).
    """
    device = pick_device(device_name)
    world_size = env_world_size()
    if world_size == 1:
        return DistInfo(0, 0, 1, device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        # a cluster that binds one GPU to each task shows each task only its own, as device 0
        device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                **({"device_id": device} if device.type == "cuda" else {}),
                                **({"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}))
    return DistInfo(rank, local_rank, world_size, device)


class ProcessLost(RuntimeError):
    """A collective failed because another process of the run died or hangs (train.dist_timeout_s)."""


# what gloo's and NCCL's errors say when a peer is gone or a collective timed out (gloo's name its source file,
# .../gloo/transport/...; NCCL's timeouts are DistBackendErrors). Not a bare "timed out": a loader's timeout is not
# a lost process.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl", "gloo", "processgroup")


def lost_process(e: BaseException, info: DistInfo, last_checkpoint: Path) -> ProcessLost | None:
    """The one-line error of a collective that failed in a run of several processes, or None when ``e`` is
    something else (a real bug keeps its traceback)."""
    if not info.enabled:
        return None
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError)
                                              and any(m in text.lower() for m in _LOST_PEER))):
        return None
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]  # without gloo's source location
    resume = f"from {last_checkpoint}" if last_checkpoint.is_file() else "(no checkpoint yet: from the start)"
    return ProcessLost(f"rank {info.rank} of {info.world_size}: a collective with the other processes failed "
                       f"({reason}): a process of this run died or hangs, so the run stops; rerun the same command "
                       f"to resume {resume}")


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


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from one seed (the run's seed plus the rank: per-rank streams)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
